"""TLS is a configuration switch: NATS with mutual TLS (and identities) and an HTTPS gateway,
with a CA and certificates this test makes itself (the ``cryptography`` package).

The whole stack runs over it: health, router and gateway verify the server and present client
certificates (ZML_NATS_TLS_CA/CERT/KEY), the gateway serves HTTPS (ZML_GATEWAY_TLS_CERT/KEY);
a client without a certificate, with one from another CA, or without TLS is refused.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import pytest

from conftest import MODEL, SecureBus, Stack, launch_stack, start_secure_bus
from pki import Pki
from zmlcore.config import NatsConfig
from zmlcore.access.identity import connect_options


@pytest.fixture(scope="module")
def tls_stack(tls_bus: SecureBus, pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"ZML_NATS_TLS_CA": pki.ca, "ZML_NATS_TLS_CERT": pki.client_cert, "ZML_NATS_TLS_KEY": pki.client_key,
           "ZML_GATEWAY_TLS_CERT": pki.server_cert, "ZML_GATEWAY_TLS_KEY": pki.server_key}
    s = launch_stack(tls_bus.url, tmp_path_factory.mktemp("tls-stack"), fleet=[("h100-1", "nvidia_h100", [MODEL])],
                     routers=1, identities=tls_bus.seeds, env=env, https_verify=_trust(pki))
    try:
        yield s
    finally:
        s.stop()


def test_the_stack_runs_over_mutual_tls_and_serves_https(tls_stack: Stack, pki: Pki) -> None:
    assert tls_stack.gateway_url.startswith("https://")
    r = httpx.post(tls_stack.gateway_url + "/v1/chat/completions", verify=_trust(pki), timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert r.json()["zml"]["node_id"] == "h100-1"
    with pytest.raises(httpx.TransportError):  # plain HTTP is not served
        httpx.get(tls_stack.gateway_url.replace("https://", "http://") + "/healthz", timeout=5)


def _trust(pki: Pki) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=pki.ca)


def _tls(pki: Pki, cert: str | None, key: str | None) -> NatsConfig:
    return NatsConfig(tls_ca_file=pki.ca, tls_cert_file=cert, tls_key_file=key)


async def test_nats_client_with_identity_and_certificate_connects(tls_stack: Stack, tls_bus: SecureBus,
                                                                  pki: Pki) -> None:
    tls_bus.issue("tls-client")
    opts = connect_options(_tls(pki, pki.client_cert, pki.client_key), seed_file=tls_bus.seeds["tls-client"])
    nc = await nats.connect(tls_bus.url, allow_reconnect=False, connect_timeout=5, **opts)
    try:
        reply = await nc.request("zml.infer", b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL.encode(),
                                 timeout=30)
        assert "Zml-Error-Code" not in (reply.headers or {}), reply.data
    finally:
        await nc.close()


@pytest.mark.parametrize("case", ["no client certificate", "certificate from another CA", "no TLS at all"])
async def test_nats_refuses_clients_without_a_good_certificate(tls_stack: Stack, tls_bus: SecureBus, pki: Pki,
                                                               case: str) -> None:
    seed = tls_bus.seeds["gateway"]  # even a valid identity is not enough
    if case == "no client certificate":
        opts = connect_options(_tls(pki, None, None), seed_file=seed)
    elif case == "certificate from another CA":
        opts = connect_options(_tls(pki, pki.rogue_cert, pki.rogue_key), seed_file=seed)
    else:
        opts = connect_options(NatsConfig(), seed_file=seed)
    with pytest.raises(Exception) as ei:
        nc = await nats.connect(tls_bus.url, allow_reconnect=False, connect_timeout=5, **opts)
        await nc.close()
    assert isinstance(ei.value, (ssl.SSLError, nats.errors.Error, OSError, TimeoutError)), repr(ei.value)


async def test_grpc_port_serves_tls_with_the_gateway_certificate(tls_stack: Stack, pki: Pki) -> None:
    import grpc

    from zmlcore.rpc import zml_pb2 as pb
    from zmlcore.rpc import zml_pb2_grpc

    req = pb.InferRequest(model=MODEL, prompt="hi", max_tokens=2)
    creds = grpc.ssl_channel_credentials(root_certificates=Path(pki.ca).read_bytes())
    async with grpc.aio.secure_channel(tls_stack.grpc_target, creds) as channel:
        reply = await zml_pb2_grpc.ZmlStub(channel).Infer(req, timeout=30)
    assert reply.routing.node_id == "h100-1"
    async with grpc.aio.insecure_channel(tls_stack.grpc_target) as channel:  # plaintext is not served
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await zml_pb2_grpc.ZmlStub(channel).Infer(req, timeout=5)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sdk_grpcs_endpoint_verifies_the_gateway(tls_stack: Stack, pki: Pki) -> None:
    """``grpcs://`` in the SDK: TLS verified against the roots grpc is given (here the test CA,
    through GRPC_DEFAULT_SSL_ROOTS_FILE_PATH, as docs/grpc.md says); without them, refused."""
    import os
    import subprocess
    import sys

    code = ("import zml\nwith zml.Client('grpcs://%s', max_retries=0, timeout=20) as c:\n"
            "    print(c.infer(%r, 'hi', max_tokens=2).routing.node_id)\n") % (tls_stack.grpc_target, MODEL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZML_", "GRPC_"))}
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                        env={**env, "GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": pki.ca})
    assert ok.returncode == 0 and ok.stdout.strip() == "h100-1", ok.stderr[-2000:]
    refused = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode != 0 and "CONNECTION_FAILED" in refused.stderr, refused.stderr[-2000:]
