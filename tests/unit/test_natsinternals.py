"""zmlcore.bus.natsinternals: the one place ZML touches nats-py's privates. It looks at nats-py's
classes once, at start-up: a required piece missing is one clear ConfigError naming the nats-py
version and the piece (before connecting, not in a follower's loop); a fast path's piece
missing switches that path to nats-py's public one, logged once. No server needed."""

from __future__ import annotations

import logging
import subprocess
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

from zmlcore.bus import natsinternals
from zmlcore.bus.kvfollow import KVFollower
from zmlcore.bus.natsinternals import Piece
from zmlcore.bus.publish import Publisher
from zmlcore.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


class OldWatcher:
    """A KV watcher as a nats-py that no longer keeps its subscription in ``_sub`` would have it."""

    def __init__(self, js: Any) -> None:
        self._js = js
        self._subscription = None


class ClientWithoutFlusher:
    """A client as a nats-py that lost ``_flush_pending`` and ``_flush_queue`` would have it."""

    def __init__(self) -> None:
        self._pending: list[bytes] = []


def test_the_installed_nats_py_has_everything() -> None:
    s = natsinternals.check(natsinternals.probe())
    assert s.fast_publish and s.direct_delivery and s.pong_guard and s.required_missing == ()
    assert s.version == natsinternals.version()


def test_without_the_pong_pieces_the_guard_is_off_and_said(caplog: pytest.LogCaptureFixture) -> None:
    found = natsinternals.probe(pongs=(Piece(ClientWithoutFlusher, "_pongs"),), nats_version="9.1.0")
    assert not found.pong_guard and found.required_missing == ()
    assert "nats-py 9.1.0 lacks ClientWithoutFlusher._pongs" in caplog.text


def test_a_missing_required_piece_is_one_clear_start_up_error() -> None:
    found = natsinternals.probe(required=(Piece(OldWatcher, "_sub"), Piece(OldWatcher, "_js")), nats_version="9.1.0")
    assert found.required_missing == (Piece(OldWatcher, "_sub"),)
    with pytest.raises(ConfigError) as info:
        natsinternals.check(found)
    message = str(info.value)
    assert "nats-py 9.1.0 lacks OldWatcher._sub" in message
    assert "ZML relies on" in message and natsinternals.REQUIREMENT in message


def test_an_older_nats_py_without_its_header_error_is_refused() -> None:
    """nats-py < 2.16 has no BadHeaderError (nor subject and header validation): the encoder
    raises it, so such a nats-py is named at start-up, not met at the first bad header."""
    old_errors = types.ModuleType("nats.errors")
    found = natsinternals.probe(required=(Piece(old_errors, "BadHeaderError", "name"),), nats_version="2.15.0")
    with pytest.raises(ConfigError, match=r"nats-py 2\.15\.0 lacks nats\.errors\.BadHeaderError"):
        natsinternals.check(found)


def test_a_missing_fast_path_piece_falls_back_and_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    pieces = (*natsinternals._pieces(ClientWithoutFlusher, ("_pending", "_flush_queue"), ("_flush_pending",)),)
    with caplog.at_level(logging.WARNING, logger="zml.natsinternals"):
        found = natsinternals.probe(publish=pieces, nats_version="9.1.0")
    assert not found.fast_publish and found.direct_delivery
    natsinternals.check(found)  # not required: no error
    [record] = caplog.records
    assert "nats-py 9.1.0 lacks" in record.getMessage() and "nc.publish" in record.getMessage()
    assert "ClientWithoutFlusher._flush_queue" in record.getMessage()
    assert "ClientWithoutFlusher._flush_pending()" in record.getMessage()
    assert "ClientWithoutFlusher._pending," not in record.getMessage()  # stored by its __init__


def test_a_subclass_finds_what_its_base_stores() -> None:
    class Sub(Client):
        def __init__(self) -> None:
            super().__init__()

    assert natsinternals.missing(natsinternals._pieces(Sub, ("_pending", "_transport"), ("_flush_pending",))) == []


def test_the_fence_decides_for_publisher_and_follower(monkeypatch: pytest.MonkeyPatch) -> None:
    """Users of the fence take its decision: the publisher's fast path, and a follower refuses to
    be built (at start-up) rather than failing in its loop."""
    lacking = natsinternals.probe(required=(Piece(OldWatcher, "_sub"),))._replace(fast_publish=False)
    monkeypatch.setattr(natsinternals, "support", lambda: lacking)
    assert not Publisher(Client()).fast
    with pytest.raises(ConfigError, match="lacks OldWatcher._sub"):
        KVFollower(Client(), "bucket", on_put=lambda k, v: None, on_delete=lambda k: None)


def test_a_service_with_such_a_nats_py_stops_at_start_up_with_one_line() -> None:
    """The real start-up path (`zml router`), with nats-py's KeyWatcher patched to no longer keep
    ``_sub``: exit 2 and one line naming the version and the piece, before any connection (the
    NATS URL points nowhere)."""
    code = (
        "import sys, nats.js.kv as kv\n"
        "def init(self, js):\n"
        "    self._js = js\n"
        "kv.KeyValue.KeyWatcher.__init__ = init\n"
        "from zml_router.__main__ import main\n"
        "sys.exit(main(['--nats-url', 'nats://127.0.0.1:1']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("zml router:")]
    assert len(lines) == 1, proc.stderr
    assert f"nats-py {natsinternals.version()} lacks KeyValue.KeyWatcher._sub" in lines[0]
    assert "Traceback" not in proc.stderr


def test_pyproject_allows_what_the_fence_was_verified_with() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert natsinternals.REQUIREMENT in deps
    floor, newest = natsinternals.VERIFIED
    assert f">={floor.removesuffix('.0')}," in natsinternals.REQUIREMENT
    major, minor, _ = newest.split(".")
    assert natsinternals.REQUIREMENT.endswith(f",<{major}.{int(minor) + 1}")


HEADER_BLOCKS = [
    b"Zml-Request-Id: 3f2a9c0d11aa22bb\r\nZml-Timeout-Ms: 30000\r\nZml-Body: clean\r\n"
    b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n",
    b"a b: c\r\n", b"a\x1cb: c\r\n", b"\x1ck\x1f: v\x1f\r\n", b": x\r\n", b" k : v\r\n", b"\xff: v\r\n",
    b"k: \xff\r\n", b"nocolon\r\n", b"k: v\r\nk: w\r\n", b"k:v\r\n", b"k: \r\n", b"k: a b\r\n", b"k: v\x85\r\n",
    b"k\x0b: v\x0c\r\n", b"a\rb: c\r\n", b"a: b\nc: d\r\n", b"k:\tv\r\n", b"", b"\r\n\r\n", b"k: a:b: c\r\n",
    "n\u00e9: v\u00e9\r\n".encode(),
]


@pytest.mark.parametrize("raw", HEADER_BLOCKS)
def test_header_blocks_parse_as_nats_py_parses_them(raw: bytes) -> None:
    assert natsinternals.parse_header_lines(raw) == Client._parse_header_lines(raw)


def test_random_header_blocks_parse_as_nats_py_parses_them() -> None:
    import random
    rng = random.Random(29)
    alphabet = b"ab:: \t\r\n\x0b\x0c\x1c\x1f\x7f\x80\xc3\xa9Z-1"
    for _ in range(5000):
        raw = bytes(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert natsinternals.parse_header_lines(raw) == Client._parse_header_lines(raw), raw


def test_a_client_gets_the_fast_header_parser() -> None:
    nc = Client()
    natsinternals.fast_headers(nc)
    assert nc._parse_header_lines is natsinternals.parse_header_lines
    assert Client._parse_header_lines is not natsinternals.parse_header_lines  # the class is left alone
