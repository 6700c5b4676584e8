"""zmlcore.bus.publish's encoder against nats-py's own (no server): the same bytes for the same
subject, reply, headers and payload, and the same refusals (no protocol injection through a
subject, a reply or a header). Pins the nats-py behaviour the module copies: if a nats-py
release changes its wire form or its rules, these fail before the services drift from it."""

from __future__ import annotations

import asyncio

import pytest
from nats import errors
from nats.aio.client import Client, _validate_subject

from zmlcore.bus import natsinternals, publish


async def nats_py_bytes(subject: str, reply: str, payload: bytes, headers: dict[str, str] | None) -> bytes:
    """What nats-py 2.x appends to its pending buffer for this publish (no connection needed:
    with no flush queue it only encodes and appends)."""
    c = Client()
    await c._send_publish(subject, reply, payload, len(payload), headers)
    assert len(c._pending) == 1
    return bytes(c._pending[0])


CASES = [
    ("zml.infer", "", b"", None),
    ("zml.infer", "_INBOX.abc.1", b'{"model":"m"}', None),
    ("_INBOX.x.y", "", b"data: {}\n\n", {"Zml-Stream": "events", "Zml-Seq": "7"}),
    ("zml.infer", "_INBOX.a", b"body", {"Zml-Request-Id": "r1", "Zml-Timeout-Ms": "30000", "traceparent": "00-ab"}),
    ("s", "", b"x" * 70_000, {"K": "v"}),
    ("s", "r", b"", {}),  # an empty dict: an empty header block, as nats-py sends it
    ("s", "", b"p", {" Padded ": "  spaced value  ", "K\n": "v"}),  # stripped, as nats-py strips
    ("s", "", b"p", {"": "skipped", "   ": "also", "A": "b"}),  # blank keys skipped
    ("s", "", b"p", {"A": "line1\r\nINJECT\r\n", "B": "x\ny\rz"}),  # CR/LF become spaces
    ("s", "", b"p", {"A": "ok", "B": "lone\rcr", "C": "ok", "D": "lone\nlf"}),  # one stray byte each: found
    ("sübject.ü", "", "päyload".encode(), {"Unicode-Value": "é ✓"}),
]


@pytest.mark.parametrize(("subject", "reply", "payload", "headers"), CASES)
async def test_bytes_equal_nats_py(subject: str, reply: str, payload: bytes, headers: dict[str, str] | None) -> None:
    want = await nats_py_bytes(subject, reply, payload, headers)
    assert publish.encode(subject, reply, payload, headers) == want
    # twice: the second time from the key cache
    assert publish.encode(subject, reply, payload, headers) == want


@pytest.mark.parametrize("bad", ["a b", "a\tb", "a\r\nPUB x 1\r\n", "a\nb", "a\rb", ""])
def test_bad_subject_or_reply_refused_like_nats_py(bad: str) -> None:
    with pytest.raises(errors.BadSubjectError):
        _validate_subject(bad)
    with pytest.raises(errors.BadSubjectError):
        publish.encode(bad, "", b"", None)
    if bad:
        with pytest.raises(errors.BadSubjectError):
            publish.encode("ok", bad, b"", {"A": "b"})


@pytest.mark.parametrize("key", ["Bad Key", "K\r\nPUB x 1", "K:", "Kéy", "\x00K"])
async def test_bad_header_key_refused_like_nats_py(key: str) -> None:
    with pytest.raises(errors.BadHeaderError):
        await nats_py_bytes("s", "", b"", {key: "v"})
    with pytest.raises(errors.BadHeaderError):
        publish.encode("s", "", b"", {key: "v"})
    with pytest.raises(errors.BadHeaderError):  # not cached as good after the first refusal
        publish.encode("s", "", b"", {key: "v"})


def test_value_cannot_end_the_header_line() -> None:
    cmd = publish.encode("s", "", b"p", {"A": "x\r\nB: injected\r\n\r\nPUB evil 0"})
    head, _, rest = cmd.partition(b"\r\n")
    hdr = rest[: int(head.split()[-2])]
    assert hdr == b"NATS/1.0\r\nA: x  B: injected    PUB evil 0\r\n\r\n"


def test_key_cache_is_bounded() -> None:
    for i in range(publish.MAX_CACHED_KEYS + 50):
        publish.encode("s", "", b"", {f"X-Many-{i}": "v"})
    assert len(publish._keys) <= publish.MAX_CACHED_KEYS


def test_publisher_takes_the_fast_path_only_where_the_fence_says(monkeypatch: pytest.MonkeyPatch) -> None:
    c = Client()
    assert publish.Publisher(c).fast  # the installed nats-py has what the fast path needs
    assert publish.Publisher.of(c) is publish.Publisher.of(c)  # one per client: one flush per iteration
    # A nats-py without it (zmlcore.bus.natsinternals decides, once): nc.publish for everything.
    lacking = natsinternals.probe()._replace(fast_publish=False)
    monkeypatch.setattr(natsinternals, "support", lambda: lacking)
    assert not publish.Publisher(c).fast


async def test_not_connected_is_nats_py_error() -> None:
    """A client that never connected: nats-py's own path and error (no bytes appended by us)."""
    c = Client()
    with pytest.raises(errors.OutboundBufferLimitError):
        await publish.Publisher(c).publish("s", b"x")
    assert c._pending == []
    await asyncio.sleep(0)
