"""The seed code samples (docs/examples/) run unchanged against a live stack, over HTTP and NATS.

They need a fleet with the H100_PCIe family the SDK 0.3 post names, so this module starts
`zml up --config docs/examples/zml.toml` (ports replaced by free ones), as a user starts it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import zml

from conftest import wait_ready
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, wait_port

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
MODEL = "meta-llama/llama-3-8b-instruct"


@pytest.fixture(scope="module")
def examples_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Path, str]]:
    tmp = tmp_path_factory.mktemp("examples")
    text = (EXAMPLES / "zml.toml").read_text()
    text = re.sub(r"127\.0\.0\.1:81\d\d", lambda m: f"127.0.0.1:{free_port()}", text)
    text = text.replace("time_scale = 20.0", "time_scale = 20.0\nload_time_s = 1.0")
    config = tmp / "zml.toml"
    config.write_text(text)
    nats_port, gw_port, auth_port = free_port(), free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{nats_port}"
    procs: list[Proc] = []
    try:
        # The samples run against `zml up`, exactly as a user starts it (NATS authorization on).
        data = tmp / "zml-data"
        up = spawn("zml-up", [sys.executable, "-m", "zml.cli", "up", "--config", str(config),
                              "--gateway-port", str(gw_port), "--nats-port", str(nats_port), "--data-dir", str(data)])
        procs.append(up)
        assert up.wait_for("ready", 90), up.tail()
        # The NATS samples run as an external system would: with a client identity of their own.
        issued = subprocess.run([sys.executable, "-m", "zml.cli", "creds", "issue", "examples", "--data-dir", str(data)],
                                capture_output=True, text=True, timeout=60)
        assert issued.returncode == 0, issued.stderr
        # A second gateway on the same fleet that requires an API key (ZML_API_KEYS).
        procs.append(spawn("gateway-auth", service_argv("gateway", str(config), nats_url, "--port", str(auth_port)),
                           env={"ZML_API_KEYS": "sk-right", "ZML_NATS_NKEY": str(data / "creds" / "gateway.nk")}))
        assert wait_port("127.0.0.1", auth_port, 30), procs[-1].tail()
        url = f"http://127.0.0.1:{gw_port}"
        wait_ready(url, MODEL, want_nodes=4)
        yield url, nats_url, tmp, f"http://127.0.0.1:{auth_port}"
    finally:
        for p in reversed(procs):  # zml up stops every child it started
            p.stop()


SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.py"))
TRANSPORTS = ("http", "nats")


@pytest.fixture(scope="module")
def example_runs(examples_stack: tuple[str, str, Path, str]) -> dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], Path]]:
    """Every example over every transport, run concurrently (each in its own folder)."""
    url, nats_url, cwd, _ = examples_stack
    running = {}
    for transport in TRANSPORTS:
        for script in SCRIPTS:
            env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
            env["ZML_ENDPOINT"] = url if transport == "http" else nats_url
            if transport == "nats":
                env["ZML_NATS_NKEY"] = str(cwd / "zml-data" / "creds" / "examples.nk")
            folder = cwd / f"{transport}-{script}"
            folder.mkdir()
            shutil.copy(cwd / "zml.toml", folder / "zml.toml")
            proc = subprocess.Popen([sys.executable, str(EXAMPLES / script)], cwd=folder, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            running[(script, transport)] = (proc, folder)
    done = {}
    for key, (proc, folder) in running.items():
        out, err = proc.communicate(timeout=120)
        done[key] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), folder)
    return done


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("script", SCRIPTS)
def test_example_runs(script: str, transport: str,
                      example_runs: dict[tuple[str, str], tuple[subprocess.CompletedProcess[str], Path]]) -> None:
    p, cwd = example_runs[(script, transport)]
    assert p.returncode == 0, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    out = p.stdout
    if script == "sdk03_policy_chain.py":
        assert "llama3-production" in out
    if script == "api_reference.py":
        assert "MODEL_NOT_LOADED" in out and "custom_cost_latency ->" in out
    if script == "sdk03_routing_error.py":
        assert "typo" in out and "H1OO" in out
    if script == "batch_client.py":
        rows = (cwd / "results.jsonl").read_text().splitlines()
        assert len(rows) == 20 and all('"output_text"' in r for r in rows)


def test_api_key_is_sent_and_a_wrong_one_is_auth_failed(
    examples_stack: tuple[str, str, Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    auth_url = examples_stack[3]
    with zml.Client(auth_url, api_key="sk-wrong", max_retries=3) as client:
        t0 = time.monotonic()
        with pytest.raises(zml.AuthError) as ei:
            client.infer(MODEL, "hi", max_tokens=1)
        assert time.monotonic() - t0 < 0.9  # AUTH_FAILED is never retried
    assert ei.value.code == "AUTH_FAILED" and "ZML_API_KEY" in str(ei.value)
    monkeypatch.setenv("ZML_API_KEY", "sk-right")
    with zml.Client(auth_url) as client:
        assert client.infer(MODEL, "hi", max_tokens=1).text
    with zml.Client(auth_url) as client:  # GET /v1/nodes needs the key too
        assert {n.node_id for n in client.nodes()} == {"h100-1", "h100-pcie-1", "mi300x-1", "a100-1"}


async def test_auth_failed_async(examples_stack: tuple[str, str, Path, str]) -> None:
    async with zml.AsyncClient(examples_stack[3], api_key="nope") as client:
        with pytest.raises(zml.AuthError):
            await client.infer(MODEL, "hi", max_tokens=1)
