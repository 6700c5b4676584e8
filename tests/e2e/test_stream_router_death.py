"""Issue 20 item 2: a stream survives the router relaying it. Two routers; streams through the
gateway and through the SDK over NATS are started, and the router relaying some of them is
SIGKILLed once their content is flowing. Their requesters notice the silence, send the request
again with what they received (``Zml-Resume``), and the other router continues the answer on a
node from there: the client reads one stream, every token once (the sims' token ``i`` is the
same word wherever it is made), one ``finish_reason``, usage that adds up, and
``zml.continued_from`` naming the dead router's part (failure ``router``).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import zml
from conftest import MODEL, Stack, launch_stack
from zml_sim.engine import token_text

# Kills a process (a stack of its own, ~12 s): in the chaos suite (`pytest -m chaos`), which CI
# runs after the default one; the default suite's tests/e2e/test_router_failover.py asserts the
# same outcome (every stream whole after a router's SIGKILL) on its shared stack.
pytestmark = [pytest.mark.slow, pytest.mark.chaos]

FLEET = [("h100-a", "nvidia_h100", [MODEL])]
TOKENS = 200  # ~1.7 s of decoding at time_scale 2 (60 tokens/s model time)
KEEPALIVE_S = 0.2  # a dead router is noticed after 3 silent intervals


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(own_nats, tmp_path_factory.mktemp("routerdeath"), fleet=FLEET, routers=2, time_scale=2.0,
                     extra=f"[gateway]\nrouter_keepalive_ms = {int(KEEPALIVE_S * 1000)}\n",
                     router="first_byte_floor_s = 60\nadmission_ttft_s = 600\ncooldown_s = 1\n")
    try:
        yield s
    finally:
        s.stop()


def words(n: int) -> str:
    return "".join(token_text("h100-a", i) for i in range(n))


class GatewayStream:
    def __init__(self, stack: Stack, i: int) -> None:
        self.stack, self.i = stack, i
        self.router = ""
        self.flowing = asyncio.Event()
        self.events: list[Any] = []

    async def run(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"gw {self.i}"}], "max_tokens": TOKENS,
                "stream": True, "stream_options": {"include_usage": True}}
        async with httpx.AsyncClient(base_url=self.stack.gateway_url, timeout=30) as c:
            async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                self.router = r.headers["x-zml-router-id"]
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        self.events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
                        if len(self.events) >= 10:
                            self.flowing.set()
        self.flowing.set()

    def check(self) -> dict[str, Any] | None:
        """The stream read as one answer; returns its ``zml`` object."""
        assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
        text, finishes, usage, zml_obj, ids = [], [], None, None, set()
        for e in self.events[:-1]:
            assert "error" not in e, e
            ids.add(e["id"])
            for ch in e.get("choices") or []:
                text.append(ch["delta"].get("content") or "")
                if ch.get("finish_reason"):
                    finishes.append(ch["finish_reason"])
            usage = e.get("usage") or usage
            zml_obj = e.get("zml") or zml_obj
        assert "".join(text) == words(TOKENS)  # no token lost, none repeated
        assert finishes == ["length"] and len(ids) == 1
        assert usage is not None and usage["completion_tokens"] == TOKENS
        assert usage["total_tokens"] == usage["prompt_tokens"] + TOKENS
        return zml_obj


class SdkStream:
    def __init__(self, client: zml.AsyncClient, i: int) -> None:
        self.client, self.i = client, i
        self.router = ""
        self.flowing = asyncio.Event()
        self.stream: Any = None

    async def run(self) -> None:
        s = self.stream = self.client.infer_stream(MODEL, messages=[{"role": "user", "content": f"sdk {self.i}"}],
                                                   max_tokens=TOKENS, timeout=30)
        n = 0
        async for _ in s:
            n += 1
            if n == 1:
                assert s.routing is not None
                self.router = s.routing.router_id
            if n >= 10:
                self.flowing.set()
        self.flowing.set()

    def check(self) -> None:
        s = self.stream
        assert s.done and s.text == words(TOKENS) and s.finish_reason == "length"


async def test_a_stream_whose_router_is_killed_is_continued_by_the_other(stack: Stack) -> None:
    victim = "router-1"
    async with zml.AsyncClient(stack.nats_url, timeout=30, max_retries=0) as sdk:
        sdk._transport.keepalive_s = KEEPALIVE_S
        streams: list[Any] = []
        tasks: list[asyncio.Task[None]] = []
        # Open streams until the victim relays at least one of each kind (the queue group
        # spreads them at random); all run at once, ~1.7 s each.
        deadline = time.monotonic() + 10
        while not ({type(s) for s in streams if s.router == victim} >= {GatewayStream, SdkStream}):
            assert time.monotonic() < deadline, [(type(s).__name__, s.router) for s in streams]
            for s in (GatewayStream(stack, len(streams)), SdkStream(sdk, len(streams))):
                streams.append(s)
                tasks.append(asyncio.create_task(s.run()))
            await asyncio.gather(*(s.flowing.wait() for s in streams[-2:]))
        stack.procs[victim].popen.kill()  # SIGKILL, content flowing on its streams
        await asyncio.wait_for(asyncio.gather(*tasks), 30)
    continued = 0
    for s in streams:
        if isinstance(s, GatewayStream):
            zml_obj = s.check()
        else:
            s.check()
            routing = s.stream.routing
        if s.router != victim:
            continue
        continued += 1
        if isinstance(s, GatewayStream):
            assert zml_obj is not None and zml_obj["attempts"] == 2, zml_obj
            node, rest = zml_obj["continued_from"].split("@")
            assert node == "h100-a" and rest.endswith(":router") and int(rest.split(":")[0]) >= 5, zml_obj
        else:
            assert routing is not None and routing.router_id != victim and routing.attempts == 2, routing
            assert (routing.continued_from or "").endswith(":router"), routing
    assert continued >= 2
    log = stack.procs["router-2"].tail(300)
    assert "sent again by its requester" in log
