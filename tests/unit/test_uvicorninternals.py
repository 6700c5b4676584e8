"""zml_gateway.uvicorninternals: what the gateway takes from uvicorn beyond its documented API,
checked when the gateway is built. A missing piece is one ConfigError naming the uvicorn version
and the piece; uvicorn's signal handlers stay out of a serving gateway (the runner owns
SIGTERM/SIGINT)."""

from __future__ import annotations

import asyncio
import logging
import signal
import tomllib
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from zml_gateway import uvicorninternals
from zml_gateway.uvicorninternals import GatewayServer
from zmlcore.errors import ConfigError
from zmlcore.runtime.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


class OldProtocol:
    """A protocol as a uvicorn without the ``on_url`` callback, whose cycle lives elsewhere."""

    def __init__(self) -> None:
        self.connections: set[Any] = set()

    def on_header(self, name: bytes, value: bytes) -> None:
        pass

    def on_headers_complete(self) -> None:
        self.current = None


def test_the_installed_uvicorn_has_everything() -> None:
    assert uvicorninternals.missing() == []
    assert uvicorninternals.serve_captures_signals()
    uvicorninternals.check()


def test_a_missing_piece_is_one_clear_start_up_error() -> None:
    found = uvicorninternals.missing(
        hooks=((OldProtocol, "on_url"), (OldProtocol, "on_header")),
        state=((OldProtocol, "__init__", ("connections",)), (OldProtocol, "on_headers_complete", ("cycle",))))
    assert found == ["OldProtocol.on_url()", "OldProtocol.cycle (set in on_headers_complete)"]
    with pytest.raises(ConfigError) as info:
        uvicorninternals.check(found, uvicorn_version="0.99.0")
    message = str(info.value)
    assert "uvicorn 0.99.0 lacks OldProtocol.on_url(), OldProtocol.cycle (set in on_headers_complete)" in message
    assert uvicorninternals.REQUIREMENT in message


def test_a_serve_without_capture_signals_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    class OtherServer(uvicorn.Server):
        async def serve(self, sockets: Any = None) -> None:  # handlers installed some other way
            signal.signal(signal.SIGTERM, self.handle_exit)

    assert not uvicorninternals.serve_captures_signals(OtherServer)
    with caplog.at_level(logging.WARNING, logger="zml.gateway"):
        uvicorninternals.check([], signals=False, uvicorn_version="0.99.0")
    [record] = caplog.records
    assert "uvicorn 0.99.0" in record.getMessage() and "SIGTERM/SIGINT" in record.getMessage()


async def test_a_serving_gateway_leaves_sigterm_and_sigint_to_the_runner() -> None:
    """While uvicorn serves (in the main thread, where it would install handlers), SIGTERM and
    SIGINT keep the handlers the runner installed; uvicorn's handle_exit is not one of them."""
    loop = asyncio.get_running_loop()
    flagged: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, flagged.append, sig)  # as zmlcore.runtime.runner does
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}

    async def app(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never called
        pass

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), loop="none", lifespan="off", log_level="warning")
    server = GatewayServer(config)
    serving = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not serving.done(), serving.result()
            await asyncio.sleep(0.01)
        during = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        assert during == before, during
        assert server.handle_exit not in during.values()
        signal.raise_signal(signal.SIGTERM)  # reaches the runner's handler, not uvicorn's
        for _ in range(100):
            if flagged:
                break
            await asyncio.sleep(0.01)
        assert flagged == [signal.SIGTERM]
        assert not server.should_exit  # uvicorn stops when the runner says so, not by itself
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def test_pyproject_allows_what_the_gateway_was_verified_with() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert uvicorninternals.REQUIREMENT in deps
    floor, newest = uvicorninternals.VERIFIED
    assert f">={floor.removesuffix('.0')}," in uvicorninternals.REQUIREMENT
    major, minor, _ = newest.split(".")
    assert uvicorninternals.REQUIREMENT.endswith(f",<{major}.{int(minor) + 1}")
