"""Cutting an input file into shards, the runners' units of work (pure).

A shard is a run of consecutive request lines sent as one message of the work stream, so it
is bounded twice: by ``[batch] shard_lines`` and by the bytes one NATS message may carry.
Blank lines are not requests and are dropped; every request line gets its index (0-based),
the line's number in the batch everywhere else (results, request ids, output ids).

    cutter = Cutter(max_lines=200, max_bytes=900_000)
    for raw in lines:
        shard = cutter.add(raw)       # a full shard, or None
        ...
    last = cutter.end()
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

#: Bytes of a shard message beside its lines (ids, field names, commas).
OVERHEAD = 512


@dataclass(slots=True)
class Cut:
    number: int
    first: int
    lines: list[bytes] = field(default_factory=list)


class Cutter:
    """Feed request lines one at a time; full shards come out. A single line larger than
    ``max_bytes`` still gets a shard of its own (the upload's line limit keeps it under the
    broker's max_payload)."""

    def __init__(self, *, max_lines: int, max_bytes: int) -> None:
        self.max_lines = max_lines
        self.max_bytes = max_bytes
        self._shard = Cut(0, 0)
        self._size = OVERHEAD
        self.lines = 0  # request lines seen

    def add(self, raw: bytes) -> Cut | None:
        raw = raw.strip()
        if not raw:
            return None
        out = None
        shard = self._shard
        if shard.lines and (len(shard.lines) >= self.max_lines or self._size + len(raw) + 1 > self.max_bytes):
            out = shard
            self._shard = shard = Cut(shard.number + 1, self.lines)
            self._size = OVERHEAD
        shard.lines.append(raw)
        self._size += len(raw) + 1
        self.lines += 1
        return out

    def end(self) -> Cut | None:
        return self._shard if self._shard.lines else None


def cut(lines: Iterable[bytes], *, max_lines: int, max_bytes: int) -> Iterator[Cut]:
    """Every shard of ``lines`` (raw request lines, blank ones skipped)."""
    cutter = Cutter(max_lines=max_lines, max_bytes=max_bytes)
    for raw in lines:
        full = cutter.add(raw)
        if full is not None:
            yield full
    last = cutter.end()
    if last is not None:
        yield last


def split_lines(data: bytes, carry: bytes = b"") -> tuple[list[bytes], bytes]:
    """Complete lines of ``carry + data`` and the unfinished rest (for reading a file in chunks)."""
    data = carry + data
    end = data.rfind(b"\n")
    if end < 0:
        return [], data
    return data[:end].split(b"\n"), data[end + 1:]
