"""How an operator command reaches NATS: which server, as which identity, and failing fast.

As kubectl finds its cluster and credentials in its kubeconfig, a command run beside `zml up`
needs no variable: when ``ZML_NATS_NKEY`` (or ``[nats] nkey_file``) is unset and the URL is the
one the data folder's running nats-server listens on (its ``nats-server_PID.ports`` file says
so), the command connects as that folder's admin identity (``creds/admin.nk``). ``--data-dir``
or ``ZML_DATA_DIR`` choose another folder (its admin identity is then used whatever the URL);
with no URL given anywhere, the folder's server is the one asked.

Whatever still cannot connect fails within :data:`GIVE_UP_S` with one line saying what to set
(:mod:`zmlcore.bus.refusal`), never a retry loop or a traceback.

    target = resolve(nats_url=args.nats_url, config_path=args.config, data_dir=args.data_dir)
    async with operator_nats(target) as nc:
        ...
"""

from __future__ import annotations

import argparse
import os
import weakref
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from zmlcore.bus.refusal import Attempt

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

#: Seconds an operator command waits for NATS before it says why not.
GIVE_UP_S = 1.5
DEFAULT_URL = "nats://127.0.0.1:4222"


def add_bus_args(p: "argparse.ArgumentParser | argparse._ArgumentGroup", *, config: bool = True,
                 data_dir: bool = True) -> None:
    """``--nats-url``, ``--data-dir`` (and ``--config``) for a command that talks to NATS."""
    p.add_argument("--nats-url", help="NATS URL (default: ZML_NATS_URL, then zml.toml, then the server of the "
                                      "`zml up` data folder, then nats://127.0.0.1:4222)")
    if data_dir:
        p.add_argument("--data-dir", help="the `zml up` data folder whose admin identity to use (default: "
                                          "ZML_DATA_DIR, then ~/.local/share/zml when its server is the one asked)")
    if config:
        p.add_argument("--config", help="zml.toml (default: found in this folder or a parent)")


def _host_port(url: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(url if "://" in url else f"nats://{url}")
        host, port = (parts.hostname or "").lower(), parts.port or 4222
    except ValueError:
        return None
    if host in ("localhost", "0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return host, port


def same_server(urls: str, served: Sequence[str]) -> bool:
    """Does any of ``urls`` (comma-separated) name a server in ``served`` (host and port;
    ``localhost`` is 127.0.0.1)?"""
    mine = {_host_port(u.strip()) for u in urls.split(",") if u.strip()}
    return bool((mine - {None}) & {_host_port(s) for s in served})


@dataclass(frozen=True)
class Choice:
    url: str
    seed_file: str | None
    #: "" when the seed is the caller's own setting, else where it was found.
    source: str = ""
    #: What to do when the server asks for an identity and none was found.
    hint: str = ""


def choose(*, url: str | None, configured_seed: str | None, data_dir: Path, explicit_dir: bool,
           served: Sequence[str], admin_seed: str | None) -> Choice:
    """Which server and identity an operator command uses (pure: the caller reads the folder).

    ``url``: the flag, ZML_NATS_URL or zml.toml's, None if none of them names one;
    ``served``: the client URLs of the folder's running servers; ``admin_seed``: the folder's
    admin seed file if it exists."""
    if url is None:
        url = ",".join(served) if served else DEFAULT_URL
    if configured_seed:
        return Choice(url, configured_seed)
    if admin_seed and (explicit_dir or same_server(url, served)):
        return Choice(url, admin_seed, source=f"the admin identity of the `zml up` data folder {data_dir}")
    set_seed = "or set ZML_NATS_NKEY to the seed file of an identity with the admin role (DIR/creds/admin.nk)"
    if explicit_dir:
        hint = f"{data_dir} holds no admin identity (creds/admin.nk): is it a `zml up` data folder? Pass the right --data-dir, {set_seed}"
    elif served:
        hint = (f"the `zml up` of {data_dir} serves {', '.join(served)}, not {url}: pass --data-dir (or set ZML_DATA_DIR) "
                f"to the data folder of the `zml up` that runs {url}, {set_seed}")
    else:
        hint = (f"no `zml up` runs from {data_dir} (the default data folder): pass --data-dir (or set ZML_DATA_DIR) "
                f"to the data folder of the `zml up` that runs {url}, {set_seed}")
    return Choice(url, None, hint=hint)


@dataclass(frozen=True)
class Target:
    """A resolved server + identity: nats-py options and what to say if it refuses them."""

    url: str
    options: dict[str, Any] = field(default_factory=dict)
    #: None: described from ``options`` by the connection helper.
    attempt: Attempt | None = None


def resolve(*, nats_url: str | None = None, config_path: str | None = None, data_dir: str | None = None) -> Target:
    """Read the flags, the environment, zml.toml and the data folder into a :class:`Target`."""
    from zml.cli._identities import data_dir_of, served_urls
    from zmlcore.access.identity import connect_options, public_key
    from zmlcore.config import find_config, load_config

    path = config_path or find_config()
    cfg = load_config(path).nats  # applies ZML_NATS_URL, ZML_NATS_NKEY, ZML_NATS_TLS_*
    url = nats_url or os.environ.get("ZML_NATS_URL") or (cfg.url if path else None)
    folder, explicit = data_dir_of(data_dir)
    admin = folder / "creds" / "admin.nk"
    choice = choose(url=url, configured_seed=cfg.nkey_file, data_dir=folder, explicit_dir=explicit,
                    served=served_urls(folder), admin_seed=str(admin) if admin.is_file() else None)
    options = connect_options(cfg, seed_file=choice.seed_file)
    attempt = Attempt(url=choice.url, seed_file=choice.seed_file,
                      public_key=public_key(choice.seed_file) if choice.seed_file else "",
                      tls="tls" in options, client_cert=cfg.tls_cert_file, identity_hint=choice.hint,
                      identity_source=choice.source,
                      unreachable_hint="is `zml up` running? --nats-url or ZML_NATS_URL name another server")
    return Target(choice.url, options, attempt)


def adopt_identity(endpoint: str | None, config_path: str | None, data_dir: str | None = None) -> None:
    """For the SDK-based commands (infer, batch, bench, nodes) over a ``nats://`` endpoint:
    the same identity an operator command would use, given to the SDK as ZML_NATS_NKEY (this
    process only) when none is set."""
    endpoint = endpoint or os.environ.get("ZML_ENDPOINT")
    if not endpoint or not endpoint.startswith(("nats://", "tls://")) or os.environ.get("ZML_NATS_NKEY"):
        return
    target = resolve(nats_url=endpoint, config_path=config_path, data_dir=data_dir)
    seed = target.attempt.seed_file if target.attempt else None
    if seed:
        os.environ["ZML_NATS_NKEY"] = seed


async def connect_operator(target: Target, name: str = "zml-cli", **kwargs: Any) -> "NATS":
    """Connect for a command: AuthError / ConfigError / ConnectionError within GIVE_UP_S."""
    from zmlcore.bus.connect import connect

    return await connect(target.url, name, connect_timeout=GIVE_UP_S, give_up_s=GIVE_UP_S, attempt=target.attempt,
                         quiet=True, **kwargs, **target.options)


_DENIED: "weakref.WeakKeyDictionary[NATS, list[str]]" = weakref.WeakKeyDictionary()


def check_denied(nc: "NATS", target: Target) -> None:
    """Raise AuthError if the server refused this connection a subject ("permissions
    violation": a role that may not do this). A request the server refused to pass on only
    times out; call this before reporting the timeout."""
    from zmlcore.bus.refusal import Attempt, explain_denied
    from zmlcore.errors import AuthError

    denied = _DENIED.get(nc)
    if denied:
        raise AuthError(explain_denied(denied[-1], target.attempt or Attempt(url=target.url)))


@asynccontextmanager
async def operator_nats(target: Target) -> AsyncIterator["NATS"]:
    """A connection for one command. The server's "permissions violation" (a role that may not
    do this) stops the command at once with AuthError: the request it refused would only time
    out. Any other NATS error becomes one ConnectionError line."""
    import asyncio

    from nats.errors import Error as NatsError

    from zmlcore.bus.link import link_of
    from zmlcore.errors import ConnectionError

    denied: list[str] = []
    body = asyncio.current_task()

    async def on_error(exc: Exception) -> None:
        if "permissions violation" in str(exc).lower():
            denied.append(str(exc))
            if body is not None and len(denied) == 1:
                body.cancel()

    nc = await connect_operator(target, on_error=on_error)
    _DENIED[nc] = denied
    try:
        yield nc
    except asyncio.CancelledError:
        if denied and body is not None and body.uncancel() == 0:  # our cancel, not Ctrl-C's
            check_denied(nc, target)
        raise
    except (NatsError, asyncio.TimeoutError, OSError) as exc:
        check_denied(nc, target)
        raise ConnectionError(f"NATS at {target.url}: {type(exc).__name__}: {exc}") from exc
    finally:
        link_of(nc).closing = True  # our own close: nothing to report
        await nc.close()
