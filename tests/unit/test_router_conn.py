"""zml_router.node.conn: a reply's body counted and bounded per read, as the node sends it in
chunks (httptools appends each to the body; ``Conn`` accounts for what a read added after it)."""

from __future__ import annotations

import asyncio

import pytest

from zml_router.node.conn import LINGER_BYTES, Conn


class _Pool:
    loop: asyncio.AbstractEventLoop
    error_limit = 64 * 1024

    def __init__(self) -> None:
        self.closed: list[Conn] = []
        self.parked: list[Conn] = []

    def close(self, conn: Conn) -> None:
        conn.closed = True
        self.closed.append(conn)

    def forget(self, conn: Conn) -> None:
        pass

    def park(self, conn: Conn) -> None:
        self.parked.append(conn)


class _Transport:
    def __init__(self) -> None:
        self.paused = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        pass


def _chunked(*pieces: bytes, end: bool = True, status: int = 200) -> bytes:
    head = b"HTTP/1.1 %d OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n" % status
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + (b"0\r\n\r\n" if end else b"")


def _conn(whole: bool, limit: int = 0) -> tuple[Conn, _Pool, _Transport]:
    pool = _Pool()
    conn = Conn(pool, ("http", "node", 80))
    transport = _Transport()
    conn.connection_made(transport)  # type: ignore[arg-type]
    conn._new_reply(whole, limit)
    return conn, pool, transport


def test_a_read_of_many_chunks_is_kept_whole_and_counted() -> None:
    conn, _, _ = _conn(whole=True, limit=1 << 20)
    pieces = [b"data: %d\n\n" % i for i in range(19)]
    conn.data_received(_chunked(*pieces))
    assert conn.complete and not conn.over
    assert b"".join(conn.body) == b"".join(pieces)
    assert conn.buffered == sum(map(len, pieces))


def test_a_whole_reply_keeps_its_bound_and_stops_reading_there() -> None:
    conn, _, transport = _conn(whole=True, limit=25)
    conn.data_received(_chunked(b"a" * 10, b"b" * 10, end=False))  # 20: within the bound
    assert not conn.over and conn.buffered == 20
    conn.data_received(b"a\r\ncccccccccc\r\na\r\ndddddddddd\r\n")  # 20 more, over it
    assert conn.over and conn.buffered == 25 and transport.paused == 1
    assert b"".join(conn.body) == b"a" * 10 + b"b" * 10 + b"c" * 5
    conn.data_received(b"a\r\neeeeeeeeee\r\n")  # past the bound: not read
    assert b"".join(conn.body) == b"a" * 10 + b"b" * 10 + b"c" * 5


def test_an_error_reply_keeps_at_most_the_error_limit() -> None:
    conn, pool, _ = _conn(whole=True, limit=1 << 20)
    pool.error_limit = 8
    conn.data_received(_chunked(b"x" * 5, b"y" * 5, status=500))
    assert conn.over and b"".join(conn.body) == b"x" * 5 + b"y" * 3


async def test_a_streamed_reply_wakes_its_reader_once_per_read() -> None:
    conn, pool, _ = _conn(whole=False)
    pool.loop = asyncio.get_running_loop()
    conn.data_received(_chunked(end=False))
    assert conn.headers_done and not conn.body
    waiter = asyncio.ensure_future(conn.wait())
    await asyncio.sleep(0)
    conn.data_received(b"3\r\none\r\n3\r\ntwo\r\n")
    await waiter
    assert list(conn.body) == [b"one", b"two"] and conn.buffered == 6


def test_bytes_after_done_are_counted_not_kept_and_bounded() -> None:
    conn, pool, _ = _conn(whole=False)
    conn.data_received(_chunked(b"data: [DONE]\n\n", end=False))
    conn.lingering = True  # released after [DONE] (zml_router.node.client.release)
    conn.body.clear()
    conn.buffered = 0
    conn.data_received(b"4\r\nmore\r\n")
    assert not conn.body and conn.buffered == 4 and not pool.closed
    big = b"z" * LINGER_BYTES
    conn.data_received(b"%x\r\n%s\r\n" % (len(big), big))
    assert not conn.body and pool.closed == [conn]


@pytest.mark.parametrize("split", [1, 7, 64])
def test_the_body_is_the_same_however_the_reply_is_cut_into_reads(split: int) -> None:
    conn, _, _ = _conn(whole=True, limit=1 << 20)
    pieces = [b"data: {\"i\": %d}\n\n" % i for i in range(12)]
    raw = _chunked(*pieces)
    for i in range(0, len(raw), split):
        conn.data_received(raw[i:i + split])
    assert conn.complete and b"".join(conn.body) == b"".join(pieces)
    assert conn.buffered == sum(map(len, pieces))
