"""A gateway with no router behind it (e.g. while routers re-subscribe after a broker restart)
answers a clean, retryable 503 NO_HEALTHY_NODES with a JSON body — streamed or not.

Regression: the broker's "no responders" status reached the streaming path as a reply without
a stream header, and the gateway relayed it as HTTP 500 with an empty body (seen by the chaos
suite during broker restarts)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import MODEL, fleet_toml
from zmlcore.launch import Proc, free_port, service_argv, spawn, wait_port


@pytest.fixture(scope="module")
def lone_gateway(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp: Path = tmp_path_factory.mktemp("lone")
    config = tmp / "zml.toml"
    config.write_text(fleet_toml({"h100-1": free_port()}, fleet=[("h100-1", "nvidia_h100", [MODEL])]))
    port = free_port()
    proc: Proc = spawn("gateway", service_argv("gateway", str(config), own_nats, "--port", str(port)))
    try:
        assert wait_port("127.0.0.1", port, 30), proc.tail()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()
        assert proc.tracebacks == 0, proc.tail()


@pytest.mark.parametrize("stream", [False, True])
def test_no_router_is_a_clean_503(lone_gateway: str, stream: bool) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    r = httpx.post(lone_gateway + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 503, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["code"] == "NO_HEALTHY_NODES" and "no router" in err["message"]
    assert r.headers.get("retry-after") == "1"
