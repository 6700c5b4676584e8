"""A connection the broker refuses fails at once with one line saying what to set: no retry
loop, no traceback. Real nats-servers: one with authorization, one with mutual TLS.

nats-py retries an "Authorization Violation" or a TLS failure like an unreachable server,
forever with reconnects on (the services' setting): `zml nodes add` without ZML_NATS_NKEY hung
until Ctrl-C. Here the connection helper (services, commands), the SDK over nats:// and a
service process each meet every refusal and must say why within 2 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import zml
from conftest import FLEET, SecureBus, fleet_toml, start_secure_bus
from pki import Pki
from zml.cli import _identities
from zmlcore.access.identity import connect_options
from zmlcore.bus.connect import connect
from zmlcore.config import NatsConfig
from zmlcore.errors import AuthError, ConfigError, ConnectionError, ZMLError
from zmlcore.runtime.launch import free_port

LIMIT_S = 2.0


async def _refused(url: str, cfg: NatsConfig, seed: str | None, **kw: object) -> tuple[ZMLError, float]:
    t0 = time.monotonic()
    with pytest.raises(ZMLError) as info:
        # give_up_s far above the limit: a refusal must not wait for it (services pass none)
        nc = await connect(url, "refusal-test", give_up_s=30, **connect_options(cfg, seed_file=seed), **kw)  # type: ignore[arg-type]
        await nc.close()
    return info.value, time.monotonic() - t0


async def test_no_identity(secure_bus: SecureBus) -> None:
    err, took = await _refused(secure_bus.url, NatsConfig(), None)
    assert isinstance(err, AuthError) and took < LIMIT_S, (err, took)
    assert "requires an identity" in err.message and "ZML_NATS_NKEY" in err.message


async def test_identity_of_another_server_or_revoked(secure_bus: SecureBus, tmp_path: Path) -> None:
    other = _identities.issue(tmp_path / "elsewhere", "stranger")
    err, took = await _refused(secure_bus.url, NatsConfig(), other.seed_file)
    assert isinstance(err, AuthError) and took < LIMIT_S, (err, took)
    assert other.public_key in err.message and other.seed_file in err.message

    seed = secure_bus.issue("soon-gone")
    gone_key = _identities.get(secure_bus.data_dir, "soon-gone").public_key  # type: ignore[union-attr]
    kept = tmp_path / "kept.nk"
    kept.write_bytes(Path(seed).read_bytes())
    _identities.revoke(secure_bus.data_dir, "soon-gone")
    assert _identities.reload_server(secure_bus.data_dir).confirmed  # type: ignore[union-attr]
    err, took = await _refused(secure_bus.url, NatsConfig(), str(kept))
    assert isinstance(err, AuthError) and gone_key in err.message and took < LIMIT_S


@pytest.mark.parametrize(("case", "want"), [
    ("CA of another server", "ZML_NATS_TLS_CA"),
    ("no CA (system roots)", "ZML_NATS_TLS_CA"),
    ("no client certificate", "ZML_NATS_TLS_CERT"),
    ("client certificate from another CA", "refused the client certificate"),
])
async def test_tls_mistakes(tls_bus: SecureBus, pki: Pki, case: str, want: str) -> None:
    cfg = {
        "CA of another server": NatsConfig(tls_ca_file=str(Path(pki.ca).with_name("rogue-ca.pem")), tls_cert_file=pki.client_cert,
                                           tls_key_file=pki.client_key),
        "no CA (system roots)": NatsConfig(),  # the server requires TLS: nats-py upgrades with system roots
        "no client certificate": NatsConfig(tls_ca_file=pki.ca),
        "client certificate from another CA": NatsConfig(tls_ca_file=pki.ca, tls_cert_file=pki.rogue_cert,
                                                         tls_key_file=pki.rogue_key),
    }[case]
    err, took = await _refused(tls_bus.url, cfg, tls_bus.seeds["admin"])
    assert isinstance(err, ConfigError) and took < LIMIT_S, (err, took)
    assert want in err.message and "\n" not in err.message, err.message


@pytest.mark.parametrize("how", ["a CA", "a tls:// URL"])
async def test_tls_configured_and_a_server_without_tls(secure_bus: SecureBus, pki: Pki, how: str) -> None:
    """nats-py upgrades only when the server requires TLS: configured for TLS against a server
    without it, it went on in plaintext without a word. Refused before CONNECT, in one line."""
    url = secure_bus.url if how == "a CA" else secure_bus.url.replace("nats://", "tls://")
    cfg = NatsConfig(tls_ca_file=pki.ca) if how == "a CA" else NatsConfig(url=url)
    err, took = await _refused(url, cfg, secure_bus.seeds["admin"])
    assert isinstance(err, ConfigError) and took < LIMIT_S, (err, took)
    assert "offers no TLS" in err.message and "plaintext" in err.message and "\n" not in err.message, err.message


async def test_nothing_is_sent_in_plaintext_to_a_server_without_tls(pki: Pki) -> None:
    """The CONNECT (the identity's signature, a token or a password) never leaves in the clear:
    a server that offers no TLS gets nothing back after its INFO."""
    received = bytearray()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b'INFO {"server_id":"PLAIN","version":"2.10.0","proto":1,"max_payload":1048576,'
                     b'"headers":true,"auth_required":true,"nonce":"abc"}\r\n')
        await writer.drain()
        with contextlib.suppress(Exception):
            while chunk := await reader.read(4096):
                received.extend(chunk)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        err, took = await _refused(f"nats://127.0.0.1:{port}", NatsConfig(tls_ca_file=pki.ca), None)
    finally:
        server.close()
    assert isinstance(err, ConfigError) and "offers no TLS" in err.message and took < LIMIT_S, (err, took)
    assert b"CONNECT" not in received and b"PUB" not in received, bytes(received)


async def test_good_tls_and_identity_connect(tls_bus: SecureBus, pki: Pki) -> None:
    cfg = NatsConfig(tls_ca_file=pki.ca, tls_cert_file=pki.client_cert, tls_key_file=pki.client_key)
    nc = await connect(tls_bus.url, "refusal-test", give_up_s=5, **connect_options(cfg, seed_file=tls_bus.seeds["admin"]))
    await nc.close()


async def test_unreachable_gives_up_when_asked() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(ConnectionError) as info:
        await connect(url, "refusal-test", give_up_s=1.0)
    assert 0.9 < time.monotonic() - t0 < LIMIT_S and url in info.value.message


def test_sdk_over_nats_says_what_to_set(secure_bus: SecureBus, tls_bus: SecureBus, pki: Pki,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("ZML_NATS_NKEY", "ZML_NATS_TLS_CA", "ZML_NATS_TLS_CERT", "ZML_NATS_TLS_KEY", "ZML_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    cases = [(secure_bus.url, {}, zml.AuthError, "ZML_NATS_NKEY"),
             (tls_bus.url, {"ZML_NATS_NKEY": tls_bus.seeds["admin"], "ZML_NATS_TLS_CA": pki.rogue_cert},
              zml.ConfigError, "ZML_NATS_TLS_CA"),
             (tls_bus.url, {"ZML_NATS_NKEY": tls_bus.seeds["admin"], "ZML_NATS_TLS_CA": pki.ca},
              zml.ConfigError, "ZML_NATS_TLS_CERT"),
             (secure_bus.url, {"ZML_NATS_NKEY": secure_bus.seeds["admin"], "ZML_NATS_TLS_CA": pki.ca},
              zml.ConfigError, "offers no TLS")]
    for url, env, cls, want in cases:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            t0 = time.monotonic()
            with zml.Client(url, max_retries=3) as client, pytest.raises(cls) as info:
                client.infer("m", "hi", max_tokens=1)
            assert time.monotonic() - t0 < LIMIT_S and want in info.value.message, info.value


@pytest.mark.parametrize("service", ["router", "gateway"])
def test_a_service_without_its_identity_exits_with_one_line(secure_bus: SecureBus, tmp_path: Path, service: str) -> None:
    config = tmp_path / "zml.toml"
    config.write_text(fleet_toml({n: free_port() for n, _, _ in FLEET}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    argv = [sys.executable, "-m", "zml.cli", service, "--config", str(config), "--nats-url", secure_bus.url]
    if service == "gateway":
        argv += ["--port", str(free_port()), "--grpc-port", "0"]
    t0 = time.monotonic()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    took = time.monotonic() - t0
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stderr and "Authorization Violation" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"creds/{service}.nk" in lines[0] and "ZML_NATS_NKEY" in lines[0], lines
    assert took < 10, took  # interpreter start-up included; the refusal itself takes milliseconds


def test_a_service_configured_for_tls_meeting_a_server_without_it_exits_with_one_line(
        secure_bus: SecureBus, pki: Pki, tmp_path: Path) -> None:
    config = tmp_path / "zml.toml"
    config.write_text(fleet_toml({n: free_port() for n, _, _ in FLEET}))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ZML_")},
           "ZML_NATS_NKEY": secure_bus.seeds["router"], "ZML_NATS_TLS_CA": pki.ca}
    out = subprocess.run([sys.executable, "-m", "zml.cli", "router", "--config", str(config), "--nats-url",
                          secure_bus.url], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "offers no TLS" in lines[0] and "Traceback" not in out.stderr, lines
