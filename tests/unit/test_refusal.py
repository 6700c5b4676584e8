"""A refused NATS connection is classified and explained in one line (zmlcore.bus.refusal),
and an operator command picks its server and identity like kubectl its kubeconfig
(zml.cli._bus.choose): pure decisions, no server."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from zml.cli._bus import DEFAULT_URL, choose, same_server
from zmlcore.bus.refusal import Attempt, ServerWithoutTLS, classify, explain, explain_denied, refusal_error, require_tls
from zmlcore.errors import AuthError, ConfigError


def _verify_error() -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed: "
                                          "unable to get local issuer certificate (_ssl.c:1006)")
    exc.verify_message = "unable to get local issuer certificate"
    return exc


@pytest.mark.parametrize(("exc", "kind"), [
    (Exception("nats: 'Authorization Violation'"), "auth"),
    (_verify_error(), "server_cert"),
    (ssl.SSLError(1, "[SSL: TLSV13_ALERT_CERTIFICATE_REQUIRED] tlsv13 alert certificate required (_ssl.c:2580)"),
     "client_cert_missing"),
    (ssl.SSLError(1, "[SSL: TLSV1_ALERT_UNKNOWN_CA] tlsv1 alert unknown ca (_ssl.c:2580)"), "client_cert_rejected"),
    (ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 4222)"), None),
    (ConnectionResetError("Connection lost"), None),
    (TimeoutError(), None),
    (ServerWithoutTLS("server n1 offers no TLS"), "no_tls"),
    (BrokenPipeError(32, "Broken pipe"), None),
])
def test_classify(exc: BaseException, kind: str | None) -> None:
    assert classify(exc) == kind


def test_no_identity_says_what_to_set_and_takes_the_callers_hint() -> None:
    line = explain("auth", Attempt(url="nats://h:4222"))
    assert "\n" not in line and "nats://h:4222" in line and "ZML_NATS_NKEY" in line
    assert "pass --data-dir" in explain("auth", Attempt(url="u", identity_hint="pass --data-dir DIR"))


def test_refused_identity_names_the_key_the_file_and_where_it_came_from() -> None:
    at = Attempt(url="nats://h:1", seed_file="/d/creds/admin.nk", public_key="UABC",
                 identity_source="the admin identity of the `zml up` data folder /d")
    line = explain("auth", at)
    assert "UABC" in line and "/d/creds/admin.nk" in line and "data folder /d" in line and "ZML_NATS_NKEY" in line
    assert isinstance(refusal_error("auth", at), AuthError)


def test_tls_refusals_name_the_variables() -> None:
    at = Attempt(url="nats://h:1", tls=True, client_cert="/c.pem")
    assert "ZML_NATS_TLS_CA" in explain("server_cert", at, _verify_error())
    assert "unable to get local issuer certificate" in explain("server_cert", at, _verify_error())
    # a server that wants TLS from a client that configured none (nats-py upgrades with the system roots)
    assert "requires TLS" in explain("server_cert", Attempt(url="nats://h:1"), _verify_error())
    assert "ZML_NATS_TLS_CERT" in explain("client_cert_missing", at)
    assert "/c.pem" in explain("client_cert_rejected", at)
    for kind in ("server_cert", "client_cert_missing", "client_cert_rejected"):
        assert isinstance(refusal_error(kind, at), ConfigError)  # type: ignore[arg-type]


def test_denied_names_the_subject_and_the_role() -> None:
    line = explain_denied('nats: permissions violation for publish to "zml.warmup.serve"',
                          Attempt(url="u", seed_file="/s/gateway.nk", public_key="UGW"))
    assert 'publish to "zml.warmup.serve"' in line and "admin role" in line and "UGW" in line


@pytest.mark.parametrize(("url", "served", "same"), [
    ("nats://127.0.0.1:4222", ["nats://127.0.0.1:4222"], True),
    ("nats://localhost:4222", ["nats://127.0.0.1:4222"], True),
    ("127.0.0.1:4222", ["nats://127.0.0.1:4222"], True),
    ("nats://127.0.0.1", ["nats://127.0.0.1:4222"], True),  # the default port
    ("nats://127.0.0.1:4223", ["nats://127.0.0.1:4222"], False),
    ("nats://10.0.0.9:4222", ["nats://127.0.0.1:4222"], False),
    ("nats://a:1,nats://127.0.0.1:5", ["nats://127.0.0.1:5", "nats://127.0.0.1:6"], True),  # a cluster
    ("nats://127.0.0.1:4222", [], False),
])
def test_same_server(url: str, served: list[str], same: bool) -> None:
    assert same_server(url, served) is same


D = Path("/data")


def test_choice_the_callers_own_identity_wins() -> None:
    c = choose(url=None, configured_seed="/mine.nk", data_dir=D, explicit_dir=False,
               served=["nats://127.0.0.1:4333"], admin_seed="/data/creds/admin.nk")
    assert (c.url, c.seed_file, c.source) == ("nats://127.0.0.1:4333", "/mine.nk", "")


def test_choice_the_local_zml_up_gives_its_admin_identity() -> None:
    c = choose(url="nats://localhost:4222", configured_seed=None, data_dir=D, explicit_dir=False,
               served=["nats://127.0.0.1:4222"], admin_seed="/data/creds/admin.nk")
    assert c.seed_file == "/data/creds/admin.nk" and "/data" in c.source
    # no URL anywhere: the folder's server (every member of a cluster)
    c = choose(url=None, configured_seed=None, data_dir=D, explicit_dir=False,
               served=["nats://127.0.0.1:5", "nats://127.0.0.1:6"], admin_seed="/data/creds/admin.nk")
    assert c.url == "nats://127.0.0.1:5,nats://127.0.0.1:6" and c.seed_file


def test_choice_another_server_gets_no_identity_and_a_hint() -> None:
    c = choose(url="nats://127.0.0.1:9999", configured_seed=None, data_dir=D, explicit_dir=False,
               served=["nats://127.0.0.1:4222"], admin_seed="/data/creds/admin.nk")
    assert c.seed_file is None and "serves nats://127.0.0.1:4222, not nats://127.0.0.1:9999" in c.hint
    c = choose(url=None, configured_seed=None, data_dir=D, explicit_dir=False, served=[], admin_seed=None)
    assert c.url == DEFAULT_URL and c.seed_file is None and "no `zml up` runs from /data" in c.hint
    assert "--data-dir" in c.hint and "ZML_DATA_DIR" in c.hint and "ZML_NATS_NKEY" in c.hint


def test_choice_a_folder_the_user_named_is_used_whatever_the_url() -> None:
    c = choose(url="nats://10.0.0.9:4222", configured_seed=None, data_dir=D, explicit_dir=True,
               served=[], admin_seed="/data/creds/admin.nk")
    assert c.seed_file == "/data/creds/admin.nk"
    c = choose(url="nats://10.0.0.9:4222", configured_seed=None, data_dir=D, explicit_dir=True,
               served=[], admin_seed=None)
    assert c.seed_file is None and "holds no admin identity" in c.hint


def test_a_server_without_tls_is_refused_when_tls_is_configured() -> None:
    require_tls({"server_id": "N1", "tls_required": True})  # TLS: nats-py upgrades
    for info in ({"server_id": "N1"}, {"server_id": "N1", "tls_available": True, "tls_required": False}):
        with pytest.raises(ServerWithoutTLS):  # tls_available alone: nats-py would stay in plaintext
            require_tls(info)
    line = explain("no_tls", Attempt(url="tls://h:1", tls=True))
    assert "\n" not in line and "offers no TLS" in line and "plaintext" in line and "ZML_NATS_TLS_CA" in line
    assert isinstance(refusal_error("no_tls", Attempt(url="u")), ConfigError)
