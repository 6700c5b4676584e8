"""Helpers for the health and warmup tests (no tests here): a private nats-server per module, a
zml.toml built from sim nodes, polling until a condition holds."""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.config import ZMLConfig, parse_config
from zmlcore.runtime.launch import free_port, start_nats
from zml_sim.server import SimNode

T = TypeVar("T")

FAST_HEALTH = {"poll_interval_s": 0.1, "jitter": 0.1, "probe_timeout_s": 0.5, "down_after": 2,
               "up_after": 2, "startup_grace_s": 2.0}


@contextmanager
def private_nats() -> Iterator[str]:
    """A nats-server -js of our own (destructive tests must not touch the session stack)."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-health-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.stop()


@asynccontextmanager
async def connected(url: str) -> AsyncIterator[NATS]:
    nc = await nats.connect(url, max_reconnect_attempts=0)
    try:
        yield nc
    finally:
        await nc.close()


def node_entry(sim: SimNode, *, backend: str | None = None, models: list[str] | None = None,
               accelerator: str | None = None, **extra: Any) -> dict[str, Any]:
    return {"id": sim.node_id, "accelerator": accelerator or sim.accelerator, "endpoint": sim.url,
            "backend": backend or sim.engine_kind, "models": models if models is not None else sim.initial_models,
            **extra}


def config(nodes: list[dict[str, Any]], *, health: dict[str, Any] | None = None, **sections: Any) -> ZMLConfig:
    return parse_config({"health": {**FAST_HEALTH, **(health or {})}, "nodes": nodes, **sections}, "test")


async def eventually(fn: Callable[[], T | Awaitable[T]], timeout: float = 10.0, interval: float = 0.05,
                     what: str = "condition") -> T:
    """Call ``fn`` until it returns something truthy; return it (fail after ``timeout``)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = fn()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last  # type: ignore[no-any-return]
        await asyncio.sleep(interval)
    raise AssertionError(f"{what} not reached within {timeout:g} s (last: {last!r})")


async def start_sim(node_id: str, accelerator: str, models: list[str], **kw: Any) -> SimNode:
    kw.setdefault("time_scale", 50.0)
    kw.setdefault("load_time_s", 0.0)
    sim = SimNode(node_id, accelerator, models, **kw)
    await sim.start()
    return sim


async def infer(nc: nats.NATS, model: str, content: str = "hi") -> tuple[str, str]:
    """One chat request on ``zml.infer``: (its error code or "OK", the node that answered)."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=15)
    code = (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK")
    return code, (json.loads(msg.data).get("zml") or {}).get("node_id", "")
