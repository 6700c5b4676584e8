"""Router parts of cache-aware routing over a real nats-server: replicas share their prefix
records (N replicas route as one), apply the engines' bridged KV events, and share session
bindings in the KV bucket zml_sessions, which forgets idle sessions."""

from __future__ import annotations

import asyncio

import msgspec

from test_health_helpers import connected, eventually, private_nats
from zml_router.replicas.prefixshare import PrefixShare
from zml_router.replicas.sessions import Sessions, session_key
from zmlcore import subjects
from zmlcore.messages.kvcache import KvAllCleared, KvEventBatch
from zmlcore.policy.prefix import PrefixIndex, prompt_keys
from zmlcore.bus.publish import flush

import pytest


@pytest.fixture(scope="module")
def nats_private() -> str:  # type: ignore[misc]
    with private_nats() as url:
        yield url


def index() -> PrefixIndex:
    ix = PrefixIndex()
    for n in ("h100-1", "gaudi2-1"):
        ix.set_node(n, block_size=16, capacity_tokens=1_000_000)
    return ix


async def test_replicas_share_records_reports_and_kv_events(nats_private: str) -> None:
    chain = prompt_keys("m", messages=[{"role": "system", "content": "a long shared system prompt " * 200}])
    assert len(chain) > 4
    async with connected(nats_private) as nc_a, connected(nats_private) as nc_b:
        a, b = PrefixShare(nc_a, "router-a", index()), PrefixShare(nc_b, "router-b", index())
        await a.start()
        await b.start()
        try:
            await flush(nc_a)
            await flush(nc_b)
            a.recorded("h100-1", chain, 100.0)
            assert a.index.depth("h100-1", chain) == len(chain)
            await eventually(lambda: b.index.depth("h100-1", chain) == len(chain), what="peer record")
            assert b.index.depth("gaudi2-1", chain) == 0
            # short prompts have no keys: nothing recorded, nothing sent
            short = prompt_keys("m", prompt="hi")
            a.recorded("gaudi2-1", short, 100.0)
            assert not short.keys
            # the engine's bridged events reach both replicas: a clear empties the node
            await nc_a.publish(subjects.kv_events("h100-1"), msgspec.json.encode(
                KvEventBatch(node_id="h100-1", events=[KvAllCleared()], seq=3)))
            await eventually(lambda: a.index.depth("h100-1", chain) == 0 and b.index.depth("h100-1", chain) == 0,
                             what="cleared on both")
            # a report of cached tokens from one replica teaches the other too
            b.corrected("gaudi2-1", chain, cached_tokens=2000, prompt_tokens=2400, now=101.0)
            await eventually(lambda: a.index.depth("gaudi2-1", chain) > 0, what="peer report")
        finally:
            await a.stop()
            await b.stop()


async def test_session_bindings_are_shared_and_expire_when_idle(nats_private: str) -> None:
    async with connected(nats_private) as nc_a, connected(nats_private) as nc_b:
        js = nc_a.jetstream()
        try:  # a bucket of its own TTL for this test (another test may have made it)
            await js.delete_key_value(subjects.SESSIONS_BUCKET)
        except Exception:
            pass
        a, b = Sessions(nc_a, idle_s=1.5), Sessions(nc_b, idle_s=1.5)
        await a.start()
        await b.start()
        assert await a.wait_ready(5) and await b.wait_ready(5)
        try:
            key = session_key("owner-1", "conversation-7")
            assert key != session_key("owner-2", "conversation-7")  # one caller's names never meet another's
            assert b.node(key) is None
            a.bind(key, "h100-1")
            await eventually(lambda: b.node(key) == "h100-1", what="binding seen by the other replica")
            b.bind(key, "gaudi2-1")  # spilled: rebound by the other replica
            await eventually(lambda: a.node(key) == "gaudi2-1", what="rebinding seen")
            await asyncio.sleep(2.5)  # idle past the TTL
            await eventually(lambda: a.node(key) is None and b.node(key) is None, timeout=10,
                             what="forgotten when idle")
        finally:
            await a.stop()
            await b.stop()
