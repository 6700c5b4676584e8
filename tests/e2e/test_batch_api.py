"""The Batch API end to end: the `openai` package unmodified against the gateway, two batch
runners on the demo fleet's shape, API keys that own their files and batches, hostile files,
cancel, expiry, plans counting batch tokens."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import nats
import openai
import pytest

from conftest import MODEL, Stack, launch_stack
from zmlcore import subjects
from zmlcore.access.apikeys import create_key
from zmlcore.access.limiter import limit_key
from zmlcore.messages.keys import PlanLimits, limit_state_decoder
from zmlcore.runtime.launch import service_argv, spawn

BATCH = """
[batch]
completion_windows = ["24h", "3s"]
shard_lines = 25
max_file_bytes = 12_000_000
max_line_bytes = 1_000_000
"""


@pytest.fixture(scope="module")
def stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, str]]]:
    st = launch_stack(own_nats, tmp_path_factory.mktemp("batch"), routers=2, extra=BATCH)
    try:
        for i in (1, 2):  # two runners share the work
            st.procs[f"batch-{i}"] = spawn(f"batch-{i}", service_argv("batch", st.config_path, own_nats,
                                                                      "--runner-id", f"batch-{i}"))

        async def keys() -> dict[str, str]:
            nc = await nats.connect(own_nats)
            try:
                a, _ = await create_key(nc, plan="custom", limits=PlanLimits(tokens_per_minute=10_000_000), name="a")
                b, _ = await create_key(nc, plan="custom", limits=PlanLimits(), name="b")
                return {"a": a, "b": b}
            finally:
                await nc.close()

        found = asyncio.run(keys())
        deadline = time.monotonic() + 10
        while httpx.get(st.gateway_url + "/v1/models", headers={"authorization": f"Bearer {found['a']}"}).status_code != 200:
            assert time.monotonic() < deadline, "the gateway never accepted the new key"
            time.sleep(0.1)
        yield st, found
    finally:
        st.stop()


def client_for(stack: tuple[Stack, dict[str, str]], who: str = "a") -> openai.OpenAI:
    st, keys = stack
    return openai.OpenAI(base_url=st.gateway_url + "/v1", api_key=keys[who], max_retries=0)


def lines(n: int, *, max_tokens: int = 6, prefix: str = "r", model: str = MODEL, short: int = 0) -> bytes:
    """``short``: the first lines ask for 2 tokens whatever ``max_tokens`` says."""
    return "\n".join(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": model, "messages": [{"role": "user", "content": f"q{i}"}],
                                          "max_tokens": 2 if i < short else max_tokens}})
                      for i in range(n)).encode() + b"\n"


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 90) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.3)


def all_rows(client: openai.OpenAI, b: Any) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for fid in (b.output_file_id, b.error_file_id):
        if fid:
            out += [json.loads(x) for x in client.files.content(fid).text.splitlines() if x.strip()]
    return out


def exactly_once(rows: list[dict[str, Any]], n: int, prefix: str = "r") -> None:
    ids = [r["custom_id"] for r in rows]
    assert sorted(ids) == sorted(f"{prefix}{i}" for i in range(n)), "every custom_id exactly once"


def test_the_openai_package_runs_a_batch_unmodified(stack: tuple[Stack, dict[str, str]]) -> None:
    client = client_for(stack)
    f = client.files.create(file=("in.jsonl", io.BytesIO(lines(60))), purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and f.object == "file"
    assert client.files.retrieve(f.id).filename == "in.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "nightly"})
    assert b.status == "validating" and b.metadata == {"job": "nightly"} and b.request_counts.total == 60
    b = wait_done(client, b.id)
    assert b.status == "completed" and b.request_counts.completed == 60 and b.request_counts.failed == 0
    assert b.output_file_id and b.error_file_id is None and b.usage is not None and b.usage.output_tokens == 360
    assert b.in_progress_at and b.completed_at and b.completed_at >= b.in_progress_at
    rows = all_rows(client, b)
    exactly_once(rows, 60)
    for row in rows:
        assert row["id"].startswith("batch_req_") and row["error"] is None
        resp = row["response"]
        assert resp["status_code"] == 200 and resp["request_id"]
        body = resp["body"]
        assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 6
        assert body["zml"]["node_id"] and body["zml"]["family"] and body["zml"]["policy"] == "batch"
    # list: newest first, paged with `after` (the package follows the pages itself)
    b2 = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    page = client.batches.list(limit=1)
    assert [x.id for x in page.data] == [b2.id] and page.has_more
    assert [x.id for x in client.batches.list(limit=1)][:2] == [b2.id, b.id]  # iterating follows the pages
    out = client.files.retrieve(b.output_file_id)
    assert out.purpose == "batch_output"
    assert {x.id for x in client.files.list()} >= {f.id, out.id}
    wait_done(client, b2.id)
    assert client.files.delete(out.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(out.id)
    with pytest.raises(openai.APIStatusError) as err:  # a finished batch cannot be cancelled
        client.batches.cancel(b.id)
    assert err.value.status_code == 409 and err.value.body["code"] == "BATCH_STATE"


def test_another_key_sees_404_and_no_key_401(stack: tuple[Stack, dict[str, str]]) -> None:
    a, b = client_for(stack, "a"), client_for(stack, "b")
    f = a.files.create(file=("mine.jsonl", io.BytesIO(lines(3))), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (lambda: b.files.retrieve(f.id), lambda: b.files.content(f.id), lambda: b.files.delete(f.id),
                 lambda: b.batches.retrieve(batch.id), lambda: b.batches.cancel(batch.id),
                 lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert batch.id not in [x.id for x in b.batches.list()]
    assert f.id not in [x.id for x in b.files.list()]
    st, _ = stack
    assert httpx.get(st.gateway_url + f"/v1/batches/{batch.id}").status_code == 401
    wait_done(a, batch.id)


def test_hostile_files_get_clear_4xx_and_nothing_else_is_affected(stack: tuple[Stack, dict[str, str]],
                                                                  tmp_path: Path) -> None:
    st, keys = stack
    client = client_for(stack)
    auth = {"authorization": f"Bearer {keys['a']}"}
    huge_line = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions",
                            "body": {"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000_000}]}})
    cases = {
        "malformed": (b'{"custom_id": "a", "method": "POST"\nnot json at all\n', 400, "INVALID_FILE"),
        "duplicate": (lines(2) + lines(1), 400, "INVALID_FILE"),
        "ten_mb_line": (lines(2) + huge_line.encode() + b"\n", 400, "INVALID_FILE"),
        "unknown_model": (lines(2, model="gpt-9000"), 400, "INVALID_FILE"),
        "empty": (b"\n\n", 400, "INVALID_FILE"),
        "bad_url": (lines(1).replace(b"/v1/chat/completions", b"/v1/images"), 400, "INVALID_FILE"),
    }
    for name, (data, status, code) in cases.items():
        with pytest.raises(openai.APIStatusError) as err:
            client.files.create(file=(f"{name}.jsonl", io.BytesIO(data)), purpose="batch")
        assert err.value.status_code == status, (name, err.value.body)
        assert err.value.body["code"] == code, (name, err.value.body)
        assert "line" in err.value.body["message"] or name == "empty", err.value.body
    assert "line 3" in _last(client, lines(2) + lines(1))  # the duplicate is named by its line
    with pytest.raises(openai.BadRequestError):  # another purpose
        client.files.create(file=("x.jsonl", io.BytesIO(lines(1))), purpose="fine-tune")
    r = httpx.post(st.gateway_url + "/v1/files", headers=auth, json={"purpose": "batch"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "BAD_REQUEST"
    # over [batch] max_file_bytes: 413, announced (content-length) or not (streamed in chunks)
    big = tmp_path / "big.jsonl"
    big.write_bytes(lines(1) * (13_000_000 // len(lines(1)) + 1))
    with pytest.raises(openai.APIStatusError) as err:
        client.files.create(file=big.open("rb"), purpose="batch")
    assert err.value.status_code == 413 and err.value.body["code"] == "REQUEST_TOO_LARGE"

    def chunks() -> Iterator[bytes]:
        yield b"--B\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
        yield b"--B\r\ncontent-disposition: form-data; name=\"file\"; filename=\"s.jsonl\"\r\n\r\n"
        for _ in range(14):
            yield lines(1) * (1_000_000 // len(lines(1)))
        yield b"\r\n--B--\r\n"

    r = httpx.post(st.gateway_url + "/v1/files", headers={**auth, "content-type": "multipart/form-data; boundary=B"},
                   content=chunks(), timeout=60)
    assert r.status_code == 413, r.text
    # a batch that names an endpoint its file's lines do not use fails validation (OpenAI's errors)
    f = client.files.create(file=("ok.jsonl", io.BytesIO(lines(2))), purpose="batch")
    bad = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings",
                                                  completion_window="24h").id)
    assert bad.status == "failed" and bad.errors and bad.errors.data[0].code == "mismatched_endpoint"
    for body, status in (({"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"}, 400),
                         ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions",
                           "completion_window": "24h"}, 404),
                         ({"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                           "metadata": {"policy": "no-such-policy"}}, 400),
                         ({"endpoint": "/v1/chat/completions"}, 400)):
        r = httpx.post(st.gateway_url + "/v1/batches", headers=auth, json=body)
        assert r.status_code == status, (body, r.text)
    # the fleet never noticed
    r = httpx.post(st.gateway_url + "/v1/chat/completions", headers=auth, timeout=20,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "still here?"}], "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert all(p.alive() for p in st.procs.values())


def _last(client: openai.OpenAI, data: bytes) -> str:
    try:
        client.files.create(file=("x.jsonl", io.BytesIO(data)), purpose="batch")
    except openai.APIStatusError as exc:
        return str(exc.body["message"])
    raise AssertionError("accepted")


def test_cancel_drains_what_runs_and_writes_the_rest_as_cancelled(stack: tuple[Stack, dict[str, str]]) -> None:
    client = client_for(stack)
    # ~2 s a line at the sims' 20x: the fleet's 160 slots need several rounds for 600 lines
    f = client.files.create(file=("long.jsonl", io.BytesIO(lines(600, max_tokens=2000))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while client.batches.retrieve(b.id).request_counts.completed < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    c = client.batches.cancel(b.id)
    assert c.status == "cancelling" and c.cancelling_at
    assert client.batches.cancel(b.id).status in ("cancelling", "cancelled")  # cancelling again: no error
    b = wait_done(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    rows = all_rows(client, b)
    exactly_once(rows, 600)
    cancelled = [r for r in rows if r["error"] and r["error"]["code"] == "batch_cancelled"]
    done = [r for r in rows if r["response"] and r["response"]["status_code"] == 200]
    assert cancelled and done and len(cancelled) + len(done) == 600
    assert b.request_counts.completed == len(done) and b.request_counts.failed == len(cancelled)


def test_a_batch_past_its_window_expires_with_what_finished_kept(stack: tuple[Stack, dict[str, str]]) -> None:
    client = client_for(stack)
    # The first shard's lines short, the rest ~2 s each at the sims' 20x (the fleet's 160 slots need
    # 4 rounds): some finish inside the 3 s window even on a loaded box, where long lines alone
    # could all still run at its end (seen at load 11: expired 600, done 0).
    f = client.files.create(file=("slow.jsonl", io.BytesIO(lines(600, max_tokens=2000, short=25))), purpose="batch")
    b = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                completion_window="3s").id)
    assert b.status == "expired" and b.expired_at
    rows = all_rows(client, b)
    exactly_once(rows, 600)
    expired = [r for r in rows if r["error"] and r["error"]["code"] == "batch_expired"]
    done = [r for r in rows if r["response"] and r["response"]["status_code"] == 200]
    assert expired and done and len(done) + len(expired) == 600


def test_a_keys_plan_counts_its_batch_tokens(stack: tuple[Stack, dict[str, str]]) -> None:
    st, keys = stack
    client = client_for(stack)
    key_id = keys["a"].split("_")[1]

    async def tokens() -> int:
        nc = await nats.connect(st.nats_url)
        try:
            kv = await nc.jetstream().key_value(subjects.LIMITS_BUCKET)
            try:
                entry = await kv.get(limit_key(f"key:{key_id}"))
            except Exception:
                return 0
            s = limit_state_decoder.decode(entry.value)
            return s.tokens + s.prev_tokens
        finally:
            await nc.close()

    before = asyncio.run(tokens())
    f = client.files.create(file=("plan.jsonl", io.BytesIO(lines(20, max_tokens=10))), purpose="batch")
    b = wait_done(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                completion_window="24h").id)
    assert b.status == "completed" and b.usage is not None
    deadline = time.monotonic() + 10
    while asyncio.run(tokens()) - before < b.usage.total_tokens:
        assert time.monotonic() < deadline, (asyncio.run(tokens()), before, b.usage)
        time.sleep(0.5)
