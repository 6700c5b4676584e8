"""CPU per request of the request body's handling in the gateway and the router, before and
after the body was parsed once per process (zmlcore.messages.frontdoor, zml_router.node.attempt.NodeBodies), and of
uvicorn's ProxyHeadersMiddleware (on every request before [gateway] trusted_proxies).

    python benches/body_cost.py [--n 20000] [--reps 5]

One process, no I/O: each path is the functions the services call on one body, timed with
process_time. "before" is the code as it was (a copy of the removed ``backend_body``):
gateway decode_request, router decode_request (each with the json_depth scan), and the node's body (decode + re-encode when
ZML's fields are in it, again per attempt on a served_names node).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

import msgspec
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

from zmlcore import subjects
from zmlcore.messages import frontdoor
from zmlcore.messages import ZML_REQUEST_KEYS
from zmlcore.messages.validate import decode_request, json_depth
from zml_router.node.attempt import NodeBodies

_decode_any = msgspec.json.Decoder()
_KEYS = tuple(f'"{k}"'.encode() for k in ZML_REQUEST_KEYS)


def old_backend_body(raw: bytes, model: str, asked: str) -> bytes:
    if model == asked and not any(k in raw for k in _KEYS):
        return raw
    data: dict[str, Any] = _decode_any.decode(raw)
    for key in ZML_REQUEST_KEYS:
        data.pop(key, None)
    data["model"] = model
    return msgspec.json.encode(data)


def old_decode_request(raw: bytes) -> Any:
    json_depth(raw)  # scanned every body (now only one with more brackets than the limit)
    return decode_request(raw)


def before(raw: bytes, served: str | None) -> bytes:
    req = old_decode_request(raw)                   # gateway
    rreq = old_decode_request(raw)                  # router
    body = old_backend_body(raw, rreq.model, req.model)
    return old_backend_body(raw, served, rreq.model) if served else body


def after(raw: bytes, served: str | None) -> bytes:
    req = decode_request(raw)                       # gateway
    body, headers = frontdoor.split(raw, req)
    rreq = frontdoor.decode(body, headers)          # router
    return NodeBodies(body, rreq.model, True)(served or rreq.model)


def _chat(words: int, **zml: Any) -> bytes:
    return json.dumps({"model": "llama-3-8b", "max_tokens": 64, "temperature": 0.2,
                       "messages": [{"role": "system", "content": "You are terse."},
                                    {"role": "user", "content": " ".join(["word"] * words)}], **zml}).encode()


CASES = {
    "OpenAI client, short chat (load.py's)": (_chat(8), None),
    "SDK, short chat (request_id, timeout_ms, policy)": (_chat(8, request_id="r-123", timeout_ms=30000, policy="latency"), None),
    "OpenAI client, 8 KB chat": (_chat(1600), None),
    "SDK, 8 KB chat": (_chat(1600, request_id="r-123", timeout_ms=30000), None),
    "SDK, short chat, served_names node": (_chat(8, request_id="r-123", timeout_ms=30000), "/models/llama.gguf"),
}


def _time(fn: Any, raw: bytes, served: str | None, n: int) -> float:
    t = time.process_time()
    for _ in range(n):
        fn(raw, served)
    return (time.process_time() - t) / n * 1e6


def proxy_middleware_us(n: int) -> float:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        return None
    mw = ProxyHeadersMiddleware(app, trusted_hosts="127.0.0.1")  # type: ignore[arg-type]
    headers = [(b"host", b"127.0.0.1:8080"), (b"content-type", b"application/json"), (b"content-length", b"120"),
               (b"user-agent", b"python-httpx/0.28"), (b"accept", b"*/*")]

    async def run() -> float:
        scope = {"type": "http", "client": ("127.0.0.1", 50000), "headers": headers}
        t = time.process_time()
        for _ in range(n):
            await mw(scope, None, None)  # type: ignore[arg-type]
        mid = time.process_time()
        for _ in range(n):
            await app(scope, None, None)
        return ((mid - t) - (time.process_time() - mid)) / n * 1e6
    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    print("| body | before µs | after µs | saved |\n|---|---|---|---|")
    for name, (raw, served) in CASES.items():
        assert json.loads(before(raw, served)) == json.loads(after(raw, served))
        b = statistics.median(_time(before, raw, served, a.n) for _ in range(a.reps))
        f = statistics.median(_time(after, raw, served, a.n) for _ in range(a.reps))
        print(f"| {name} ({len(raw)} B) | {b:.1f} | {f:.1f} | {100 * (b - f) / b:.0f}% |")
    mw = statistics.median(proxy_middleware_us(a.n) for _ in range(a.reps))
    print(f"\nProxyHeadersMiddleware, per request from 127.0.0.1 (5 headers): {mw:.2f} µs")


if __name__ == "__main__":
    main()
