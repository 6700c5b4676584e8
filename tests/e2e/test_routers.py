"""Two router replicas in one queue group share the traffic; each request is answered once."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx

from conftest import MODEL, Stack


async def test_two_replicas_share_a_burst(zml_stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=zml_stack.gateway_url, timeout=30) as client:
        async def one(i: int) -> dict:
            r = await client.post("/v1/chat/completions",
                                  json={"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 4,
                                        "policy": "round_robin"})
            assert r.status_code == 200, r.text
            return r.json()["zml"]

        infos = await asyncio.gather(*(one(i) for i in range(60)))
    routers = Counter(i["router_id"] for i in infos)
    assert set(routers) == {"router-1", "router-2"}, routers
    assert len({i["request_id"] for i in infos}) == 60
    assert len({i["node_id"] for i in infos}) >= 3  # spread over the fleet
