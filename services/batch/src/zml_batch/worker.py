"""The runner's line engine: shards taken from the work queue, their lines sent to the routers
as batch-priority requests within the routers' headroom, each answer recorded before the shard
is let go.

Exactly once, across crashes:

* a line's result goes to the results stream (one subject per line, the first result kept)
  **before** its shard is acknowledged; a shard is acknowledged only once every line of it has
  a result (or its batch was cancelled or expired);
* a runner that dies holding a shard stops renewing it, and JetStream gives it to another
  runner ``[batch] takeover_s`` later; that runner reads the shard's recorded results first and
  sends only the lines without one, so a line already answered is never asked again, and the
  lines that were in flight at the crash are sent once more;
* a line keeps one request id on every attempt and every runner, so while one copy runs on a
  router a second is refused (DUPLICATE_REQUEST_ID) instead of reaching a node.

The parts: :class:`~zml_batch.shardrun.ShardRun` (which line next, sans-I/O),
:class:`~zml_batch.gate.Gate` (how many in flight, sans-I/O), :mod:`zml_batch.outcome` (what an
error means for the line), :mod:`zml_batch.request` (the request body).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError

from zmlcore import subjects
from zmlcore.batch import objects, records
from zmlcore.batch.ids import line_request_id
from zmlcore.batch.store import BatchStore
from zmlcore.bus.link import link_of
from zmlcore.config import ZMLConfig
from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.errors import ZMLError, error_class
from zmlcore.messages.batch import BatchEvent, BatchRecord, BatchTask, LineResult, ShardTask, shard_task_decoder
from zmlcore.reply.exchange import Exchange, parts_buffer
from zmlcore.telemetry import tracing
from zml_batch import metrics, outcome
from zml_batch.plans import Plans
from zml_batch.gate import ACCEPT_S, Gate
from zml_batch.request import Line, parse, with_policy
from zml_batch.shardrun import Job, ShardRun

log = logging.getLogger("zml.batch")
_encode = msgspec.json.encode

#: How often progress goes to the batch records (and their status is read back).
PROGRESS_S = 1.0
#: Pause after a failed write to the store (the broker is restarting, say) before trying again.
STORE_RETRY_S = 0.5
#: Keepalives asked of the router per line: a line runs for seconds to minutes, and a router that
#: dies is noticed after three silent intervals (15 s: nothing for a batch); every keepalive is a
#: message for the router and the runner, so a second each would cost more than the line itself.
KEEPALIVE_S = 5.0


class _Usage(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0


class _Zml(msgspec.Struct):
    node_id: str = ""
    family: str = ""


class _Reply(msgspec.Struct):
    usage: _Usage | None = None
    zml: _Zml | None = None


_reply = msgspec.json.Decoder(_Reply)


@dataclass(slots=True)
class Batch:
    """What a runner knows of a batch it holds shards of (refreshed from its record)."""

    id: str
    owner: str
    expires_at: float
    policy: bytes  # the member spliced into bodies that name no policy
    traceparent: str
    stopping: str = ""
    shards: int = 0
    #: Its key's plan has no tokens left until then (monotonic): its lines wait.
    plan_wait_until: float = 0.0


@dataclass(slots=True)
class Held:
    """A shard this runner holds: its work message (renewed, acked at the end) and its lines."""

    msg: Msg
    task: ShardTask
    batch: Batch
    lines: list[Line]
    run: ShardRun
    written: list[int] = field(default_factory=list)  # counts last written to the record
    renewed: float = 0.0

    @property
    def key(self) -> tuple[str, int]:
        return self.task.batch_id, self.task.shard


class Worker:
    def __init__(self, cfg: ZMLConfig, nc: NATS, store: BatchStore, *, runner_id: str,
                 policy_of: Callable[[BatchRecord], bytes], plans: Plans | None = None) -> None:
        self.cfg = cfg
        self.bc = cfg.batch
        self.nc = nc
        self.store = store
        self.runner_id = runner_id
        self.policy_of = policy_of
        self.plans = plans
        self.held: dict[tuple[str, int], Held] = {}
        self.batches: dict[str, Batch] = {}
        self.gates: dict[str, Gate] = {}
        self.in_flight = 0
        self.max_held = max(2, math.ceil(self.bc.max_in_flight / self.bc.shard_lines) + 1)
        self._wake = asyncio.Event()
        self._lines: set[asyncio.Task[None]] = set()
        self._psub: Any = None
        self._stopping = False
        self.max_reply = cfg.nats.max_reply_bytes
        self._generation = link_of(nc).generation

    # --- the loops -----------------------------------------------------------------------------------
    async def run(self) -> None:
        """Send lines while there is room; take another shard when nothing held can be sent."""
        self._psub = await self.nc.jetstream().pull_subscribe(
            subjects.BATCH_WORK_SHARDS, durable=subjects.BATCH_SHARD_CONSUMER, stream=subjects.BATCH_WORK_STREAM)
        while not self._stopping:
            now = time.monotonic()
            sent = self._fill(now)
            self._finish_done()
            if self._want_shard(now):
                if await self._take_shard():
                    continue
            wait = self._next_wake(time.monotonic()) if not sent else 0.0
            self._wake.clear()
            if wait > 0:
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except asyncio.TimeoutError:
                    pass
            else:
                await asyncio.sleep(0)

    async def upkeep(self) -> None:
        """Every second: progress to the records (and their status back), held shards renewed."""
        while True:
            await asyncio.sleep(PROGRESS_S)
            try:
                await self._after_reconnect()
                await self._write_progress()
                await self._renew()
                await self._check_plans()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("batch progress not written", exc_info=True)

    async def stop(self) -> None:
        """Stop sending; lines in flight end (bounded), then held shards are left unacked for
        another runner (their recorded lines are not asked again)."""
        self._stopping = True
        self._wake.set()
        if self._lines:
            await asyncio.wait(list(self._lines), timeout=10)
        for task in list(self._lines):
            task.cancel()
        try:
            await self._write_progress()
        except Exception:
            pass
        for held in self.held.values():
            try:  # handed back now rather than after the ack wait
                await held.msg.nak()
            except Exception:
                pass

    # --- shards --------------------------------------------------------------------------------------
    def _want_shard(self, now: float) -> bool:
        if len(self.held) >= self.max_held or self.in_flight >= self.bc.max_in_flight:
            return False
        if any(g.wait_s(now) > 0 for g in self.gates.values()):
            return False  # the routers just said "no room": more work would only wait here
        return all(h.run.peek(now) is None for h in self.held.values())

    async def _take_shard(self) -> bool:
        if not self.nc.is_connected:
            return False
        try:
            msgs = await self._psub.fetch(1, timeout=1.0 if not self.held else 0.2)
        except asyncio.TimeoutError:
            return False
        except Exception as exc:  # the broker is away: try again shortly
            log.debug("no shard fetched: %s", exc)
            await asyncio.sleep(STORE_RETRY_S)
            return False
        for msg in msgs:
            await self._hold(msg)
        return bool(msgs)

    async def _hold(self, msg: Msg) -> None:
        try:
            task = shard_task_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("undecodable shard on %s: dropped", msg.subject)
            await msg.term()
            return
        try:
            batch = await self._batch(task.batch_id, task.owner)
        except ZMLError:  # the batch record is gone (expired and deleted): nothing to do
            await msg.ack()
            return
        answered: dict[int, tuple[bool, int, int]] = {}
        if msg.metadata.num_delivered > 1:  # taken over: what is recorded is not asked again
            async for r in self.store.results(task.batch_id, task.shard):
                answered[r.line] = (r.status_code == 200, r.prompt_tokens, r.completion_tokens)
            log.info("shard %d of %s taken over: %d of %d lines already answered", task.shard, task.batch_id,
                     len(answered), len(task.lines))
        lines = [parse(bytes(raw)) for raw in task.lines]
        run = ShardRun(task.first, len(lines), answered_before=answered, max_attempts=self.bc.max_attempts)
        held = Held(msg, task, batch, lines, run, renewed=time.monotonic())
        if batch.stopping:
            run.stop(batch.stopping)
        self.held[held.key] = held
        metrics.SHARDS.set(len(self.held))

    async def _batch(self, batch_id: str, owner: str) -> Batch:
        b = self.batches.get(batch_id)
        if b is None:
            rec = await self.store.batch(owner, batch_id)
            b = self.batches[batch_id] = Batch(rec.id, rec.owner, rec.expires_at, self.policy_of(rec),
                                               rec.traceparent, records.stopping(rec, time.time()), rec.shards)
        return b

    def _finish_done(self) -> None:
        for held in [h for h in self.held.values() if h.run.finished]:
            del self.held[held.key]
            self._spawn(self._release(held))
        metrics.SHARDS.set(len(self.held))

    async def _release(self, held: Held) -> None:
        """The shard is over: its final counts (and "done") into the record, then the ack. The
        last shard of a batch queues the batch's finalization."""
        task = held.task
        while True:
            try:
                rec = await self.store.update_batch(
                    held.batch.owner, task.batch_id,
                    lambda r: records.progress(r, task.shard, held.run.counts, done=True))
                if records.all_done(rec):
                    await self.store.publish(subjects.BATCH_WORK_FINAL,
                                             _encode(BatchTask(batch_id=rec.id, owner=rec.owner)), f"final:{rec.id}")
                await held.msg.ack()
                break
            except ZMLError:  # the record is gone: nothing to write out
                await held.msg.ack()
                break
            except Exception as exc:
                log.warning("shard %d of %s not released yet (%s); retrying", task.shard, task.batch_id, exc)
                await asyncio.sleep(STORE_RETRY_S)
        if not any(h.task.batch_id == task.batch_id for h in self.held.values()):
            self.batches.pop(task.batch_id, None)

    async def _renew(self) -> None:
        now = time.monotonic()
        for held in list(self.held.values()):
            if now - held.renewed >= self.bc.takeover_s / 4:  # well within the ack wait
                held.renewed = now
                try:
                    await held.msg.in_progress()
                except Exception:
                    pass

    async def _after_reconnect(self) -> None:
        """After the broker came back, a shard we hold may have been given to another runner
        meanwhile (our renewals could not reach it): what that runner recorded is not sent again."""
        generation = link_of(self.nc).generation
        if generation == self._generation:
            return
        self._generation = generation
        for held in list(self.held.values()):
            recorded = {r.line: (r.status_code == 200, r.prompt_tokens, r.completion_tokens)
                        async for r in self.store.results(held.task.batch_id, held.task.shard)}
            new = held.run.learn(recorded)
            if new:
                log.info("shard %d of %s: %d lines recorded by another runner meanwhile", held.task.shard,
                         held.task.batch_id, new)

    async def _check_plans(self) -> None:
        """Hold the lines of batches whose key has spent its tokens per minute."""
        if self.plans is None:
            return
        for batch in list(self.batches.values()):
            wait = await self.plans.wait_s(batch.owner)
            batch.plan_wait_until = time.monotonic() + wait if wait > 0 else 0.0

    async def _write_progress(self) -> None:
        """One compare-and-set per batch with changed counts; the record's status comes back
        (a cancel, the window's end) and stops its shards here."""
        by_batch: dict[str, list[Held]] = {}
        for held in self.held.values():
            by_batch.setdefault(held.task.batch_id, []).append(held)
        now = time.time()
        for batch_id, helds in by_batch.items():
            batch = helds[0].batch
            changed = [h for h in helds if h.run.counts != h.written]

            def change(r: BatchRecord, helds: list[Held] = changed) -> BatchRecord | None:
                new = None
                for h in helds:
                    new = records.progress(new or r, h.task.shard, h.run.counts, done=False) or new
                return new

            rec = await self.store.update_batch(batch.owner, batch_id, change)
            for h in changed:
                h.written = list(h.run.counts)
            why = records.stopping(rec, now)
            if why and not batch.stopping:
                log.info("batch %s %s: its lines stop here", batch_id, why)
            batch.stopping = why
            for h in helds:
                if why and not h.run.stopped:
                    h.run.stop(why)
            if changed:
                self._event(rec)
        self._wake.set()

    def _event(self, rec: BatchRecord) -> None:
        self._spawn(self._publish_event(objects.event(rec, time.time())))

    async def _publish_event(self, ev: BatchEvent) -> None:
        if self.nc.is_connected:
            try:
                await self.nc.publish(subjects.BATCH_EVENTS, _encode(ev))
            except Exception:
                pass

    # --- lines ---------------------------------------------------------------------------------------
    def _gate(self, model: str) -> Gate:
        gate = self.gates.get(model)
        if gate is None:
            gate = self.gates[model] = Gate(self.bc.max_in_flight)
        return gate

    def _fill(self, now: float) -> bool:
        """Send every line that is due and has room; True if any went."""
        sent = False
        if not self.nc.is_connected:
            return False
        for held in list(self.held.values()):
            if held.batch.plan_wait_until > now:
                continue  # its key's tokens per minute are spent
            while self.in_flight < self.bc.max_in_flight:
                index = held.run.peek(now)
                if index is None:
                    break
                line = held.lines[index - held.task.first]
                gate = self._gate(line.model)
                if not gate.may_send(now):
                    break
                job = held.run.take(now)
                assert job is not None
                gate.sent()
                self.in_flight += 1
                metrics.IN_FLIGHT.set(self.in_flight)
                self._spawn(self._line(held, job, line, gate))
                sent = True
        return sent

    def _next_wake(self, now: float) -> float:
        """Seconds until something could be sent without a line ending first (a line's end
        wakes the loop itself): a line coming due, a gate's backoff or a plan's wait ending.
        A line due now but held by a full window waits for that wake, not for a timer."""
        times = []
        for held in self.held.values():
            due = held.run.next_due()
            if due is None:
                continue
            if due > now:
                times.append(due - now)
                continue
            if held.batch.plan_wait_until > now:
                times.append(held.batch.plan_wait_until - now)
                continue
            index = held.run.peek(now)
            if index is not None:
                wait = self._gate(held.lines[index - held.task.first].model).wait_s(now)
                if wait > 0:
                    times.append(wait)
        return min(1.0, max(0.005, min(times, default=1.0)))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._lines.add(task)
        task.add_done_callback(self._lines.discard)

    async def _line(self, held: Held, job: Job, line: Line, gate: Gate) -> None:
        t0 = time.monotonic()
        batch = held.batch
        request_id = line_request_id(batch.id, job.index)
        left = batch.expires_at - time.time()
        timeout = max(5.0, min(self.bc.line_timeout_s, left + 5.0))
        headers = {subjects.H_REQUEST_ID: request_id, subjects.H_TIMEOUT_MS: str(int(timeout * 1000)),
                   subjects.H_PRIORITY: subjects.PRIORITY_BATCH, subjects.H_ACCEPT_ROUTING: subjects.ROUTING_IN_BODY}
        body = with_policy(line.body, batch.policy, line.has_policy)
        span = self._span(batch, line, job) if tracing.ON else None
        if span is not None:
            from opentelemetry import trace

            tracing.inject(headers, trace.set_span_in_context(span))
        code: str | None = None
        data = b""
        retry_after: float | None = None
        accepted = False
        ex = Exchange(self.nc, body, headers, timeout_s=timeout, wait_s=timeout + 2.0, keepalive_s=KEEPALIVE_S,
                      accept_parts=self.max_reply, buffer=parts_buffer(self.max_reply, self.nc.max_payload),
                      no_router_grace_s=self.cfg.gateway.no_router_grace_s)
        try:
            await ex.send()
            reply_task = asyncio.ensure_future(ex.reply())
            done, _ = await asyncio.wait({reply_task}, timeout=ACCEPT_S)
            if not done:
                accepted = True
                gate.accepted()
                self._wake.set()  # the window grew: more may go now
            reply = await reply_task
            rh = reply.headers or {}
            data = reply.data
            code = rh.get(subjects.H_ERROR_CODE)
            if code is None and rh.get("Status") == "503" and not data:
                code = "NO_HEALTHY_NODES"  # no router subscribed (past the grace)
            if rh.get(subjects.H_RETRY_AFTER):
                try:
                    retry_after = float(rh[subjects.H_RETRY_AFTER])
                except ValueError:
                    pass
        except ZMLError as exc:
            code, retry_after, data = exc.code, exc.retry_after, _encode(exc.to_body())
        except asyncio.CancelledError:
            ex.close()
            raise
        except (NatsError, OSError) as exc:  # the broker went away mid-request: try the line again
            code = ZMLConnectionError.code
            data = _encode(ZMLConnectionError(f"{type(exc).__name__}: {exc}").to_body())
        finally:
            ex.close()
        kind = outcome.classify(code)
        now = time.monotonic()
        self.in_flight -= 1
        metrics.IN_FLIGHT.set(self.in_flight)
        try:
            if kind == "refused":
                gate.refused(now, retry_after)
                metrics.LINES("refused").inc()
                held.run.retry(job.index, now + outcome.retry_delay(kind, code, job.attempt, retry_after), counts=False)
                return
            if not accepted and kind == "answer" and code is None:
                gate.accepted()  # answered within ACCEPT_S: it was taken too
            gate.ended(now)
            if kind in ("busy", "retry"):
                counts = kind == "retry"
                if held.run.retry(job.index, now + outcome.retry_delay(kind, code, job.attempt, retry_after),
                                  counts=counts):
                    if counts:
                        metrics.LINES("retried").inc()
                    return
                # attempts used up: the last error is its answer
            result = self._result(line, job, request_id, code, data)
            await self._record(held, result)
            metrics.LINE_TIME.observe(time.monotonic() - t0)
            metrics.LINES("completed" if result.status_code == 200 else "failed").inc()
        finally:
            if span is not None:
                span.set_attribute("zml.batch.outcome", kind if code else "completed")
                if code:
                    span.set_attribute("zml.error.code", code)
                span.end()
            self._wake.set()

    def _result(self, line: Line, job: Job, request_id: str, code: str | None, data: bytes) -> LineResult:
        status = 200 if code is None else error_class(code).http_status
        prompt = completion = 0
        node = family = ""
        if code is None:
            try:
                info = _reply.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                info = _Reply()
            if info.usage is not None:
                prompt, completion = info.usage.prompt_tokens, info.usage.completion_tokens
            if info.zml is not None:
                node, family = info.zml.node_id, info.zml.family
        if not data.strip():
            data = b"null"
        return LineResult(line=job.index, custom_id=line.custom_id, status_code=status, request_id=request_id,
                          body=msgspec.Raw(data), prompt_tokens=prompt, completion_tokens=completion, node_id=node,
                          family=family, attempts=job.attempt, ts=time.time())

    async def _record(self, held: Held, result: LineResult) -> None:
        """Store the result durably (retrying through a broker restart), then count it."""
        while True:
            try:
                if not self.nc.is_connected:
                    link = link_of(self.nc)
                    await asyncio.wait_for(link.reconnected(link.generation), 5.0)
                await self.store.record(held.task.batch_id, held.task.shard, result)
                break
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("result of line %d of %s not recorded yet (%s); retrying", result.line,
                            held.task.batch_id, exc)
                await asyncio.sleep(STORE_RETRY_S)
        held.run.answered(result.line, ok=result.status_code == 200, prompt=result.prompt_tokens,
                          completion=result.completion_tokens)
        if result.status_code == 200:
            fam = result.family or "unknown"
            metrics.TOKENS(fam, "prompt").inc(result.prompt_tokens)
            metrics.TOKENS(fam, "completion").inc(result.completion_tokens)
            if self.plans is not None:
                try:
                    await self.plans.count(held.batch.owner, result.prompt_tokens + result.completion_tokens)
                except Exception:  # the limit store is away: the plan undercounts, the line is done
                    log.warning("tokens of a batch line not counted in its key's plan", exc_info=True)

    def _span(self, batch: Batch, line: Line, job: Job) -> Any:
        """The line's span: a root of its own, linked to the request that created the batch."""
        from opentelemetry.trace import Link

        links = []
        if batch.traceparent:
            ctx = tracing.extract({tracing.TRACEPARENT: batch.traceparent})
            if ctx is not None:
                from opentelemetry import trace

                links.append(Link(trace.get_current_span(ctx).get_span_context()))
        span = tracing.tracer().start_span("zml.batch.line", links=links)
        tracing.set_attrs(span, {"zml.batch.id": batch.id, "zml.batch.custom_id": line.custom_id,
                                 "zml.batch.line": job.index, "zml.batch.attempt": job.attempt,
                                 "gen_ai.request.model": line.model})
        return span
