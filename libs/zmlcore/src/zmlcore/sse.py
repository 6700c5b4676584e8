"""Server-sent events: lines end at CR, LF or CRLF, and nowhere else.

Generic line splitters (``str.splitlines``, and httpx's ``iter_lines`` built on it) also end
a line at U+2028, U+2029, U+0085, VT, FF and the ASCII separators. JSON allows those raw inside
strings, and real vocabularies have tokens made of them (llama's has U+2028), so an SSE reader
that uses such a splitter cuts ``data: {"choices":[{"delta":{"content":"\u2028`` in two.
Every SSE reader of ZML (router, SDK) splits with :class:`SSELineSplitter` instead.

Example::

    split = SSELineSplitter()
    split.feed(b'data: {"a": "x\\xe2\\x80\\xa8y"}\\r')   # -> [b'data: {"a": "x\\xe2\\x80\\xa8y"}']
    split.feed(b'\\ndata: [DONE]\\n\\n')               # -> [b'data: [DONE]', b'']
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

#: A line longer than this (no CR/LF within it) is an error, not a reason to buffer forever.
MAX_LINE_BYTES = 16 * 1024 * 1024


class SSELineTooLong(ValueError):
    """The stream sent more than ``max_line`` bytes without a line end."""


class SSELineSplitter:
    """Bytes in, complete lines out (without their line end), split only at CR, LF and CRLF
    (the SSE spec's ``end-of-line``). A CRLF split across two chunks counts once."""

    __slots__ = ("_buf", "_skip_lf", "max_line")

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buf = b""
        self._skip_lf = False  # the last chunk ended with CR: a leading LF belongs to it
        self.max_line = max_line

    def feed(self, data: bytes) -> list[bytes]:
        if not data:
            return []
        if self._skip_lf:
            self._skip_lf = False
            if data[:1] == b"\n":
                data = data[1:]
        buf = self._buf + data if self._buf else data
        if b"\r" in buf:
            self._skip_lf = buf.endswith(b"\r")
            buf = buf.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, rest = buf.split(b"\n")
        if len(rest) > self.max_line:
            raise SSELineTooLong(f"SSE line longer than {self.max_line} bytes")
        self._buf = rest
        return lines

    def flush(self) -> list[bytes]:
        """The unterminated last line, if any (at the end of the stream)."""
        rest, self._buf = self._buf, b""
        self._skip_lf = False
        return [rest] if rest else []


def iter_sse_lines(chunks: Iterable[bytes], max_line: int = MAX_LINE_BYTES) -> Iterator[bytes]:
    """Every line of a byte stream (e.g. ``httpx.Response.iter_bytes()``)."""
    split = SSELineSplitter(max_line)
    for chunk in chunks:
        yield from split.feed(chunk)
    yield from split.flush()


async def aiter_sse_lines(chunks: AsyncIterable[bytes], max_line: int = MAX_LINE_BYTES) -> AsyncIterator[bytes]:
    """Every line of an async byte stream (e.g. ``httpx.Response.aiter_bytes()``)."""
    split = SSELineSplitter(max_line)
    async for chunk in chunks:
        for line in split.feed(chunk):
            yield line
    for line in split.flush():
        yield line


def data_field(line: bytes) -> bytes | None:
    """The value of a ``data:`` line (one leading space removed), None for other lines."""
    if not line.startswith(b"data:"):
        return None
    value = line[5:]
    return value[1:] if value[:1] == b" " else value
