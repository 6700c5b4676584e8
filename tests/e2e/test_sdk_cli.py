"""`zml infer`, `zml batch`, `zml bench` and `zml nodes` as a user runs them, against the stack."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MODEL, Stack

ZML = [sys.executable, "-m", "zml.cli"]


def zml_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    return subprocess.run([*ZML, *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(params=["http", "grpc", "nats"])
def endpoint(request: pytest.FixtureRequest, zml_stack: Stack) -> str:
    return {"http": zml_stack.gateway_url, "grpc": f"grpc://{zml_stack.grpc_target}",
            "nats": zml_stack.nats_url}[request.param]


def test_infer(endpoint: str) -> None:
    p = zml_cli("infer", "--model", MODEL, "--prompt", "Hello", "--max-tokens", "4", "--endpoint", endpoint)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip()
    assert re.search(r"node=\S+ type=\S+ family=\S+ policy=\S+ queue=\d+", p.stderr)
    assert int(re.search(r"tokens=(\d+)", p.stderr).group(1)) > 4  # type: ignore[union-attr]
    p = zml_cli("infer", "--model", MODEL, "--prompt", "Hello", "--max-tokens", "4", "--stream",
                "--policy", '{"accelerator_chain": ["MI300X"]}', "--endpoint", endpoint)
    assert p.returncode == 0, p.stderr
    assert "family=MI300X" in p.stderr and p.stdout.strip()
    # the usage chunk's count (prompt + answer), as for a whole reply: not 0
    assert int(re.search(r"tokens=(\d+)", p.stderr).group(1)) > 4, p.stderr  # type: ignore[union-attr]


def test_errors_are_one_line_with_the_code(endpoint: str) -> None:
    p = zml_cli("infer", "--model", MODEL, "--prompt", "hi", "--policy", "no-such-policy", "--endpoint", endpoint)
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert p.stderr.startswith("zml: error: [POLICY_CONFIG]") and p.stderr.count("\n") == 1
    p = zml_cli("nodes", "--endpoint", "http://127.0.0.1:9")
    assert p.returncode == 1 and "[CONNECTION_FAILED]" in p.stderr and "Traceback" not in p.stderr


def _cells(header: str, line: str) -> dict[str, str]:
    """A table row by column name, cut where the header's columns start (cells may hold spaces)."""
    names = header.split()
    starts = [header.index(f"{n} " if n != names[-1] else n) for n in names]
    return {n: line[a:b].strip() for n, a, b in zip(names, starts, [*starts[1:], None])}


def test_nodes_table(endpoint: str, zml_stack: Stack) -> None:
    p = zml_cli("nodes", "--endpoint", endpoint)
    assert p.returncode == 0, p.stderr
    header, *lines = p.stdout.strip().splitlines()
    assert header.split() == ["NODE", "TYPE", "FAMILY", "MODELS", "HEALTH", "QUEUE", "STATE", "COOLDOWN", "SPEED",
                              "CACHE", "ROLES", "ENDPOINT", "NOTE"]
    rows = [_cells(header, line) for line in lines]
    # the sims report cached tokens and vLLM's cache geometry: routers know their caches that way
    assert all(r["CACHE"].startswith("reported:") for r in rows), lines
    assert sorted(r["NODE"] for r in rows) == sorted(zml_stack.node_ids)
    assert sorted(r["ENDPOINT"] for r in rows) == sorted(zml_stack.sim_url(n) for n in zml_stack.node_ids)
    assert all(r["STATE"] == "up" for r in rows), lines
    # each node's speeds with where they come from (the sims' counters, a calibration request or
    # the routers' observations, else the accelerator type's profile), how long ago the estimate
    # last moved and how sure it is
    assert all(re.fullmatch(r"[\d.]+k?/[\d.]+k?:(default|(measured|learned):\d+[smh])(:\d+%)?", r["SPEED"])
               for r in rows), lines
    listed = json.loads(zml_cli("nodes", "--json", "--endpoint", endpoint).stdout)
    assert sorted(n["node_id"] for n in listed["nodes"]) == sorted(zml_stack.node_ids)  # /v1/nodes' shape


def test_bench(zml_stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    p = zml_cli("bench", "--model", MODEL, "--requests", "8", "--warmup", "2", "--concurrency", "1,4",
                "--max-tokens", "2", "--endpoint", zml_stack.gateway_url, "--output-json", str(out))
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    pat = (r"c=(\d+)\s+rps=[\d.]+  p50=[\d.]+s  p95=[\d.]+s  p99=[\d.]+s  svc_p95=[\d.]+s  "
           r"q_p95=[\d.]+s  err=0/8  elapsed=[\d.]+s")
    assert [re.fullmatch(pat, line).group(1) for line in lines[:2]] == ["1", "4"]  # type: ignore[union-attr]
    assert re.fullmatch(r"recommended_max_parallel_requests=(1|4)", lines[2])
    report = json.loads(out.read_text())
    assert [lv["c"] for lv in report["levels"]] == [1, 4]
    assert report["recommended_max_parallel_requests"] in (1, 4)


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# The batch file's resume logic is the CLI's own, above any transport (the SDK's batch over
# gRPC is in test_sdk_client): over HTTP and NATS only, to keep the suite's time.
@pytest.fixture(params=["http", "nats"])
def batch_endpoint(request: pytest.FixtureRequest, zml_stack: Stack) -> str:
    return zml_stack.gateway_url if request.param == "http" else zml_stack.nats_url


def test_batch_killed_then_resumed_gives_every_item_once(batch_endpoint: str, tmp_path: Path) -> None:
    endpoint = batch_endpoint
    n = 40
    src, dst = tmp_path / "prompts.jsonl", tmp_path / "results.jsonl"
    with src.open("w") as fh:
        for i in range(n):
            fh.write(json.dumps({"id": f"p{i}", "prompt": f"prompt number {i}"}) + "\n")
    args = ["batch", "--input", str(src), "--output", str(dst), "--model", MODEL, "--max-tokens", "2",
            "--endpoint", endpoint, "-c", "4", "--rpm", "1200", "--max-request-burst", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    proc = subprocess.Popen([*ZML, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and (not dst.exists() or len(dst.read_text().splitlines()) < 8):
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(10)
    partial = len(dst.read_text().splitlines())
    assert 8 <= partial < n, partial
    with dst.open("a") as fh:  # a torn write, as a kill in the middle of a line leaves it
        fh.write('{"index": 39, "output_te')
    p = zml_cli(*args, "--resume")
    assert p.returncode == 0, p.stderr
    rows = _rows(dst)
    assert sorted(r["index"] for r in rows) == list(range(n))  # type: ignore[type-var]
    assert all(r["output_text"] and r["id"] == f"p{r['index']}" for r in rows)
    assert f"{n}/{n} (100%)" in p.stderr and "req/s" in p.stderr and "ETA" in p.stderr
    # Resuming a finished run does nothing and changes nothing.
    before = dst.read_text()
    p = zml_cli(*args, "--resume")
    assert p.returncode == 0 and dst.read_text() == before


def test_batch_failed_rows_are_retried_on_resume(zml_stack: Stack, tmp_path: Path) -> None:
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text('"first"\n{"prompt": "second", "model": "no-such-model"}\nthird\n')
    base = ["batch", "--input", str(src), "--output", str(dst), "--model", MODEL, "--max-tokens", "1",
            "--endpoint", zml_stack.gateway_url]
    p = zml_cli(*base)
    assert p.returncode == 1 and "1 of 3 requests failed (MODEL_NOT_LOADED)" in p.stderr
    rows = {r["index"]: r for r in _rows(dst)}
    assert rows[1]["code"] == "MODEL_NOT_LOADED" and rows[0]["output_text"] and rows[2]["output_text"]
    src.write_text('"first"\n"second"\nthird\n')  # fixed input: only item 1 runs again
    p = zml_cli(*base, "--resume")
    assert p.returncode == 0, p.stderr
    assert sorted(r["index"] for r in _rows(dst)) == [0, 1, 2]  # type: ignore[type-var]
