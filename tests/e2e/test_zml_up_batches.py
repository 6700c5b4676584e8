"""The Batch API as a newcomer meets it: `zml up` (authorization on, the batch runner started
with its own identity), then the `openai` package unmodified, the SDK's client.batches (sync
and async), `zml batch --server` and `zml batches`."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

import zml
import re

import httpx

from zmlcore.runtime.launch import Proc, free_port, spawn

MODEL = "meta-llama/llama-3-8b-instruct"


def _zml(*args: str) -> list[str]:
    return [sys.executable, "-m", "zml.cli", *args]


@pytest.fixture(scope="module")
def up_proc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Proc]]:
    data = tmp_path_factory.mktemp("zml-data")
    gw = free_port()
    proc = spawn("zml-up", _zml("up", "--gateway-port", str(gw), "--nats-port", str(free_port()), "--data-dir",
                                str(data), "--standby", "0"))
    try:
        assert proc.wait_for("zml metrics:", 150), proc.tail()
        url = f"http://127.0.0.1:{gw}"
        # `zml ready` comes with the first node up; the demo's MI300X and Inferentia2 load for a
        # few seconds more, and `zml up` then measures each node's speeds. Where batch lines go
        # depends on both: a node whose speeds are not measured yet is scored as possibly fast
        # (explored), so the cheapest family is only the cheapest once every node is measured.
        deadline = time.monotonic() + 90
        while not all(n["status"] == "up" and (n.get("model_speeds") or {}).get(MODEL, {}).get("source") == "measured"
                      for n in httpx.get(url + "/v1/nodes", timeout=10).json()["nodes"]):
            assert time.monotonic() < deadline, httpx.get(url + "/v1/nodes", timeout=10).text[-3000:]
            time.sleep(0.5)
        yield url, proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def up(up_proc: tuple[str, Proc]) -> str:
    return up_proc[0]


def _lines(n: int) -> bytes:
    return "\n".join(json.dumps({"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": MODEL, "messages": [{"role": "user", "content": f"hello {i}"}],
                                          "max_tokens": 4}}) for i in range(n)).encode()


@pytest.mark.timeout(300)
def test_the_openai_package_against_zml_up(up_proc: tuple[str, Proc]) -> None:
    up, proc = up_proc
    client = openai.OpenAI(base_url=up + "/v1", api_key="unused", max_retries=0)
    f = client.files.create(file=("requests.jsonl", io.BytesIO(_lines(12))), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, batch
        time.sleep(0.5)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 12, batch
    rows = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
    assert sorted(r["custom_id"] for r in rows) == sorted(f"q{i}" for i in range(12))
    assert all(r["response"]["status_code"] == 200 for r in rows)
    # the batch policy sends lines to the cheapest capacity of the demo fleet (MI300X)
    families = {r["response"]["body"]["zml"]["family"] for r in rows}
    # (cost per unit of capacity as measured: MI300X, then Inferentia2 within ~15%)
    assert families <= {"MI300X", "Inferentia2"}, [
        httpx.get(f"{up}/v1/decisions/{r['response']['body']['zml']['decision_id']}", timeout=10).json()
        for r in rows if r["response"]["body"]["zml"]["family"] not in ("MI300X", "Inferentia2")]
    assert batch.id in [b.id for b in client.batches.list()]
    other = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert client.batches.cancel(other.id).status in ("cancelling", "cancelled", "completed")
    # visible: the dashboard lists the batch with its progress, the runner counts lines by outcome
    state = httpx.get(up + "/dashboard/state", timeout=10).json()
    shown = {b["id"]: b for b in state["batches"]}
    assert shown[batch.id]["status"] == "completed" and shown[batch.id]["completed"] == 12, state["batches"]
    line = next(x for x in proc.lines if x.startswith("zml metrics:"))
    port = dict(re.findall(r"([\w-]+) :(\d+)", line))["batch-1"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    done = re.search(r'^zml_batch_lines_total\{outcome="completed"\} (\S+)$', text, re.M)
    assert done and float(done.group(1)) >= 12, text[-2000:]
    for family in families:  # each family that served lines (either, as load has it) counts their tokens
        assert re.search(rf'^zml_batch_tokens_total\{{family="{family}",kind="completion"\}} ', text, re.M), \
            (family, text[-2000:])


@pytest.mark.timeout(300)
def test_sdk_batches_sync_and_async(up: str) -> None:
    with zml.Client(endpoint=up) as client:
        batch = client.batches.submit(["one", "two", {"id": "three", "messages": [{"role": "user", "content": "3"}]}],
                                      model=MODEL, max_tokens=3, metadata={"from": "sdk"})
        assert batch.status == "validating" and batch.request_counts.total == 3
        seen: list[str] = []
        done = client.batches.wait(batch.id, poll_s=0.3, timeout=120, on_progress=lambda b: seen.append(b.status))
        assert done.status == "completed" and done.done and seen[-1] == "completed"
        rows = client.batches.results(batch.id)
        assert sorted(r["custom_id"] for r in rows) == ["0", "1", "three"]
        assert batch.id in [b.id for b in client.batches.list().data]
        assert client.files.retrieve(done.output_file_id).purpose == "batch_output"

    async def go() -> None:
        async with zml.AsyncClient(endpoint=up) as client:
            f = await client.files.create(_lines(4), filename="a.jsonl")
            b = await client.batches.create(f.id)
            b = await client.batches.wait(b.id, poll_s=0.3, timeout=120)
            assert b.status == "completed" and b.request_counts.completed == 4
            assert len(await client.batches.results(b.id)) == 4
            assert await client.files.delete(f.id)

    asyncio.run(go())


@pytest.mark.timeout(300)
def test_zml_batch_server_and_zml_batches(up: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(["hello", json.dumps({"id": "p2", "prompt": "bonjour"}),
                                  json.dumps({"id": "p3", "messages": [{"role": "user", "content": "hola"}]})]) + "\n")
    out = tmp_path / "results.jsonl"
    run = subprocess.run(_zml("batch", "--server", "--input", str(prompts), "--output", str(out), "--model", MODEL,
                              "--max-tokens", "3", "--endpoint", up, "--poll", "0.3"),
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["0", "p2", "p3"]
    assert "completed: 3 completed, 0 failed" in run.stderr
    batch_id = run.stderr.split("zml batch: ", 1)[1].split(" ", 1)[0]
    listed = subprocess.run(_zml("batches", "--endpoint", up), capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0 and batch_id in listed.stdout and "completed" in listed.stdout, listed
    shown = subprocess.run(_zml("batches", "show", batch_id, "--endpoint", up), capture_output=True, text=True,
                           timeout=60)
    assert json.loads(shown.stdout)["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    # --no-wait, then --follow picks it up
    run = subprocess.run(_zml("batch", "--server", "--no-wait", "--input", str(prompts), "--output", str(out),
                              "--model", MODEL, "--endpoint", up), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().startswith("batch_"), run.stderr
    again = subprocess.run(_zml("batch", "--server", "--follow", run.stdout.strip(), "--output", str(out),
                                "--endpoint", up, "--poll", "0.3"), capture_output=True, text=True, timeout=180)
    assert again.returncode == 0, again.stderr
    assert len(out.read_text().splitlines()) == 3
