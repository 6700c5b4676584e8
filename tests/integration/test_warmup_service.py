"""The warmup service with the health service, `zml sim` nodes and a real NATS (in-process):
pre-loading in a quiet window (MI300X first, one node at a time), not in a busy one, and
`zml serve`."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import pytest

from test_health_helpers import config, connected, eventually, node_entry, private_nats, start_sim
from zml.cli._bus import Target
from zml.cli.serve import serve
from zml_health.service import HealthService
from zml_warmup.service import WarmupService
from zmlcore import subjects
from zmlcore.messages import RequestCompleted, WarmupEvent
from zml_sim.server import SimNode

M = "meta-llama/llama-3-8b-instruct"
OTHER = "mistralai/mistral-7b-instruct"
WARMUP = {"sweep_interval_s": 0.1, "rate_window_s": 1.0, "quiet_rps": 2.0, "quiet_min_s": 0.5,
          "max_concurrent_loads": 1}


@pytest.fixture(scope="module")
def nats_url() -> str:  # type: ignore[misc]  # private: these tests load and unload models
    with private_nats() as url:
        yield url


@dataclass
class Fleet:
    sims: dict[str, SimNode]
    health: HealthService
    warmup: WarmupService
    events: list[WarmupEvent] = field(default_factory=list)
    loading_seen: set[str] = field(default_factory=set)


def hold_loads(sim: SimNode, health: HealthService, polls: int = 2) -> None:
    """Make each load on ``sim`` last its simulated time and at least ``polls`` health polls of
    the node completed after it began. Health puts a node's state together only when it polls
    it, so "loading" (from the node probe, or the warmup's "started" event) shows only if a poll
    falls inside the load: sim loads are 0.2-0.3 s here and polls 0.1 s apart on an idle box,
    but a starved CI worker had no poll inside the whole H100 load. Two polls: the first may
    have probed before the load began, the second probed after it, while the engine still
    loaded. Counted in polls, not seconds, so how slow the box is does not matter."""
    engine = sim.engine
    finish = engine._load  # sleeps its delay, then marks the model loaded

    async def held(model: str, delay: float) -> None:
        tracker = health.trackers[sim.node_id]
        until = tracker.polls + polls
        await asyncio.sleep(delay)
        while tracker.polls < until:
            await asyncio.sleep(0.01)
        await finish(model, 0.0)

    engine._load = held  # type: ignore[method-assign]


@pytest.fixture()
async def fleet(nats_url: str) -> AsyncIterator[Fleet]:
    # Both nodes should serve M (warm) but start with OTHER only; MI300X loads slower. They
    # speak llama.cpp, whose router mode loads a model on demand (POST /models/load).
    sims = {
        "h100-1": await start_sim("h100-1", "nvidia_h100", [OTHER], time_scale=10.0, load_time_s=2.0,
                                  engine="llamacpp"),
        "mi300x-1": await start_sim("mi300x-1", "amd_mi300x", [OTHER], time_scale=10.0, load_time_s=3.0,
                                    engine="llamacpp"),
    }
    for s in sims.values():  # llama.cpp listens at once: the quiet clock starts once they serve
        await s.engine.wait_loaded()
    cfg = config([node_entry(s, models=[OTHER, M]) for s in sims.values()],
                 warmup=WARMUP, models={M: {"warm": True}})
    async with connected(nats_url) as nc:
        # a fresh bucket per test: earlier tests' nodes must not linger
        js = nc.jetstream()
        for bucket in (subjects.NODES_BUCKET, subjects.REGISTRY_BUCKET):
            try:
                await js.delete_key_value(bucket)
            except Exception:
                pass
        health, warmup = HealthService(cfg), WarmupService(cfg)
        f = Fleet(sims, health, warmup)

        async def on_event(msg) -> None:  # type: ignore[no-untyped-def]
            f.events.append(msgspec.json.decode(msg.data, type=WarmupEvent))

        await nc.subscribe(subjects.event(subjects.EVENT_WARMUP), cb=on_event)
        await health.start(nc)
        for s in sims.values():
            hold_loads(s, health)

        async def watch_loading() -> None:
            while True:
                for st in list(health.states.values()):
                    if M in st.loading_models:
                        f.loading_seen.add(st.node_id)
                await asyncio.sleep(0.02)

        watcher = asyncio.create_task(watch_loading())
        await eventually(lambda: all(s.status == "up" for s in health.states.values()) and len(health.states) == 2,
                         what="nodes up")
        # The quiet clock starts now, with the fleet serving (not while llama.cpp nodes load).
        warmup = f.warmup = WarmupService(cfg)
        await warmup.start(nc)
        # Its quiet clock starts when the test does (start() may take a good part of quiet_min_s
        # on a loaded machine, and the busy test's first requests must land inside it).
        warmup.quiet.started_at = warmup.clock()
        try:
            yield f
        finally:
            watcher.cancel()
            await warmup.stop()
            await health.stop()
            for s in sims.values():
                await s.stop()


def loaded(f: Fleet, node_id: str) -> bool:
    st = f.health.states.get(node_id)
    return st is not None and M in st.models and M not in st.loading_models


async def test_quiet_window_preloads_mi300x_first_one_at_a_time(fleet: Fleet) -> None:
    await eventually(lambda: loaded(fleet, "h100-1") and loaded(fleet, "mi300x-1"), timeout=15, what="both loaded")
    started = [e for e in fleet.events if e.phase == "started"]
    assert [e.node_id for e in started] == ["mi300x-1", "h100-1"]
    assert {e.reason for e in started} == {"quiet_window"} and {e.mechanism for e in fleet.events
                                                                if e.phase == "loaded"} == {"llamacpp_load"}
    # one node at a time: the H100 load started after the MI300X one finished
    mi_loaded = next(e for e in fleet.events if e.phase == "loaded" and e.node_id == "mi300x-1")
    assert started[1].ts >= mi_loaded.ts
    # while loading, the state said so (routers do not route that model there)
    assert fleet.loading_seen == {"h100-1", "mi300x-1"}


async def test_busy_model_is_not_preloaded_until_traffic_stops(fleet: Fleet, nats_url: str) -> None:
    async with connected(nats_url) as nc:
        stop_at = time.monotonic() + 1.5
        while time.monotonic() < stop_at:  # 10 requests/s for M: busy (quiet_rps = 2)
            ev = RequestCompleted(model=M, node_id="h100-1", ok=True, ts=time.time())
            await nc.publish(subjects.event(subjects.EVENT_COMPLETED), msgspec.json.encode(ev))
            await asyncio.sleep(0.1)
        assert not [e for e in fleet.events if e.phase == "started"], fleet.events
        # traffic stopped: the window empties, the quiet time passes, then the load starts
        await eventually(lambda: [e for e in fleet.events if e.phase == "started"], timeout=5, what="load started")


async def test_zml_serve_loads_now_and_reports_until_ready(fleet: Fleet, nats_url: str) -> None:
    fleet.warmup.wc.enabled = False  # only the explicit request may load
    out = io.StringIO()
    rc = await serve(M, nodes=[], family=["H100"], target=Target(nats_url), timeout=10, out=out)
    text = out.getvalue()
    assert rc == 0, text
    assert "h100-1: loading via llamacpp_load" in text and "h100-1: ready" in text and "mi300x-1" not in text
    assert loaded(fleet, "h100-1") and not loaded(fleet, "mi300x-1")
    # asking again: already loaded, answered at once
    out = io.StringIO()
    assert await serve(M, nodes=["h100-1"], family=[], target=Target(nats_url), timeout=5, out=out) == 0
    assert "h100-1: loaded" in out.getvalue()


async def test_zml_serve_explains_an_unknown_model(fleet: Fleet, nats_url: str) -> None:
    from zmlcore.errors import BadRequestError

    from zmlcore.errors import ModelNotLoadedError

    # a model the fleet knows nowhere: what a request and GET /v1/models/nope say too
    with pytest.raises(ModelNotLoadedError, match="The model 'nope' does not exist: no node serves it or is "
                                                  r"configured to \(GET /v1/models lists the models\); to load "
                                                  "it anyway, name nodes with --nodes"):
        await serve("nope", nodes=[], family=[], target=Target(nats_url), timeout=5, out=io.StringIO())
    # a model the fleet knows, on no node of the families asked
    with pytest.raises(BadRequestError, match=f"no node in family CPU is configured to serve '{M}'"):
        await serve(M, nodes=[], family=["CPU"], target=Target(nats_url), timeout=5, out=io.StringIO())
