"""Issue 10 item 9 on a real engine: warmup loads a model into llama-server's router mode
(``--models-dir``, no ``--model``) with ``POST /models/load`` under the engine's name for it, and
the health adapter reads router mode's model list (loaded vs not)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

import llamaserver
from enginefleet import Llama, llama  # noqa: F401
from zml_health.adapters.llamacpp import probe as llamacpp_probe
from zml_warmup import loader
from zmlcore.runtime.launch import free_port, spawn

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


def test_warmup_loads_through_router_mode(llama: Llama, tmp_path: Path) -> None:  # noqa: F811
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(llama.model)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = spawn("llama-router", [llama.binary, "--models-dir", str(models), "--host", "127.0.0.1", "--port",
                                  str(port), "--no-models-autoload", "--threads", "1", "--metrics"])
    try:
        llamaserver.wait_healthy(url, proc)

        async def run() -> None:
            async with httpx.AsyncClient() as client:
                p = await llamacpp_probe(client, url, 5.0)
                assert p.ok and p.models == [] and p.loading_models == []  # listed, not loaded
                res = await loader.load(client, url, "llamacpp", "zml/tiny", served="tiny", timeout=30)
                assert res.ok and res.mechanism == "llamacpp_load", res
                deadline = time.monotonic() + 60
                while True:
                    p = await llamacpp_probe(client, url, 5.0)
                    if p.models == ["tiny"]:
                        break
                    assert time.monotonic() < deadline, p
                    await asyncio.sleep(0.2)
                again = await loader.load(client, url, "llamacpp", "zml/tiny", served="tiny", timeout=30)
                assert again.ok and again.done, again  # "model is already running"

        asyncio.run(run())
    finally:
        proc.stop()
