"""`zml serve` as users run it: MODEL_NOT_LOADED from the router, then `zml serve MODEL` (a real
process) through the warmup service, then the same request succeeds. Private broker and sims."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from test_health_helpers import eventually, private_nats, start_sim  # noqa: E402

from zmlcore import subjects  # noqa: E402
from zmlcore.runtime.launch import Proc, service_argv, spawn  # noqa: E402

M = "meta-llama/llama-3-8b-instruct"
COLD = "mistralai/mistral-7b-instruct"


@pytest.fixture(scope="module")
def nats_url(own_nats: str) -> str:
    """This module's own broker (its tests delete and re-create buckets)."""
    return own_nats


@pytest.fixture(scope="module")
async def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    # llama.cpp nodes: router mode loads a model on demand (POST /models/load).
    sims = [await start_sim("mi300x-1", "amd_mi300x", [M], time_scale=10.0, load_time_s=3.0, engine="llamacpp"),
            await start_sim("h100-1", "nvidia_h100", [M], time_scale=10.0, load_time_s=2.0, engine="llamacpp")]
    path = tmp_path_factory.mktemp("serve") / "zml.toml"
    nodes = "\n".join(f'[[nodes]]\nid = "{s.node_id}"\naccelerator = "{s.accelerator}"\nendpoint = "{s.url}"\nbackend = "llamacpp"\n'
                      f'models = ["{M}", "{COLD}"]\n' for s in sims)
    path.write_text(f'[nats]\nurl = "{nats_url}"\n[health]\npoll_interval_s = 0.1\nstartup_grace_s = 1.0\n'
                    f'[warmup]\nsweep_interval_s = 0.2\nquiet_min_s = 3600\n{nodes}')
    procs: list[Proc] = [spawn(name, service_argv(name, str(path), nats_url)) for name in ("health", "warmup", "router")]
    try:
        for p in procs:
            assert await asyncio.to_thread(p.wait_for, "started", 20), p.tail()
        yield str(path)
    finally:
        for p in reversed(procs):
            p.stop()
        for s in sims:
            await s.stop()


async def infer(nc: nats.NATS, model: str) -> tuple[str, dict]:  # type: ignore[type-arg]
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    msg = await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=10)
    return (msg.headers or {}).get(subjects.H_ERROR_CODE, "OK"), json.loads(msg.data)


async def test_model_not_loaded_then_zml_serve_then_ok(stack: str, nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        async def up() -> bool:
            code, _ = await infer(nc, M)
            return code == "OK"

        await eventually(up, timeout=20, what="fleet serving")
        code, body = await infer(nc, COLD)
        assert code == "MODEL_NOT_LOADED" and "zml serve" in json.dumps(body), body
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "zml.cli", "serve", COLD, "--family", "MI300X", "--config", stack, "--timeout", "20",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 30)
        text = out.decode()
        assert proc.returncode == 0, text
        assert "mi300x-1: loading via llamacpp_load" in text and "mi300x-1: ready" in text and "h100-1" not in text
        code, body = await infer(nc, COLD)
        assert code == "OK" and body["zml"]["node_id"] == "mi300x-1", body
    finally:
        await nc.close()


async def test_zml_serve_without_a_warmup_service_says_so(tmp_path: Path) -> None:
    with private_nats() as url:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "zml.cli", "serve", COLD, "--nats-url", url, "--timeout", "5",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 2 and "no warmup service answers" in out.decode()
