"""HTTP/2 at the gateway: h2c with prior knowledge and TLS with ALPN on the HTTP/1.1 port, with
real clients (httpx ``http2=True``), streaming and errors; and hostile HTTP/2 from a raw socket
driven by the ``h2`` library (floods, resets, oversized and malformed input), which must end in
a stream error or GOAWAY, never a 5xx or a dead gateway."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from conftest import MODEL, Stack
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, wait_port

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
LIMITS = ("[gateway]\nmax_body_bytes = 65536\nhttp2_max_streams = 8\nmax_headers = 40\nheader_timeout_s = 2\n"
          "body_timeout_s = 2\n")


@dataclass
class Gateways:
    plain: str  # http://: HTTP/1.1 and h2c
    tls: str  # https://: HTTP/1.1 and h2 by ALPN
    ca: str
    port: int
    procs: list[Proc]


def _self_signed(folder: Path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "gw.crt", folder / "gw.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def gw(zml_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateways]:
    folder = tmp_path_factory.mktemp("h2")
    base = Path(zml_stack.config_path).read_text()
    cert, key = _self_signed(folder)
    plain_cfg, tls_cfg = folder / "plain.toml", folder / "tls.toml"
    plain_cfg.write_text(LIMITS + base)
    tls_cfg.write_text(LIMITS + f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n' + base)
    ports = free_port(), free_port()
    procs = [spawn(f"gateway-h2-{i}", service_argv("gateway", str(c), zml_stack.nats_url, "--port", str(p)))
             for i, (c, p) in enumerate(zip((plain_cfg, tls_cfg), ports))]
    try:
        for proc, port in zip(procs, ports):
            assert wait_port("127.0.0.1", port, 30), proc.tail()
        yield Gateways(f"http://127.0.0.1:{ports[0]}", f"https://127.0.0.1:{ports[1]}", cert, ports[0], procs)
    finally:
        for proc in procs:
            proc.stop()


def _alive(gw: Gateways) -> None:
    """After hostile input: both processes up, HTTP/1.1 and HTTP/2 still answered."""
    assert all(p.alive() for p in gw.procs), [p.tail() for p in gw.procs]
    assert httpx.get(gw.plain + "/healthz", timeout=10).status_code == 200
    with httpx.Client(http1=False, http2=True, timeout=10) as c:
        r = c.get(gw.plain + "/healthz")
        assert r.status_code == 200 and r.http_version == "HTTP/2"


# -- real clients ----------------------------------------------------------------------------


def test_h2c_prior_knowledge_serves_the_api(gw: Gateways) -> None:
    with httpx.Client(base_url=gw.plain, http1=False, http2=True, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.http_version == "HTTP/2" and r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] and r.json()["zml"]["node_id"]
        assert r.headers["x-zml-node-id"] == r.json()["zml"]["node_id"]
        models = c.get("/v1/models")
        assert models.status_code == 200 and MODEL in [m["id"] for m in models.json()["data"]]
    # The same port still speaks HTTP/1.1.
    r1 = httpx.post(gw.plain + "/v1/chat/completions", json=BODY, timeout=30)
    assert r1.http_version == "HTTP/1.1" and r1.status_code == 200


def test_h2c_head_is_get_without_the_body(gw: Gateways) -> None:
    with httpx.Client(base_url=gw.plain, http1=False, http2=True, timeout=30) as c:
        for path in ("/healthz", "/v1/models"):
            got, head = c.get(path), c.head(path)
            assert head.http_version == "HTTP/2" and head.status_code == got.status_code == 200
            assert head.content == b"" and head.headers["content-length"] == str(len(got.content)), path
        assert c.get("/healthz").status_code == 200  # the connection is still good
    _alive(gw)


def test_h2c_streaming_relays_server_sent_events(gw: Gateways) -> None:
    with httpx.Client(base_url=gw.plain, http1=False, http2=True, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 8}) as r:
            assert r.http_version == "HTTP/2" and r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3, events


def test_h2_errors_are_clear_4xx(gw: Gateways) -> None:
    with httpx.Client(base_url=gw.plain, http1=False, http2=True, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "BAD_REQUEST", r.text
        assert c.get("/v1/nowhere").status_code == 404
        # Over max_body_bytes, with and without a content-length (the stream's body is cut off).
        big = b'{"model": "' + b"x" * 100_000 + b'"}'
        r = c.post("/v1/chat/completions", content=big, headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "REQUEST_TOO_LARGE", r.text
        r = c.post("/v1/chat/completions", content=iter([big[:40_000], big[40_000:]]),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        # Too many headers: 431 on that stream, the connection goes on.
        r = c.get("/healthz", headers={f"x-h{i}": "v" for i in range(60)})
        assert r.status_code == 431 and r.json()["error"]["code"] == "HEADERS_TOO_LARGE"
        assert c.get("/healthz").status_code == 200


def test_h2_many_streams_on_one_connection(gw: Gateways) -> None:
    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=gw.plain, http1=False, http2=True, timeout=60) as c:
            rs = await asyncio.gather(*(c.post("/v1/chat/completions", json=BODY) for _ in range(24)))
            return [r.status_code for r in rs if r.http_version == "HTTP/2"]

    assert asyncio.run(run()) == [200] * 24  # 24 requests over a limit of 8 concurrent streams


def test_tls_alpn_offers_h2_and_http11(gw: Gateways) -> None:
    trust = ssl.create_default_context(cafile=gw.ca)
    with httpx.Client(base_url=gw.tls, http2=True, verify=trust, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.http_version == "HTTP/2" and r.status_code == 200, r.text
        with c.stream("POST", "/v1/chat/completions", json={**BODY, "stream": True}) as s:
            assert s.http_version == "HTTP/2" and [x for x in s.iter_lines() if x.startswith("data: ")][-1] == "data: [DONE]"
    with httpx.Client(base_url=gw.tls, verify=trust, timeout=30) as c:  # a client that offers only http/1.1
        r = c.post("/v1/chat/completions", json=BODY)
        assert r.http_version == "HTTP/1.1" and r.status_code == 200


# -- hostile HTTP/2 on a raw socket ----------------------------------------------------------


class RawH2:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None,
                                                                         validate_outbound_headers=False))
        self.conn.initiate_connection()
        self.flush()
        self.events: list[h2.events.Event] = []
        self.closed = False

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def send_raw(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except OSError:
            self.closed = True

    def read_until(self, done: object, timeout: float = 15.0) -> list[h2.events.Event]:
        deadline = time.monotonic() + timeout
        while not self.closed and time.monotonic() < deadline and not done(self.events):  # type: ignore[operator]
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                self.closed = True
                break
            if not data:
                self.closed = True
                break
            try:
                self.events += self.conn.receive_data(data)
                self.flush()
            except (h2.exceptions.ProtocolError, OSError):
                pass
        return self.events

    def goaway(self) -> h2.events.ConnectionTerminated | None:
        return next((e for e in self.events if isinstance(e, h2.events.ConnectionTerminated)), None)

    def request(self, path: bytes = b"/healthz", extra: list[tuple[bytes, bytes]] = (), end: bool = True) -> int:  # type: ignore[assignment]
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(b":method", b"GET" if end else b"POST"), (b":path", path), (b":scheme", b"http"),
                                     (b":authority", b"127.0.0.1"), *extra], end_stream=end)
        self.flush()
        return sid

    def status(self, sid: int) -> int | None:
        for e in self.events:
            if isinstance(e, h2.events.ResponseReceived) and e.stream_id == sid:
                return int(dict(e.headers)[b":status"])
        return None

    def close(self) -> None:
        self.sock.close()


def _terminated(events: list[h2.events.Event]) -> bool:
    return any(isinstance(e, h2.events.ConnectionTerminated) for e in events)


def test_h2_rapid_reset_ends_the_connection(gw: Gateways) -> None:
    c = RawH2(gw.port)
    try:
        for _ in range(2000):
            sid = c.request(end=False)
            c.conn.reset_stream(sid)
            c.flush()
            if c.closed:
                break
    except OSError:
        pass
    c.read_until(_terminated)
    assert c.goaway() is not None and c.goaway().error_code == 11  # ENHANCE_YOUR_CALM
    c.close()
    _alive(gw)


def test_h2_ping_and_settings_floods_end_the_connection(gw: Gateways) -> None:
    for flood in ("ping", "settings"):
        c = RawH2(gw.port)
        try:
            for i in range(5000):
                if flood == "ping":
                    c.conn.ping(i.to_bytes(8, "big"))
                else:
                    c.conn.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100 + i % 2})
                if i % 100 == 0:
                    c.flush()
            c.flush()
        except OSError:
            pass
        c.read_until(_terminated)
        assert c.goaway() is not None and c.goaway().error_code == 11, (flood, c.events[-3:])
        c.close()
    _alive(gw)


def test_h2_stream_limit_and_oversized_headers(gw: Gateways) -> None:
    # More concurrent streams than SETTINGS_MAX_CONCURRENT_STREAMS (8): refused, the gateway lives.
    c = RawH2(gw.port)
    c.read_until(lambda ev: any(isinstance(e, h2.events.RemoteSettingsChanged) for e in ev))
    # Pretend we did not see the limit (h2 would refuse to open the streams otherwise).
    c.conn.remote_settings._settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS] = deque([1000])
    for _ in range(12):
        c.request(end=False)
    c.read_until(_terminated)
    resets = [e for e in c.events if isinstance(e, h2.events.StreamReset)]
    assert c.goaway() is not None or resets, c.events
    c.close()
    # A header block four times the advertised size: GOAWAY while decoding, not buffered whole.
    c = RawH2(gw.port)
    c.request(extra=[(b"x-big-%d" % i, b"v" * 8000) for i in range(10)])
    c.read_until(_terminated)
    assert c.goaway() is not None
    c.close()
    # Just over the advertised size: 431 on the stream, the connection stays.
    c = RawH2(gw.port)
    sid = c.request(extra=[(b"x-big", b"v" * 20_000)])
    c.read_until(lambda ev: c.status(sid) is not None)
    assert c.status(sid) == 431
    sid = c.request()
    c.read_until(lambda ev: c.status(sid) is not None)
    assert c.status(sid) == 200
    c.close()
    _alive(gw)


def test_h2_stalled_body_gets_408(gw: Gateways) -> None:
    """A stream whose body stops coming: 408 on that stream after body_timeout_s (2 s); other
    streams on the connection keep working."""
    c = RawH2(gw.port)
    sid = c.request(path=b"/v1/chat/completions", extra=[(b"content-type", b"application/json"),
                                                         (b"content-length", b"100")], end=False)
    c.conn.send_data(sid, b'{"model"')
    c.flush()
    t0 = time.monotonic()
    c.read_until(lambda ev: c.status(sid) is not None)
    assert c.status(sid) == 408 and 1.5 < time.monotonic() - t0 < 10, c.events
    other = c.request()
    c.read_until(lambda ev: c.status(other) is not None)
    assert c.status(other) == 200
    c.close()
    _alive(gw)


def test_h2_malformed_frames_and_silence_get_goaway(gw: Gateways) -> None:
    # A DATA frame on stream 0 is a connection error (PROTOCOL_ERROR = 1).
    c = RawH2(gw.port)
    c.send_raw(b"\x00\x00\x04\x00\x00\x00\x00\x00\x00abcd")
    c.read_until(_terminated)
    assert c.goaway() is not None and c.goaway().error_code == 1
    c.close()
    # A frame larger than SETTINGS_MAX_FRAME_SIZE (FRAME_SIZE_ERROR = 6).
    c = RawH2(gw.port)
    c.send_raw(b"\x01\x00\x00\x01\x04\x00\x00\x00\x01" + b"\x00" * 65536)
    c.read_until(_terminated)
    assert c.goaway() is not None and c.goaway().error_code in (1, 6)
    c.close()
    # Headers missing :path: malformed request.
    c = RawH2(gw.port)
    c.conn.send_headers(1, [(b":method", b"GET"), (b":scheme", b"http")], end_stream=True)
    c.flush()
    c.read_until(lambda ev: _terminated(ev) or any(isinstance(e, h2.events.StreamReset) for e in ev))
    assert c.goaway() is not None or any(isinstance(e, h2.events.StreamReset) for e in c.events)
    c.close()
    # The preface and then nothing: GOAWAY after header_timeout_s (2 s), connection closed.
    c = RawH2(gw.port)
    start = time.monotonic()
    c.read_until(_terminated, timeout=20)
    assert c.goaway() is not None and 1.5 < time.monotonic() - start < 15
    c.close()
    # Garbage that merely starts like the preface is HTTP/1.1's to refuse (400).
    with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    _alive(gw)
