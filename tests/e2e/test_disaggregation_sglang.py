"""Disaggregation on SGLang's protocol through the whole stack: both legs at once over a
bootstrap room (a broker of its own: tests/e2e/test_disaggregation.py's stack shares subjects)."""

from __future__ import annotations

import httpx
import pytest

from conftest import MODEL, launch_stack
from test_disaggregation import chat, long_prompt, wait_up


def test_sglang_legs_run_at_once_over_a_bootstrap_room(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    kv = 'kv_group = "s"\nkv_gbps = 400\nbackend = "sglang"\n'
    fleet = [("spf-1", "nvidia_h100", [MODEL], 'roles = ["prefill"]\n' + kv),
             ("sdec-1", "intel_gaudi2", [MODEL], 'roles = ["decode"]\n' + kv)]
    s = launch_stack(own_nats, tmp_path_factory.mktemp("disagg-sglang"), fleet=fleet, routers=1,
                     extra="[disaggregation]\nenabled = true\nalways = true\n")
    try:
        wait_up(s, "spf-1", "sdec-1")
        r = chat(s, long_prompt("sglang"))
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["zml"]["node_id"] == "sdec-1" and body["zml"]["prefill_node"] == "spf-1", json.dumps(body["zml"])
        usage = body["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.95 * usage["prompt_tokens"]
        # the prefill node held the room and the decode node pulled it
        state = httpx.get(s.sim_url("spf-1") + "/sim/state", timeout=5).json()["kv_handoff"]
        assert state["held"] == 1 and state["pulled"] == 1 and state["holding"] == 0
    finally:
        s.stop()
