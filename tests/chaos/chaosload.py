"""Bounded load through the gateway, with every request classified (the chaos suite's yardstick).

Each request asks for ``max_tokens`` tokens; the sims always generate exactly that many unless
stopped (``finish_reason: "length"``), one whitespace-separated word per token, the first naming
the node (``zml_sim.engine.token_text``). So a completion can be checked word for word, and
any chunk lost in the middle of a stream shows. Outcomes:

* ``completed`` — the whole text, exactly as the node generated it, and ``usage`` agreeing.
* ``error`` — a clean retryable error: an HTTP error whose JSON body carries a retryable ZML code
  matching the status (and ``Retry-After`` where the code promises one), or a stream that ends
  with an ``error`` event carrying such a code. A connection the client sees break mid-response
  (only a dying gateway does that) is counted here as ``CONNECTION_FAILED``, the code the SDK
  gives it: the client knows, nothing is silent.
* ``unclean`` — any other error (non-retryable, unknown code, status/code mismatch, no JSON,
  missing Retry-After, an error event followed by more data).
* ``hang`` — no end within the request's own timeout plus a grace period.
* ``truncated`` — ended as a success (200, or ``[DONE]``) but shorter than asked, with a gap, or
  with ``usage`` disagreeing with the text; or a stream that just stops (no ``[DONE]``, no error).
* ``lost`` — no answer at all: no gateway took the connection.

Counted beside the outcomes (``Report.counters()``, in every summary and docs/reliability.md's
table): *client-visible errors* (``client_errors``: every answer the client saw fail, clean or
not) and *interrupted streams* (``interrupted``: a stream that had delivered content and then
ended with an error event or broke — the client holds half an answer). A scenario whose fault
the stack must hide asserts both are 0 (``Report.assert_seamless``); ``duplicated`` counts
completions that repeat text (a continuation that re-sent what the client already had).

Load is bounded in count and time: ``clients`` workers (closed loop), or an open-loop arrival
rate with a cap on requests in flight, until ``total`` requests or ``duration_s`` have passed.
Like a load balancer, a worker sends a request to the next gateway when one refuses the
connection or closes it before any response (``gateways`` lists several).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from zmlcore.errors import error_class

OUTCOMES = ("completed", "error", "unclean", "hang", "truncated", "lost")
#: How a truncated outcome's detail begins when the text repeats tokens.
DUPLICATED = "duplicated text"
#: Codes whose HTTP answer must carry Retry-After (they tell the client when to come back).
NEEDS_RETRY_AFTER = {"QUEUE_FULL", "NO_HEALTHY_NODES", "RATE_LIMITED"}
#: Failures before the response started: a load balancer sends the request elsewhere.
_NOT_STARTED = (httpx.ConnectError, httpx.ConnectTimeout)


@dataclass(slots=True)
class Result:
    outcome: str
    stream: bool
    t_start: float  # monotonic
    elapsed: float
    code: str = ""  # ZML error code for errors
    node: str = ""
    detail: str = ""
    gateway: int = 0
    retried: int = 0  # times sent to another gateway
    retry_after: float = 0.0  # the error's Retry-After (s), which a closed-loop client honours
    #: A stream that ended with an error (or broke) after content had been received.
    interrupted: bool = False


@dataclass
class Report:
    name: str
    results: list[Result] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0
    notes: dict[str, Any] = field(default_factory=dict)

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.results if r.outcome == outcome)

    @property
    def total(self) -> int:
        return len(self.results)

    @property
    def interrupted(self) -> int:
        """Streams cut after content was received (an error event, or a break)."""
        return sum(1 for r in self.results if r.interrupted)

    @property
    def client_errors(self) -> int:
        """Answers the client saw fail: clean errors and unclean ones."""
        return sum(1 for r in self.results if r.outcome in ("error", "unclean"))

    @property
    def duplicated(self) -> int:
        """Completions whose text repeats tokens (counted as truncated too)."""
        return sum(1 for r in self.results if r.outcome == "truncated" and r.detail.startswith(DUPLICATED))

    def counters(self) -> dict[str, int]:
        """The figures a fault is judged by, each on its own: client-visible errors, interrupted
        streams, and what must never happen (lost, hung, truncated, duplicated, unclean)."""
        return {"client_errors": self.client_errors, "interrupted": self.interrupted, "lost": self.count("lost"),
                "hang": self.count("hang"), "truncated": self.count("truncated"), "duplicated": self.duplicated,
                "unclean": self.count("unclean")}

    def codes(self) -> Counter[str]:
        return Counter(r.code for r in self.results if r.outcome == "error")

    def bad(self, limit: int = 8) -> list[str]:
        return [f"{r.outcome} {'stream' if r.stream else 'json'} {r.code} {r.detail}"[:300]
                for r in self.results if r.outcome not in ("completed", "error")][:limit]

    def window(self, start: float, end: float) -> list[Result]:
        """Results of requests started in [start, end) (monotonic times)."""
        return [r for r in self.results if start <= r.t_start < end]

    def latency(self, q: float, outcome: str = "completed") -> float:
        xs = sorted(r.elapsed for r in self.results if r.outcome == outcome)
        if not xs:
            return float("nan")
        return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scenario": self.name, "requests": self.total,
                               "streamed": sum(1 for r in self.results if r.stream)}
        for o in OUTCOMES:
            out[o] = self.count(o)
        out["error_codes"] = dict(self.codes())
        out["client_errors"] = self.client_errors
        out["interrupted"] = self.interrupted
        out["duplicated"] = self.duplicated
        out["p50_s"] = round(self.latency(0.5), 3)
        out["p99_s"] = round(self.latency(0.99), 3)
        out["duration_s"] = round(self.t1 - self.t0, 2)
        out.update(self.notes)
        return out

    def assert_clean(self, *, min_completed: float = 0.8) -> None:
        """Nothing hung, truncated, lost or unclean; most requests completed."""
        s = self.summary()
        problems = {o: s[o] for o in ("unclean", "hang", "truncated", "lost") if s[o]}
        assert not problems, f"{self.name}: {problems}; {s}; e.g. {self.bad()}"
        assert s["completed"] >= min_completed * max(1, s["requests"]), f"{self.name}: too few completed: {s}"

    def assert_seamless(self, *, allow: tuple[str, ...] = ()) -> None:
        """A fault the user must not notice: clean (:meth:`assert_clean`, every request
        completed but those whose error codes are in ``allow``), no stream interrupted, no
        client-visible error (codes in ``allow`` excepted, e.g. ``RATE_LIMITED``)."""
        allowed = sum(n for code, n in self.codes().items() if code in allow)
        self.assert_clean(min_completed=0.0)
        c = self.counters()
        assert c["interrupted"] == 0, f"{self.name}: {c}; {self.codes()}; e.g. {self.errors()}"
        assert c["client_errors"] == allowed, f"{self.name}: {c}; {self.codes()}; e.g. {self.errors()}"
        assert self.count("completed") + allowed == self.total, f"{self.name}: {self.summary()}"

    def errors(self, limit: int = 8) -> list[str]:
        """The client-visible errors, for an assertion's message."""
        return [f"{r.outcome} {'stream' if r.stream else 'json'} {r.code} "
                f"{'(interrupted) ' if r.interrupted else ''}{r.detail}"[:300]
                for r in self.results if r.outcome in ("error", "unclean")][:limit]


def expected_words(node: str, n: int) -> list[str]:
    from zml_sim.engine import token_text

    return [token_text(node, i).strip() for i in range(n)]


def check_text(text: str, n: int, usage: dict[str, Any] | None, finish: str | None) -> tuple[str, str, str]:
    """(outcome, detail) for a completion that ended as a success."""
    words = text.split()
    if not words or not (words[0].startswith("[") and words[0].endswith("]")):
        return "truncated", "", f"text does not start with a node tag: {text[:60]!r}"
    node = words[0][1:-1]
    if len(words) > n or any(w.startswith("[") for w in words[1:]):
        return "truncated", "", f"{DUPLICATED}: {len(words)} words for {n} tokens ({node}), finish={finish}"
    if len(words) != n:
        return "truncated", "", f"{len(words)} of {n} tokens ({node}), finish={finish}"
    if words != expected_words(node, n):
        return "truncated", "", f"text has a gap or corruption ({node})"
    if usage is None:
        return "truncated", "", "no usage"
    if usage.get("completion_tokens") != n:
        return "truncated", "", f"usage.completion_tokens={usage.get('completion_tokens')} for {n} tokens of text"
    if finish != "length":
        return "truncated", "", f"finish_reason={finish!r} for a full-length completion"
    return "completed", "", node


def classify_error(status: int, body: bytes, headers: httpx.Headers | None) -> tuple[str, str, str]:
    """(outcome, code, detail) for an HTTP error answer."""
    try:
        err = json.loads(body)["error"]
        code = err["code"]
        assert isinstance(code, str)
    except (ValueError, KeyError, TypeError, AssertionError):
        return "unclean", "", f"HTTP {status} without a ZML error body: {body[:120]!r}"
    cls = error_class(code)
    if cls.code != code:
        return "unclean", code, f"unknown code {code} (HTTP {status})"
    if cls.http_status != status:
        return "unclean", code, f"HTTP {status} for {code} (expected {cls.http_status})"
    if not cls.retryable:
        return "unclean", code, f"non-retryable {code}: {err.get('message', '')[:120]}"
    if headers is not None and code in NEEDS_RETRY_AFTER and not headers.get("retry-after"):
        return "unclean", code, f"{code} without Retry-After"
    return "error", code, str(err.get("message", ""))[:160]


def classify_event_error(data: dict[str, Any]) -> tuple[str, str, str]:
    err = data.get("error")
    code = err.get("code") if isinstance(err, dict) else None
    if not isinstance(code, str):
        return "unclean", "", f"stream error event without a code: {str(data)[:120]}"
    cls = error_class(code)
    if cls.code != code or not cls.retryable:
        return "unclean", code, f"stream error {code}: {str(err.get('message', ''))[:120]}"
    return "error", code, str(err.get("message", ""))[:160]


@dataclass
class Load:
    """What to send. ``max_tokens`` is drawn uniformly from ``tokens`` per request."""

    gateways: list[str]
    model: str
    tokens: tuple[int, int] = (16, 48)
    stream_share: float = 0.5
    timeout_s: float = 10.0
    grace_s: float = 5.0
    seed: int = 1
    prompt_chars: int = 5  # the sim counts 4 characters a token
    extra: dict[str, Any] = field(default_factory=dict)


class LoadGen:
    def __init__(self, load: Load) -> None:
        self.load = load
        self._retry_after: dict[int, float] = {}  # per task: the last error answer's Retry-After
        self._cut: dict[int, bool] = {}  # per task: its stream had content when it ended
        self.rng = random.Random(load.seed)
        self.clients = [httpx.AsyncClient(base_url=g, timeout=httpx.Timeout(load.timeout_s + load.grace_s),
                                          limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
                        for g in load.gateways]
        self._next_gw = 0
        self.in_flight = 0
        self._stopping = False

    def stop(self) -> None:
        """Closed-loop workers send nothing more (requests in flight finish)."""
        self._stopping = True

    async def aclose(self) -> None:
        for c in self.clients:
            await c.aclose()

    async def __aenter__(self) -> LoadGen:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- one request ---------------------------------------------------------------------------
    async def one(self) -> Result:
        ld = self.load
        n = self.rng.randint(*ld.tokens)
        stream = self.rng.random() < ld.stream_share
        body: dict[str, Any] = {"model": ld.model, "messages": [{"role": "user", "content": ("chaos " * (ld.prompt_chars // 6 + 1))[:ld.prompt_chars]}],
                                "max_tokens": n, "stream": stream, "timeout_ms": int(ld.timeout_s * 1000), **ld.extra}
        if stream:
            body["stream_options"] = {"include_usage": True}
        t0 = time.monotonic()
        gw = self._next_gw % len(self.clients)
        self._next_gw += 1
        retried = 0
        self.in_flight += 1
        try:
            while True:
                try:
                    async with asyncio.timeout(ld.timeout_s + ld.grace_s):
                        outcome, code, detail = await (self._stream if stream else self._json)(self.clients[gw], body, n)
                    break
                except _NOT_STARTED as exc:
                    retried += 1
                    if retried >= 2 * len(self.clients):
                        outcome, code, detail = "lost", "", f"no gateway took the connection: {exc!r}"
                        break
                    gw = (gw + 1) % len(self.clients)
                    await asyncio.sleep(0.05 * retried)
                except _Unstarted:
                    # Closed before any response (a gateway dying as it took the request): like a
                    # load balancer, send it to another gateway.
                    retried += 1
                    if retried >= 2 * len(self.clients):
                        outcome, code, detail = "lost", "", "every gateway closed before answering"
                        break
                    gw = (gw + 1) % len(self.clients)
                except (TimeoutError, httpx.TimeoutException):
                    outcome, code, detail = "hang", "", f"no end within {ld.timeout_s + ld.grace_s:g} s"
                    break
                except httpx.TransportError as exc:
                    outcome, code, detail = "error", "CONNECTION_FAILED", f"connection broke mid-response: {exc!r}"
                    break
        finally:
            self.in_flight -= 1
        node = detail if outcome == "completed" else ""
        ra = self._retry_after.pop(id(asyncio.current_task()), 0.0)
        # Interrupted: content had reached the client, then the stream ended in an error or broke.
        cut = self._cut.pop(id(asyncio.current_task()), False) and outcome in ("error", "unclean")
        return Result(outcome, stream, t0, time.monotonic() - t0, code, node, "" if node else detail, gw, retried, ra,
                      cut)

    def _note_retry_after(self, headers: httpx.Headers) -> None:
        try:
            self._retry_after[id(asyncio.current_task())] = float(headers.get("retry-after") or 0)
        except ValueError:
            pass

    async def _json(self, client: httpx.AsyncClient, body: dict[str, Any], n: int) -> tuple[str, str, str]:
        try:
            r = await client.post("/v1/chat/completions", json=body)
        except httpx.RemoteProtocolError as exc:
            if "without sending" in str(exc) or "Server disconnected" in str(exc):
                raise _Unstarted from exc
            raise
        if r.status_code != 200:
            self._note_retry_after(r.headers)
            return classify_error(r.status_code, r.content, r.headers)
        try:
            data = r.json()
            choice = data["choices"][0]
            text = choice["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            return "truncated", "", f"200 with an unreadable body: {r.content[:120]!r}"
        return check_text(text, n, data.get("usage"), choice.get("finish_reason"))

    async def _stream(self, client: httpx.AsyncClient, body: dict[str, Any], n: int) -> tuple[str, str, str]:
        try:
            cm = client.stream("POST", "/v1/chat/completions", json=body)
            r = await cm.__aenter__()
        except httpx.RemoteProtocolError as exc:
            if "without sending" in str(exc) or "Server disconnected" in str(exc):
                raise _Unstarted from exc
            raise
        try:
            if r.status_code != 200:
                self._note_retry_after(r.headers)
                return classify_error(r.status_code, await r.aread(), r.headers)
            parts: list[str] = []
            usage: dict[str, Any] | None = None
            finish: str | None = None
            ended: tuple[str, str, str] | None = None
            async for line in r.aiter_lines():
                if not line:
                    continue
                if ended is not None:
                    return "unclean", ended[1], f"data after the end of the stream: {line[:80]!r}"
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    ended = check_text("".join(parts), n, usage, finish)
                    continue
                try:
                    data = json.loads(payload)
                except ValueError:
                    return "unclean", "", f"non-JSON event {payload[:80]!r}"
                if "error" in data and not data.get("choices"):
                    ended = classify_event_error(data)
                    continue
                for choice in data.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if delta.get("content"):
                        parts.append(delta["content"])
                        self._cut[id(asyncio.current_task())] = True  # from now on an error interrupts it
                    if choice.get("finish_reason"):
                        finish = choice["finish_reason"]
                if data.get("usage"):
                    usage = data["usage"]
            if ended is None:
                return "truncated", "", f"stream stopped after {len(''.join(parts).split())} of {n} tokens without [DONE] or an error"
            return ended
        finally:
            await cm.__aexit__(None, None, None)

    # --- load shapes ---------------------------------------------------------------------------
    async def closed(self, report: Report, *, clients: int = 8, total: int | None = None,
                     duration_s: float | None = None, pace_s: float = 0.0,
                     on_progress: Callable[[int], Any] | None = None) -> Report:
        """``clients`` workers, each sending its next request when the last one ends (after the
        last answer's Retry-After, at most 1 s, as a well-behaved client would)."""
        assert total is not None or duration_s is not None
        report.t0 = report.t0 or time.monotonic()
        end = time.monotonic() + duration_s if duration_s is not None else math.inf
        issued = 0

        async def worker() -> None:
            nonlocal issued
            while (total is None or issued < total) and time.monotonic() < end and not self._stopping:
                issued += 1
                result = await self.one()
                report.results.append(result)
                if on_progress is not None:
                    on_progress(len(report.results))
                if pace_s or result.retry_after:
                    await asyncio.sleep(max(pace_s, min(result.retry_after, 1.0)))

        await asyncio.gather(*(worker() for _ in range(clients)))
        report.t1 = time.monotonic()
        return report

    async def open(self, report: Report, *, rate: float, duration_s: float, max_in_flight: int = 256) -> Report:
        """Poisson arrivals at ``rate``/s for ``duration_s`` (at most ``max_in_flight`` at once:
        beyond that an arrival waits, so the client never grows without bound)."""
        report.t0 = report.t0 or time.monotonic()
        sem = asyncio.Semaphore(max_in_flight)
        tasks: list[asyncio.Task[None]] = []

        async def run() -> None:
            try:
                report.results.append(await self.one())
            finally:
                sem.release()

        start = time.monotonic()
        t = start
        while t < start + duration_s:
            t += self.rng.expovariate(rate)
            delay = t - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            await sem.acquire()
            tasks.append(asyncio.create_task(run()))
        await asyncio.gather(*tasks)
        report.t1 = time.monotonic()
        return report


class _Unstarted(Exception):
    """The gateway closed the connection before any response byte."""


def record(report: Report) -> dict[str, Any]:
    """The report's figures, printed (pytest -s shows them) and appended to $ZML_CHAOS_REPORT
    (JSON lines), the source of docs/reliability.md's table."""
    import os

    s = report.summary()
    print(json.dumps(s))
    path = os.environ.get("ZML_CHAOS_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(s) + "\n")
    return s


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """docs/reliability.md's table from record()'s JSON lines."""
    head = ("| scenario | requests (streamed) | completed | clean errors (codes) | client-visible errors "
            "| interrupted streams | hangs | truncated | lost | unclean | p50 / p99 s | other figures |")
    out = [head, "|" + "---|" * 12]
    std = {"scenario", "requests", "streamed", "error_codes", "p50_s", "p99_s", "duration_s", "fault_t",
           "in_flight_at_fault", "client_errors", "interrupted", "duplicated", *OUTCOMES}
    for r in rows:
        codes = ", ".join(f"{k} {v}" for k, v in sorted(r["error_codes"].items())) or "-"
        other = ", ".join(f"{k} {v}" for k, v in r.items() if k not in std)
        out.append(f"| {r['scenario']} | {r['requests']} ({r['streamed']}) | {r['completed']} | {r['error']} ({codes}) "
                   f"| {r.get('client_errors', '-')} | {r.get('interrupted', '-')} | {r['hang']} | {r['truncated']}"
                   f"{' (duplicated %d)' % r['duplicated'] if r.get('duplicated') else ''} "
                   f"| {r['lost']} | {r['unclean']} "
                   f"| {r['p50_s']} / {r['p99_s']} | {other or '-'} |")
    return "\n".join(out)


if __name__ == "__main__":  # python tests/chaos/chaosload.py /tmp/chaos.jsonl
    import sys

    with open(sys.argv[1]) as f:
        print(markdown_table([json.loads(line) for line in f if line.strip()]))
