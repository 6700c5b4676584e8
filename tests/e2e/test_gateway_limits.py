"""Per-key limits at the gateway: x-ratelimit-* headers, 429 RATE_LIMITED, and the SDK following them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import MODEL, Stack
from zmlcore.runtime.launch import free_port, service_argv, spawn, wait_port


@pytest.fixture(scope="module")
def limited(zml_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A second gateway on the same system, with keys and a limit of 120/min, burst 3."""
    base = Path(zml_stack.config_path).read_text()
    cfg = tmp_path_factory.mktemp("limits") / "zml.toml"
    cfg.write_text('[gateway]\napi_keys = ["k-one", "k-two", "k-three"]\nrequests_per_minute = 120\nrequest_burst = 3\n' + base)
    port = free_port()
    proc = spawn("gateway-limited", service_argv("gateway", str(cfg), zml_stack.nats_url, "--port", str(port)))
    try:
        assert wait_port("127.0.0.1", port, 20), proc.tail()
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}


def test_keys_limits_and_headers(limited: str) -> None:
    with httpx.Client(base_url=limited, timeout=20) as c:
        assert c.post("/v1/chat/completions", json=BODY).json()["error"]["code"] == "AUTH_FAILED"
        auth = {"authorization": "Bearer k-one"}
        remaining = []
        for _ in range(3):
            r = c.post("/v1/chat/completions", json=BODY, headers=auth)
            assert r.status_code == 200, r.text
            assert r.headers["x-ratelimit-limit-requests"] == "120"
            remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
        assert remaining == [2, 1, 0]
        r = c.post("/v1/chat/completions", json=BODY, headers=auth)
        assert r.status_code == 429 and r.json()["error"]["code"] == "RATE_LIMITED"
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-ratelimit-remaining-requests"] == "0"
        # Another key has its own bucket.
        assert c.post("/v1/chat/completions", json=BODY, headers={"authorization": "Bearer k-two"}).status_code == 200
        time.sleep(0.6)  # 2 requests/s refill
        assert c.post("/v1/chat/completions", json=BODY, headers=auth).status_code == 200


def test_sdk_retries_a_rate_limit_and_succeeds(limited: str) -> None:
    import zml

    with zml.Client(endpoint=limited, api_key="k-two", max_retries=3) as client:
        results = [client.infer(MODEL, prompt="x", max_tokens=1) for _ in range(5)]
    assert all(r.text for r in results)
    assert sum(r.metrics.retries for r in results) >= 1  # at 5 requests against a burst of 3


def test_without_keys_the_limit_is_per_client_address(zml_stack: Stack, tmp_path: Path) -> None:
    """Rotating the Authorization header gave a fresh bucket each time (issue 9)."""
    cfg = tmp_path / "zml.toml"
    cfg.write_text("[gateway]\nrequests_per_minute = 60\nrequest_burst = 2\n" + Path(zml_stack.config_path).read_text())
    port = free_port()
    proc = spawn("gateway-anon", service_argv("gateway", str(cfg), zml_stack.nats_url, "--port", str(port)))
    try:
        assert wait_port("127.0.0.1", port, 20), proc.tail()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=20) as c:
            codes = [c.post("/v1/chat/completions", json=BODY, headers={"authorization": f"Bearer rotated-{i}"}).status_code
                     for i in range(4)]
        assert codes[:2] == [200, 200] and 429 in codes[2:], codes
    finally:
        proc.stop()


def test_rate_limit_rejections_are_counted_by_key_label(limited: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from zmlcore.access.apikeys import hash_key

    label = f"static-{hash_key('k-three')[:12]}"  # a static key's id (run-time keys: their label)
    with httpx.Client(base_url=limited, timeout=20) as c:
        codes = [c.post("/v1/chat/completions", json=BODY, headers={"authorization": "Bearer k-three"}).status_code
                 for _ in range(8)]  # a burst of 3: some are refused
        text = c.get("/metrics").text
    refused = codes.count(429)
    assert refused >= 1, codes
    counted = sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                  if s.name == "zml_gateway_rate_limited_total" and s.labels.get("key") == label)
    assert counted == refused
    assert "k-three" not in text  # the label, never the key


def _limited_by_address(stack: Stack, tmp_path: Path, extra: str) -> list[tuple[str, object]]:
    """Gateways limited to 1 request per client address, each with its own [gateway] extra."""
    base = Path(stack.config_path).read_text()
    procs = []
    for i, more in enumerate(("", extra)):
        cfg = tmp_path / f"zml{i}.toml"
        cfg.write_text(f"[gateway]\nrequests_per_minute = 1\nrequest_burst = 1\n{more}\n" + base)
        port = free_port()
        procs.append((f"http://127.0.0.1:{port}",
                      spawn(f"gateway-xff{i}", service_argv("gateway", str(cfg), stack.nats_url, "--port", str(port)))))
    return procs


@pytest.mark.parametrize("proxies, honoured", [('["127.0.0.0/8"]', True), ('["192.0.2.7"]', False)])
def test_x_forwarded_for_is_believed_only_from_configured_proxies(zml_stack: Stack, tmp_path: Path,
                                                                  proxies: str, honoured: bool) -> None:
    """uvicorn trusted X-Forwarded-For from 127.0.0.1 by default: a local client chose the
    address the per-address limit counted. Now only [gateway] trusted_proxies are believed."""
    gateways = _limited_by_address(zml_stack, tmp_path, f"trusted_proxies = {proxies}")
    try:
        codes = []
        for url, proc in gateways:
            assert wait_port("127.0.0.1", int(url.rsplit(":", 1)[1]), 20), proc.tail()  # type: ignore[attr-defined]
            with httpx.Client(base_url=url, timeout=20) as c:
                codes.append([c.post("/v1/chat/completions", json=BODY,
                                     headers={"x-forwarded-for": f"198.51.100.{i}"}).status_code for i in range(3)])
        assert codes[0] == [200, 429, 429], codes  # default: the TCP peer is the client
        assert codes[1] == ([200, 200, 200] if honoured else [200, 429, 429]), codes
    finally:
        for _, proc in gateways:
            proc.stop()  # type: ignore[attr-defined]
