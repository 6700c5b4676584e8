"""Checking batch input files (zmlcore.batch.lines), the shapes clients read (objects), shards
and ids: pure, no server."""

from __future__ import annotations

import json

import msgspec
import pytest

from zmlcore.batch import ids, objects, shards
from zmlcore.batch.lines import LineChecker, LineLimits, Summary
from zmlcore.messages.batch import BatchRecord, FileRecord, LineResult

MODEL = "meta-llama/llama-3-8b-instruct"


def line(cid: str, **over: object) -> bytes:
    row = {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
           "body": {"model": MODEL, "messages": [{"role": "user", "content": f"q {cid}"}], "max_tokens": 4}}
    row.update(over)
    return json.dumps(row).encode()


def check(data: bytes, *, piece: int | None = None, max_line: int = 4096, max_lines: int = 100) -> Summary:
    c = LineChecker(LineLimits(max_line_bytes=max_line, max_lines=max_lines), lambda m: m in (MODEL, "emb"))
    if piece is None:
        c.feed(data)
    else:
        for i in range(0, len(data), piece):
            c.feed(data[i:i + piece])
    return c.finish()


def codes(s: Summary) -> list[tuple[int, str]]:
    return [(p.line, p.code) for p in s.errors]


@pytest.mark.parametrize("piece", [None, 1, 7, 64])
def test_a_good_file_in_any_pieces(piece: int | None) -> None:
    data = b"\n".join(line(f"r{i}") for i in range(5)) + b"\n\n"
    s = check(data, piece=piece)
    assert s.errors == [] and s.lines == 5 and s.endpoints == ["/v1/chat/completions"] and s.models == [MODEL]
    assert s.bytes == len(data)


def test_every_bad_line_is_named_by_its_number() -> None:
    emb = json.dumps({"custom_id": "e", "method": "POST", "url": "/v1/embeddings",
                      "body": {"model": "emb", "input": "x"}}).encode()
    data = b"\n".join([
        line("a"),                                          # 1 ok
        b"{not json",                                       # 2
        line("a"),                                          # 3 duplicate
        line("b", method="GET"),                            # 4
        line("c", url="/v1/images/generations"),            # 5
        line("d", body={"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),  # 6
        line("e2", body={"model": MODEL, "messages": []}),  # 7 empty messages
        line("f", url="/v1/embeddings"),                    # 8 chat body on embeddings
        line("g", body={"model": MODEL, "prompt": "x", "stream": True}, url="/v1/completions"),  # 9
        emb,                                                # 10 ok
        line(""),                                           # 11 empty custom_id
        b"[1, 2]",                                          # 12
    ])
    s = check(data)
    assert codes(s) == [(2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_method"),
                        (5, "invalid_url"), (6, "model_not_found"), (7, "invalid_body"), (8, "invalid_body"),
                        (9, "invalid_body"), (11, "invalid_custom_id"), (12, "invalid_json_line")]
    assert "line 3: custom_id 'a' appears more than once" in s.message()
    assert sorted(s.endpoints) == ["/v1/chat/completions", "/v1/embeddings"]


@pytest.mark.parametrize("piece", [None, 100, 1000])
def test_a_long_line_is_reported_not_buffered(piece: int | None) -> None:
    huge = line("big", body={"model": MODEL, "messages": [{"role": "user", "content": "x" * 50_000}]})
    data = line("a") + b"\n" + huge + b"\n" + line("b") + b"\n" + huge
    c = LineChecker(LineLimits(max_line_bytes=4096, max_lines=10), lambda m: True)
    for i in range(0, len(data), piece or len(data)):
        c.feed(data[i:i + (piece or len(data))])
        assert len(c._partial) <= 4096  # never more than one line's worth held
    s = c.finish()
    assert codes(s) == [(2, "line_too_long"), (4, "line_too_long")] and s.lines == 4


def test_file_level_problems() -> None:
    assert codes(check(b"\n \n")) == [(0, "empty_file")]
    s = check(b"\n".join(line(f"r{i}") for i in range(12)), max_lines=10)
    assert codes(s) == [(0, "too_many_lines")] and s.lines == 12
    many = check(b"\n".join(b"{" for _ in range(50)))
    assert len(many.errors) == 20 and many.more_errors == 30 and "and 30 more" in many.message()


def test_shards_respect_lines_and_bytes() -> None:
    rows = [b"x" * 100 for _ in range(10)] + [b"", b"  "] + [b"y" * 900]
    cuts = list(shards.cut(rows, max_lines=4, max_bytes=shards.OVERHEAD + 1000))
    assert [(c.number, c.first, len(c.lines)) for c in cuts] == [(0, 0, 4), (1, 4, 4), (2, 8, 2), (3, 10, 1)]
    assert shards.split_lines(b"a\nb\nc", b"z") == ([b"za", b"b"], b"c")


def test_ids_sort_by_time_and_owner_tokens_are_safe() -> None:
    a, b = ids.new_batch_id(1000.0), ids.new_batch_id(1000.5)
    assert a < b and ids.valid_id(a, ids.BATCH_PREFIX) and not ids.valid_id(a, ids.FILE_PREFIX)
    assert not ids.valid_id("batch_../../x", ids.BATCH_PREFIX)
    tok = ids.owner_token("key:abc")
    assert tok != ids.owner_token("key:abd") and tok.isalnum()
    assert ids.output_line_id("b", 1) == ids.output_line_id("b", 1) != ids.output_line_id("b", 2)


def test_batch_object_has_openais_fields() -> None:
    rec = BatchRecord(id="batch_1", owner="o", endpoint="/v1/chat/completions", input_file_id="file-1",
                      completion_window="24h", created_at=10, expires_at=20, status="in_progress", total=5,
                      progress={"0": [2, 1, 30, 12], "1": [1, 0, 10, 4]}, metadata={"k": "v"})
    obj = objects.batch_object(rec)
    assert obj["request_counts"] == {"total": 5, "completed": 3, "failed": 1}
    assert obj["usage"]["input_tokens"] == 40 and obj["usage"]["total_tokens"] == 56
    assert obj["object"] == "batch" and obj["errors"] is None and obj["metadata"] == {"k": "v"}
    from openai.types import Batch, FileObject  # the openai package parses what we send

    Batch.model_validate(obj)
    FileObject.model_validate(objects.file_object(FileRecord(id="file-1", owner="o", filename="f", bytes=3,
                                                             created_at=1)))


def test_pages_go_newest_first_after_a_cursor() -> None:
    ids_ = [f"batch_{i:02d}" for i in range(7)]
    assert objects.page(ids_, None, 3) == (["batch_06", "batch_05", "batch_04"], True)
    assert objects.page(ids_, "batch_04", 3) == (["batch_03", "batch_02", "batch_01"], True)
    assert objects.page(ids_, "batch_01", 3) == (["batch_00"], False)
    assert objects.page(ids_, "batch_99", 2) == (["batch_06", "batch_05"], True)
    assert objects.page(ids_, "batch_04", 2, newest_first=False) == (["batch_05", "batch_06"], False)


def test_output_lines_in_openais_shape() -> None:
    ok, text = objects.output_line("b1", LineResult(line=0, custom_id="r0", status_code=200, request_id="q",
                                                    body=msgspec.Raw(b'{"id":"c","zml":{"node_id":"n"}}')))
    row = json.loads(text)
    assert ok and text.endswith(b"\n") and row["response"]["body"]["zml"]["node_id"] == "n" and row["error"] is None
    ok, text = objects.output_line("b1", LineResult(line=1, custom_id="r1", status_code=404,
                                                    body=msgspec.Raw(b'{"error":{"code":"MODEL_NOT_LOADED"}}')))
    assert not ok and json.loads(text)["response"]["status_code"] == 404
    ok, text = objects.output_line("b1", LineResult(line=2, custom_id="r2", error_code="batch_expired",
                                                    error_message="late"))
    row = json.loads(text)
    assert not ok and row["response"] is None and row["error"] == {"code": "batch_expired", "message": "late"}


def test_a_shard_run_sends_each_line_until_answered_and_skips_what_was_recorded() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services" / "batch" / "src"))
    from zml_batch.shardrun import ShardRun

    run = ShardRun(10, 5, answered_before={11: (True, 3, 4)}, max_attempts=2)
    assert run.counts == [1, 0, 3, 4] and run.left == 4
    a = run.take(0.0)
    assert a is not None and a.index == 10 and a.attempt == 1
    assert run.retry(10, 5.0)  # back in line, not before t=5
    b = run.take(0.0)
    assert b is not None and b.index == 12
    assert run.take(0.0) is not None and run.take(0.0) is not None  # 13, 14
    assert run.take(1.0) is None and run.next_due() == 5.0  # only 10 is left, not due yet
    again = run.take(5.0)
    assert again is not None and again.index == 10 and again.attempt == 2
    assert not run.retry(10, 9.0)  # attempts used up: the caller answers it with its error
    run.answered(10, ok=False)
    assert run.learn({12: (True, 1, 1), 13: (True, 1, 1), 99: (True, 0, 0)}) == 0  # in flight here, or not ours
    run.answered(12, ok=True)
    run.answered(14, ok=True, prompt=2, completion=2)
    assert not run.finished and run.in_flight == 1  # 13 is still ours
    run.answered(13, ok=True)
    assert run.finished and run.counts[:2] == [4, 1]
    taken_over = ShardRun(0, 3)
    assert taken_over.learn({1: (True, 5, 5)}) == 1
    first, second = taken_over.take(0.0), taken_over.take(0.0)
    assert first is not None and second is not None and (first.index, second.index) == (0, 2)
    refused = ShardRun(0, 1, max_attempts=1)
    job = refused.take(0.0)
    assert job is not None and refused.retry(0, 0.0, counts=False) and refused.retry(0, 0.0, counts=False) is True
