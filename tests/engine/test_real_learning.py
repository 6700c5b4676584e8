"""Two real llama-servers of unequal speed (llamaserver.FAST / SLOW, ~3.5x apart at prefill on one
thread), one model, `cpu`/`llamacpp` nodes, ZML from a cold start (issue 28): it finds both
nodes' speeds from its first requests, routes on them, predicts TTFT, and keeps a conversation's
follow-ups on the node that holds its prefix.

The truth is what the engines say of themselves: llama.cpp's per-request ``timings`` at batch 1
(``llamaserver.measure_fleet``), measured before ZML starts and again after the learning phase
(the box is shared: both are printed, and their mean is the reference).
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

import llamaserver
from conftest import MODEL, Stack
from enginefleet import UNEQUAL, launch_real_stack
from zmlcore.messages.infer import RoutingInfo
from zmlcore.messages.node import NodeState

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]

#: Issue 28's targets.
TOLERANCE = 0.25
MAX_REQUESTS = 20
MAX_SECONDS = 30.0


def predicted_ttft_field() -> str | None:
    """The reply metadata field with the TTFT predicted at dispatch (issue 28 item 4), if this
    build has one. Matched by meaning (predict + first token/ttft), so the test runs as soon as
    it lands, whatever it is named."""
    for name in RoutingInfo.__struct_fields__:
        if "predict" in name and ("first_token" in name or "ttft" in name):
            return name
    return None


#: Issue 28's speed learner leaves its mark on NodeState: each estimate's uncertainty.
NO_LEARNER = "issue 28's speed learner is not in this build (no NodeState.prefill_sigma): runs once it lands"
LEARNER_MISSING = "prefill_sigma" not in NodeState.__struct_fields__
NO_PREDICTION = "no TTFT predicted at dispatch in this build's reply metadata (RoutingInfo; issue 28 item 4)"


@dataclass
class Unequal:
    stack: Stack
    servers: dict[str, llamaserver.Server]
    before: dict[str, llamaserver.Speeds]
    #: Client requests each node served, over the module's tests.
    used: Counter[str] = field(default_factory=Counter)

    def nodes(self) -> dict[str, dict[str, Any]]:
        rows = httpx.get(self.stack.gateway_url + "/v1/nodes", timeout=10).json()["nodes"]
        return {n["node_id"]: n for n in rows}


@pytest.fixture(scope="module")
def unequal(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unequal]:
    reason = llamaserver.unavailable()
    if reason:
        pytest.skip(reason)
    servers = llamaserver.unequal_fleet(UNEQUAL, log=print)
    stack = None
    try:
        before = {s.node_id: s.speeds for s in servers if s.speeds is not None}
        stack = launch_real_stack(own_nats, tmp_path_factory.mktemp("unequal"), servers, policy="latency")
        yield Unequal(stack, {s.node_id: s for s in servers}, before)
    finally:
        if stack is not None:
            stack.stop()
        llamaserver.stop_fleet(servers)


def prompt(words: int = 400) -> str:
    """A prompt no cache holds (~1,100 tokens at 400 words): a fresh id first."""
    return uuid.uuid4().hex + " " + " ".join(f"note{i % 89}" for i in range(words))


def chat(stack: Stack, messages: list[dict[str, str]], max_tokens: int = 8,
         headers: dict[str, str] | None = None) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens}  # the default policy: latency
    r = httpx.post(stack.gateway_url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def off(estimate: float, lo: float, hi: float) -> float:
    """How far ``estimate`` is outside [lo, hi], relative to the nearer end (0 inside)."""
    if estimate < lo:
        return (lo - estimate) / lo
    return max(0.0, (estimate - hi) / hi)


@pytest.mark.skipif(LEARNER_MISSING, reason=NO_LEARNER)
@pytest.mark.xfail(strict=False, reason=(
    "issue 28: met in 2 of 5 runs before the calibration's confirmations, 1 of 6 after (2026-12-07, box load "
    "7-14). The first calibration runs while the stack's other services start on the same 2 cores and the "
    "engine times itself slow (3,713 prefill tok/s against 20,519-28,937); the confirmations 10 s and 20 s "
    "later raise it when the box is quiet then, but at load 7-9 they too read slow (fast node 14,023 vs "
    "20,194-26,951), and a prefill shared with others only bounds the speed from below"))
def test_a_cold_start_finds_both_nodes_speeds(unequal: Unequal) -> None:
    fast, slow = unequal.before["llama-fast"].prompt_tps, unequal.before["llama-slow"].prompt_tps
    assert fast > 1.5 * slow, f"the fleet is not unequal on this box: {unequal.before}"
    cold = unequal.nodes()
    print("before the first request:", {n: (cold[n]["prefill_tps"], cold[n]["decode_tps"], cold[n].get("speeds_source"))
                                        for n in UNEQUAL})
    # The learning phase: MAX_REQUESTS distinct ~1,100-token prompts, 4 at a time, 32 tokens out;
    # ZML's estimates sampled until MAX_SECONDS after the first request.
    snapshots: list[tuple[float, int, dict[str, dict[str, Any]]]] = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, unequal.stack, [{"role": "user", "content": prompt()}], 32)
                   for _ in range(MAX_REQUESTS)]
        while time.monotonic() - t0 < MAX_SECONDS:
            snapshots.append((time.monotonic() - t0, sum(f.done() for f in futures), unequal.nodes()))
            time.sleep(0.25)
        unequal.used.update(f.result()["zml"]["node_id"] for f in futures)
    # The truth: the engines' own batch-1 speeds before ZML started and now. The box is shared and
    # they move with its load (seen: 2.5x between two measurements minutes apart), so an estimate
    # is right when it is within TOLERANCE of the span the engine itself was measured in.
    after = dict(zip(unequal.servers, llamaserver.measure_fleet([s.url for s in unequal.servers.values()])))
    span = {n: {"prefill_tps": sorted([unequal.before[n].prompt_tps, after[n].prompt_tps]),
                "decode_tps": sorted([unequal.before[n].decode_tps, after[n].decode_tps])} for n in UNEQUAL}

    def worst(st: dict[str, dict[str, Any]]) -> float:
        return max(off(st[n][k], *span[n][k]) for n in UNEQUAL for k in ("prefill_tps", "decode_tps"))

    found = next(((t, done) for t, done, st in snapshots if worst(st) <= TOLERANCE), None)
    last = snapshots[-1][2]
    report = {n: {k: (round(last[n][k]), [round(v) for v in span[n][k]]) for k in span[n]} | {
        "source": last[n].get("speeds_source")} for n in UNEQUAL}
    trail = [(round(t, 1), done, *(round(st[n][k]) for n in UNEQUAL for k in ("prefill_tps", "decode_tps")))
             for t, done, st in snapshots[::12]]  # every ~3 s: (s, requests done, fast pf/dec, slow pf/dec)
    print("ZML's estimates (last) vs the engines' own span:", report, "found after (s, requests):", found,
          "requests per node:", dict(unequal.used), "trail:", trail)
    assert found is not None, f"estimates not within {TOLERANCE:.0%} in {MAX_SECONDS:g} s: {report}; trail {trail}"
    assert found[1] <= MAX_REQUESTS


@pytest.mark.skipif(LEARNER_MISSING, reason=NO_LEARNER)
def test_both_nodes_are_used_the_fast_one_most(unequal: Unequal) -> None:
    # Routed on what was learned: 32 more prompts, 8 at a time, twice the fast node's 4 slots
    # (issue 28 item 3: spill by real capacity). At 4 at a time a node 3.5x faster is the
    # faster choice for nearly every request, and CI saw all 44 go to it (that is not a fault);
    # past its slots, a request waits there for a sequence to finish, and the slow node, idle,
    # is faster. The fast node does most of the work; the slow one is used, not left idle.
    with ThreadPoolExecutor(8) as pool:
        spill = Counter(pool.map(lambda _: chat(unequal.stack, [{"role": "user", "content": prompt()}])["zml"]
                                 ["node_id"], range(32)))
    unequal.used.update(spill)
    print("requests per node, 8 at a time:", dict(spill), "over the module:", dict(unequal.used))
    assert unequal.used["llama-fast"] > unequal.used["llama-slow"], unequal.used
    assert spill["llama-slow"] >= 2, spill


@pytest.mark.skipif(predicted_ttft_field() is None, reason=NO_PREDICTION)
@pytest.mark.xfail(strict=False, reason=(
    "issue 28 open: TTFT predicted at dispatch vs observed, median error 0.25 run alone (box load 9) but "
    "0.61-0.85 after the other tests (load 13-22, 2026-12-07): observed TTFTs 2-3x the prediction even with "
    "nothing pending at dispatch, on engines whose own speeds swung 3x between two measurements"))
def test_ttft_predicted_at_dispatch_is_within_25_percent(unequal: Unequal) -> None:
    name = predicted_ttft_field()
    assert name is not None
    # Warmed: the estimates settle on the first requests (earlier tests, or these). A TTFT target
    # far above any TTFT here makes admission predict the TTFT on the chosen node (the reply's
    # predicted_ttft_ms) without refusing anything.
    slo = {"x-zml-ttft-slo-ms": "60000"}
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: chat(unequal.stack, [{"role": "user", "content": prompt()}],
                                               headers=slo)["zml"], range(32)))
    scale = 1e-3 if name.endswith("_ms") else 1.0  # time_to_first_token is in seconds
    pairs = [(z[name] * scale, z["time_to_first_token"]) for z in replies[-24:]
             if z.get(name) and z.get("time_to_first_token")]
    if not pairs:  # the field exists (flow control's, issue 30) but nothing fills it yet
        pytest.skip(f"no reply carried {name}: this build predicts no TTFT at dispatch (issue 28 item 4)")
    assert len(pairs) >= 12, replies
    errors = [abs(p - o) / o for p, o in pairs]
    print(f"TTFT predicted vs observed: median abs error {statistics.median(errors):.0%} over {len(errors)};",
          "(node, predicted, observed s):", [(z["node_id"][6:], round(z[name] * scale, 3), round(z["time_to_first_token"], 3))
                                             for z in replies[-24:] if z.get(name) and z.get("time_to_first_token")])
    assert statistics.median(errors) <= TOLERANCE


@pytest.mark.xfail(strict=False, reason=(
    "issue 28 open: follow-ups on the node holding their conversation 17, 17 and 13 of 18 in three runs "
    "(2026-12-07; 14 of 18 before the learner's shared-node fixes), the last under the 80% asked"))
def test_follow_ups_go_to_the_node_holding_the_conversation(unequal: Unequal) -> None:
    # 6 conversations at once (fewer than the fleet's 8 slots: llama.cpp keeps a prompt in the
    # slot that ran it), 4 turns each, each opening with a long system prompt of its own.
    def conversation(i: int) -> list[dict[str, Any]]:
        messages = [{"role": "system", "content": f"Conversation {i}. " + prompt(350)},
                    {"role": "user", "content": "Hello, what can you do?"}]
        out = []
        for turn in range(4):
            reply = chat(unequal.stack, messages, max_tokens=12)
            out.append(reply["zml"])
            messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Tell me more about point {turn}."}]
        return out

    with ThreadPoolExecutor(6) as pool:
        convs = list(pool.map(conversation, range(6)))
    follow_ups = [(c[0]["node_id"], z) for c in convs for z in c[1:]]
    stayed = [z for first, z in follow_ups if z["node_id"] == first]
    hits = [z for z in stayed if (z.get("cached_tokens") or 0) > 300]
    print("follow-ups on the first node:", len(stayed), "of", len(follow_ups), "engine cache hits:", len(hits),
          "first nodes:", Counter(c[0]["node_id"] for c in convs))
    assert len(stayed) >= 0.8 * len(follow_ups), convs
    assert len(hits) >= 0.8 * len(follow_ups), convs
