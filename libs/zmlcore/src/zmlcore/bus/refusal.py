"""Why a NATS server refused a connection, and the one line that says what to set.

nats-py treats a refused identity or a TLS mistake like an unreachable server: with
reconnects on it tries again forever, and the caller hangs. These are configuration mistakes
that no retry fixes, so the connection helper (:func:`zmlcore.bus.connect.connect`) and the
SDK stop at the first one and raise the line :func:`explain` writes. Pure: no I/O, no nats.

    kind = classify(exc)                 # None: not a refusal (unreachable, timeout...)
    if kind is not None:
        raise refusal_error(kind, Attempt(url=url, seed_file=seed, tls=True))
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Literal

from zmlcore.errors import AuthError, ConfigError, ZMLError

Kind = Literal["auth", "server_cert", "client_cert_missing", "client_cert_rejected", "no_tls"]

#: How an operator gets an identity when none was given (the CLI adds its data folder).
NO_IDENTITY_HINT = ("set ZML_NATS_NKEY (or [nats] nkey_file) to a seed file: `zml creds issue NAME` "
                    "writes a client's, and the `zml up` data folder holds creds/admin.nk for operator commands")


@dataclass(frozen=True)
class Attempt:
    """What the refused connection presented."""

    url: str
    seed_file: str | None = None
    public_key: str = ""
    tls: bool = False
    client_cert: str | None = None
    #: Replaces :data:`NO_IDENTITY_HINT` (the CLI names the data folder it looked in).
    identity_hint: str = ""
    #: Where the identity came from, when it was not the caller's own setting (the CLI's
    #: "admin identity of the `zml up` in DIR").
    identity_source: str = ""
    #: What to check when no server answers (said after "cannot reach NATS at URL").
    unreachable_hint: str = ""


class ServerWithoutTLS(Exception):
    """Raised (by :func:`require_tls`) before CONNECT when TLS is configured and the server
    offers none: nats-py would go on in plaintext."""


def require_tls(info: dict[str, object]) -> None:
    """The check of a server's INFO for a client configured for TLS (a CA, a client
    certificate or a tls:// URL): the server must require TLS, else nats-py would not upgrade
    (``tls_available`` alone does not make it)."""
    if not info.get("tls_required"):
        raise ServerWithoutTLS(f"server {info.get('server_name') or info.get('server_id') or '?'} offers no TLS")


def classify(exc: BaseException) -> Kind | None:
    """The kind of refusal ``exc`` (an error nats-py reported while connecting) is, or None
    for anything a retry may cure (connection refused, timeouts, a server going away)."""
    if isinstance(exc, ServerWithoutTLS):
        return "no_tls"
    text = str(exc).lower()
    if "authorization violation" in text or type(exc).__name__ == "AuthorizationError":
        return "auth"
    if isinstance(exc, ssl.SSLCertVerificationError) or "certificate verify failed" in text:
        return "server_cert"
    if "certificate required" in text or "peer did not return a certificate" in text:
        return "client_cert_missing"
    if any(s in text for s in ("unknown ca", "bad certificate", "certificate unknown", "unsupported certificate",
                               "certificate expired", "certificate revoked")):
        return "client_cert_rejected"
    return None


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return ""
    text = getattr(exc, "verify_message", None) or str(exc)
    return f" ({text.strip().rstrip('.')})" if text else ""


def explain(kind: Kind, at: Attempt, exc: BaseException | None = None) -> str:
    """One line: what the server at ``at.url`` refused and exactly what to set."""
    url = at.url
    if kind == "auth":
        if not at.seed_file:
            return f"NATS at {url} requires an identity and none was given: {at.identity_hint or NO_IDENTITY_HINT}"
        who = f"identity {at.public_key or '?'} (seed file {at.seed_file}{', ' + at.identity_source if at.identity_source else ''})"
        return (f"NATS at {url} refused {who}: it is not one of this server's identities (revoked, or issued by "
                "another `zml up` data folder); set ZML_NATS_NKEY to a seed from `zml creds issue NAME` "
                "run on this server's data folder")
    if kind == "server_cert":
        if at.tls:
            return (f"NATS at {url}: its TLS certificate is not trusted{_reason(exc)}: set ZML_NATS_TLS_CA "
                    "(or [nats] tls_ca_file) to the CA file that signed the server's certificate")
        return (f"NATS at {url} requires TLS and its certificate is not trusted by the system{_reason(exc)}: "
                "set ZML_NATS_TLS_CA (or [nats] tls_ca_file) to the CA file that signed it")
    if kind == "no_tls":
        return (f"NATS at {url} offers no TLS, and this connection is configured for TLS (ZML_NATS_TLS_CA/CERT, "
                "[nats] tls_* or a tls:// URL): it was not made, rather than sent in plaintext; give the URL of a "
                "server that has TLS (`zml up` with [nats] server_tls_cert_file), or unset the TLS settings")
    if kind == "client_cert_missing":
        return (f"NATS at {url} requires a client certificate: set ZML_NATS_TLS_CERT and ZML_NATS_TLS_KEY "
                "(or [nats] tls_cert_file and tls_key_file) to a certificate signed by the CA the server trusts")
    cert = f" {at.client_cert}" if at.client_cert else ""
    return (f"NATS at {url} refused the client certificate{cert}{_reason(exc)}: set "
            "ZML_NATS_TLS_CERT and ZML_NATS_TLS_KEY to a certificate signed by the CA the server trusts")


def explain_denied(violation: str, at: Attempt, *, role_needed: str = "admin") -> str:
    """One line for a server's "permissions violation" (the identity connected, but its role
    may not use a subject the command needs)."""
    what = violation.split("permissions violation for", 1)[-1].strip() or violation
    who = (at.identity_source and f"{at.identity_source} ({at.public_key})") or \
        (f"identity {at.public_key} (seed file {at.seed_file})" if at.seed_file else "a connection without identity")
    return (f"NATS at {at.url}: {who} may not {what}: this needs an identity with the {role_needed} role; set "
            f"ZML_NATS_NKEY to its seed file (a `zml up` data folder's creds/{role_needed}.nk), or unset it "
            "to use the admin identity of the local `zml up`")


def refusal_error(kind: Kind, at: Attempt, exc: BaseException | None = None) -> ZMLError:
    """The ZML error for a refusal: AUTH_FAILED for an identity, CONFIG_INVALID for TLS."""
    line = explain(kind, at, exc)
    return AuthError(line) if kind == "auth" else ConfigError(line)
