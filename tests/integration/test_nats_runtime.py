"""The embedded nats-server gets its Go runtime settings ([nats] server_gomaxprocs) in its own
environment, and the server applies them (its /varz says so)."""

from __future__ import annotations

import json
import tempfile
import time
import urllib.request
from pathlib import Path

from zmlcore.runtime.launch import free_port, start_nats
from zmlcore.runtime.sizing import nats_env


def _varz(port: int) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=2) as r:
                return dict(json.load(r))
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_start_nats_passes_gomaxprocs_to_the_server_only() -> None:
    env = nats_env(8, 1)
    assert env == {"GOMAXPROCS": "1"}
    with tempfile.TemporaryDirectory(prefix="zml-nats-env-") as store:
        port, monitor = free_port(), free_port()
        proc = start_nats("127.0.0.1", port, store, monitor_port=monitor, env=env)
        try:
            assert b"GOMAXPROCS=1" in Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            varz = _varz(monitor)
            assert varz["gomaxprocs"] == 1, varz
        finally:
            proc.stop()
