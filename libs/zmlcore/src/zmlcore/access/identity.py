"""A process's NATS identity and TLS, as options for the connection helper.

Every ZML process (service, CLI, SDK) connects as one identity: an nkey seed file, whose
public key is the identity's name on the bus. Its reply inbox is ``_ZML_INBOX.<public key>``,
the one inbox its permissions let it read (:mod:`zmlcore.access.permissions`).

    from zmlcore.access.identity import connect_options
    nc = await connect(cfg.nats.url, "zml-router", **connect_options(cfg.nats))

No seed configured means no identity: the default ``_INBOX`` and an open broker (tests,
``zml up --insecure``).
"""

from __future__ import annotations

import os
import ssl
from typing import Any

from zmlcore import subjects
from zmlcore.config import NatsConfig
from zmlcore.errors import ConfigError


def public_key(seed_file: str) -> str:
    """The public nkey (``U...``) of the seed in ``seed_file``; ConfigError if unreadable."""
    import nkeys  # type: ignore[import-untyped,import-not-found,unused-ignore]

    try:
        with open(seed_file, "rb") as fh:
            seed = bytearray(fh.read().strip())
        kp = nkeys.from_seed(seed)
    except OSError as exc:
        raise ConfigError(f"NATS identity {seed_file}: {exc.strerror or exc}") from exc
    except Exception as exc:  # nkeys raises its own errors for a malformed seed
        raise ConfigError(f"NATS identity {seed_file}: not an nkey seed ({type(exc).__name__})") from exc
    try:
        return str(kp.public_key.decode())
    finally:
        kp.wipe()


def tls_context(ca_file: str | None, cert_file: str | None = None, key_file: str | None = None) -> ssl.SSLContext:
    """A client context that verifies the server with ``ca_file`` (system roots if None) and,
    for mutual TLS, presents ``cert_file``/``key_file``."""
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca_file)
        if cert_file:
            ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"NATS TLS: {exc}") from exc
    return ctx


def connect_options(cfg: NatsConfig, *, seed_file: str | None = None) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` / :func:`zmlcore.bus.connect.connect`: identity
    (``nkeys_seed`` + ``inbox_prefix``) and TLS. ``seed_file`` overrides the configured one."""
    opts: dict[str, Any] = {}
    seed = seed_file or cfg.nkey_file
    if seed:
        if not os.path.isfile(seed):
            raise ConfigError(f"NATS identity {seed}: file not found (zml creds issue NAME writes one)")
        opts["nkeys_seed"] = seed
        opts["inbox_prefix"] = subjects.inbox_prefix(public_key(seed))
    if cfg.tls_ca_file or cfg.tls_cert_file or cfg.url.startswith("tls://"):
        opts["tls"] = tls_context(cfg.tls_ca_file, cfg.tls_cert_file, cfg.tls_key_file)
    return opts


def owner_of(opts: dict[str, Any]) -> str:
    """The owner token (public nkey) that ``connect_options`` gave a connection; "" if none."""
    prefix = str(opts.get("inbox_prefix") or "")
    return subjects.reply_owner(prefix + ".x")


def config_owner(cfg: NatsConfig) -> str:
    """The owner token of the configured identity ("" without one): a service's cancel subjects
    ``zml.cancel.<owner>.<id>``."""
    return public_key(cfg.nkey_file) if cfg.nkey_file else ""
