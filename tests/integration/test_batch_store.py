"""The Batch API's JetStream storage on a real nats-server: files by owner (another owner gets
404), streamed reads checked against the digest, compare-and-set updates that lose nothing,
first-wins line results, bounded buckets and streams."""

from __future__ import annotations

import asyncio
import io
import os

import msgspec
import nats
import pytest
from nats.js.errors import APIError

from zmlcore import subjects
from zmlcore.batch.store import BatchStore
from zmlcore.config import BatchConfig
from zmlcore.errors import NotFoundError
from zmlcore.messages.batch import BatchRecord, FileRecord, LineResult, line_result_decoder


@pytest.fixture
async def store(own_nats: str):  # type: ignore[no-untyped-def]
    nc = await nats.connect(own_nats)
    try:
        yield await BatchStore.open(nc, BatchConfig(max_store_bytes=64 * 1024 * 1024, max_file_bytes=8 * 1024 * 1024),
                                    consumers=True)
    finally:
        await nc.close()


async def test_files_belong_to_their_owner_and_read_back_whole(store: BatchStore) -> None:
    data = os.urandom(300_000) + b"\n" * 10  # three chunks and a bit
    rec = FileRecord(id="file-000000000001aaaaaaaaaaaa", owner="key:a", filename="in.jsonl", bytes=len(data),
                     created_at=1)
    await store.put_file(rec, io.BytesIO(data))
    assert (await store.file("key:a", rec.id)).bytes == len(data)
    with pytest.raises(NotFoundError):
        await store.file("key:b", rec.id)
    with pytest.raises(NotFoundError):
        await store.delete_file("key:b", rec.id)
    chunks = [c async for c in store.read_file(rec.id)]
    assert b"".join(chunks) == data and len(chunks) == 3
    assert [f.id for f in await store.list_files("key:a")] == [rec.id]
    assert await store.list_files("key:b") == []
    await store.delete_file("key:a", rec.id)
    with pytest.raises(NotFoundError):
        await store.file("key:a", rec.id)
    with pytest.raises(NotFoundError):
        async for _ in store.read_file(rec.id):
            pass


async def test_concurrent_updates_all_land(store: BatchStore) -> None:
    rec = BatchRecord(id="batch_000000000001bbbbbbbbbbbb", owner="key:a", endpoint="/v1/chat/completions",
                      input_file_id="file-x", completion_window="24h", created_at=1, expires_at=2)
    await store.create_batch(rec)

    def add(shard: int):  # type: ignore[no-untyped-def]
        def change(r: BatchRecord) -> BatchRecord:
            return msgspec.structs.replace(r, progress={**r.progress, str(shard): [shard, 0, 0, 0]},
                                           done=sorted({*r.done, shard}))
        return change

    await asyncio.gather(*(store.update_batch("key:a", rec.id, add(i)) for i in range(20)))
    got = await store.batch("key:a", rec.id)
    assert got.done == list(range(20)) and sum(v[0] for v in got.progress.values()) == sum(range(20))
    with pytest.raises(NotFoundError):
        await store.batch("key:b", rec.id)
    assert [b.id for b in await store.list_batches("key:a")] == [rec.id]


async def test_a_line_keeps_its_first_result(store: BatchStore) -> None:
    subject = subjects.batch_result("batch_000000000001cccccccccccc", 0, 3)
    first = msgspec.json.encode(LineResult(line=3, custom_id="c", status_code=200, body=msgspec.Raw(b'{"a":1}')))
    assert await store.publish(subject, first, "r-3")
    assert not await store.publish(subject, first, "r-3")  # a repeat within the dedup window
    later = msgspec.json.encode(LineResult(line=3, custom_id="c", status_code=500))
    with pytest.raises(APIError):  # a second result for the line, after the window: refused
        await store.js.publish(subject, later)
    msg = await store.js.get_last_msg(subjects.BATCH_RESULTS_STREAM, subject)
    assert line_result_decoder.decode(msg.data).status_code == 200


async def test_every_bucket_and_stream_is_bounded(store: BatchStore) -> None:
    for stream in (subjects.BATCH_WORK_STREAM, subjects.BATCH_RESULTS_STREAM, f"OBJ_{subjects.BATCH_FILES_BUCKET}",
                   f"KV_{subjects.BATCH_INDEX_BUCKET}"):
        info = await store.js.stream_info(stream)
        assert info.config.max_bytes and info.config.max_bytes > 0, stream
        assert info.config.max_age and info.config.max_age > 0, stream


async def test_results_read_back_by_shard_and_large_replies_spill(store: BatchStore) -> None:
    batch = "batch_000000000001dddddddddddd"
    big = b'{"data":"' + b"x" * (store.nc.max_payload + 10) + b'"}'
    for shard, line in ((0, 0), (0, 1), (1, 2)):
        body = big if line == 1 else b'{"n":%d}' % line
        assert await store.record(batch, shard, LineResult(line=line, custom_id=f"c{line}", status_code=200,
                                                           body=msgspec.Raw(body)))
    assert not await store.record(batch, 0, LineResult(line=0, custom_id="c0", status_code=500))
    got = {r.line: r async for r in store.results(batch, 0)}
    assert sorted(got) == [0, 1] and bytes(got[1].body) == big and got[1].spilled
    assert [r.line async for r in store.results(batch)] == [0, 1, 2]
    assert [r async for r in store.results(batch, 7)] == []
    await store.drop_results(batch, [got[1].spilled])
    assert [r async for r in store.results(batch)] == []


async def test_listings_are_whole_when_the_watch_marks_its_end_early(store: BatchStore,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """CI saw ``client.batches.list()`` come back empty with two batches stored: nats-py's watch
    put its end-of-snapshot marker before the entries (nats-io/nats.py#842) and the store took
    it for an empty bucket. Every listing (batches, files) reads through kvfollow's snapshot."""
    from test_kvfollow import early_marker
    early_marker(monkeypatch, skip=0)
    ids = [f"batch_00000000000{i}dddddddddddd" for i in range(1, 4)]
    for bid in ids:
        await store.create_batch(BatchRecord(id=bid, owner="key:early", endpoint="/v1/chat/completions",
                                             input_file_id="file-x", completion_window="24h", created_at=1,
                                             expires_at=2))
    rec = FileRecord(id="file-000000000002eeeeeeeeeeee", owner="key:early", filename="in.jsonl", bytes=3, created_at=1)
    await store.put_file(rec, io.BytesIO(b"{}\n"))
    for _ in range(3):
        assert sorted(b.id for b in await store.list_batches("key:early")) == ids
        assert [f.id for f in await store.list_files("key:early")] == [rec.id]
    assert await store.list_batches("key:late") == []
    assert await store.active_batches("key:early") == 3


async def test_listings_are_whole_under_the_real_race(store: BatchStore) -> None:
    """The same race unprovoked: 1,500 listings, each through a new watch, all whole (the old
    store's came back empty in 2 runs of 3 at 900 listings). Each one's consumer is deleted as
    it ends: the old store left it for 30 s, and the 1,000th listing in that time was refused
    (nats-server's "maximum consumers limit reached")."""
    ids = [f"batch_00000000000{i}ffffffffffff" for i in range(1, 4)]
    for bid in ids:
        await store.create_batch(BatchRecord(id=bid, owner="key:race", endpoint="/v1/chat/completions",
                                             input_file_id="file-x", completion_window="24h", created_at=1,
                                             expires_at=2))
    counts = [len(await store.list_batches("key:race")) for _ in range(1500)]
    short = [n for n in counts if n != 3]
    assert not short, f"{len(short)} of 1500 listings were short: {short[:5]}"


async def test_reading_results_leaves_no_consumer_behind(store: BatchStore) -> None:
    """A runner reads a shard's results on every take-over and reconnect: each read's consumer
    is deleted as it ends, not left on the server for 30 s."""
    bid = "batch_000000000009gggggggggggg"
    for line in range(3):
        body = msgspec.Raw(b'{"ok":true}')
        assert await store.record(bid, 0, LineResult(line=line, custom_id=f"c{line}", status_code=200, body=body))
    before = (await store.js.stream_info(subjects.BATCH_RESULTS_STREAM)).state.consumer_count
    for _ in range(20):
        assert [r.line async for r in store.results(bid, 0)] == [0, 1, 2]
    assert (await store.js.stream_info(subjects.BATCH_RESULTS_STREAM)).state.consumer_count == before


async def test_reading_a_file_leaves_no_consumer_behind(store: BatchStore) -> None:
    """GET /v1/files/{id}/content reads through an ordered consumer: a client downloading a file
    again and again must not pile consumers up on the server until it refuses new ones."""
    data = os.urandom(1000) + b"\n"
    rec = FileRecord(id="file-000000000003hhhhhhhhhhhh", owner="key:dl", filename="in.jsonl", bytes=len(data),
                     created_at=1)
    await store.put_file(rec, io.BytesIO(data))
    stream = f"OBJ_{subjects.BATCH_FILES_BUCKET}"
    before = (await store.js.stream_info(stream)).state.consumer_count
    for _ in range(20):
        assert b"".join([c async for c in store.read_file(rec.id)]) == data
    assert (await store.js.stream_info(stream)).state.consumer_count == before
