"""Load for the reliability tests (no tests here): client threads sending chat requests, every
other one streamed, recording each request's start, end and outcome."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from conftest import MODEL

CHAT = [{"role": "user", "content": "hello there"}]


@dataclass
class Load:
    """``clients`` threads sending requests (every other one streamed) until stopped."""

    url: str
    clients: int = 8
    model: str = MODEL
    timeout_ms: int = 10_000
    results: list[tuple[float, float, bool, str]] = field(default_factory=list)  # start, end, ok, why
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _one(self, http: httpx.Client, stream: bool) -> tuple[bool, str]:
        body = {"model": self.model, "messages": CHAT, "max_tokens": 4, "stream": stream,
                "timeout_ms": self.timeout_ms}
        try:
            if not stream:
                r = http.post("/v1/chat/completions", json=body)
                return r.status_code == 200, f"{r.status_code} {r.text[:120]}"
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                text = r.read().decode()
            ok = r.status_code == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
            return ok, f"{r.status_code} {text[-160:]}"
        except httpx.HTTPError as exc:
            return False, repr(exc)

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            n = 0
            while not self._stop.is_set():
                t0 = time.monotonic()
                ok, why = self._one(http, stream=(n + i) % 2 == 1)
                self.results.append((t0, time.monotonic(), ok, why))
                n += 1
                if not ok:
                    time.sleep(0.05)  # do not spin on a fast failure

    def start(self) -> None:
        for i in range(self.clients):
            t = threading.Thread(target=self._run, args=(i,), daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(40)

    def after(self, t: float) -> list[tuple[float, float, bool, str]]:
        return [r for r in self.results if r[0] >= t]
