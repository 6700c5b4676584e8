"""`zml creds issue|revoke|list`: NATS identities of a `zml up` data folder, without restarts.

Issuing writes the identity's nkey seed (mode 0600) and adds it, with its role's permissions,
to the server's auth.conf; revoking removes both. Either way the running nats-server of that
folder reloads its config (SIGHUP: no restart) and closes a revoked identity's connections.

A client identity may get a plan, as an API key does (``--plan maker|team|custom``, ``--rpm``,
``--concurrent``, ``--tpm``, or ``--key ID`` to share an API key's plan and budget): it is
written to the keys bucket over NATS (as the admin identity) and every router applies it to
the identity's raw NATS requests within a second. ``zml creds plan NAME ...`` changes it,
``zml creds plan NAME --none`` removes it.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from typing import Any

from zmlcore.errors import ConfigError


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from zmlcore.access.permissions import ROLES

    p = sub.add_parser("creds", help="issue, revoke or list NATS identities (client, admin, services)")
    verbs = p.add_subparsers(dest="verb", required=True)
    i = verbs.add_parser("issue", help="create an identity and print its seed file")
    i.add_argument("name", help="letters, digits, - and _")
    i.add_argument("--role", default="client", choices=ROLES,
                   help="client (default): request zml.infer, cancel its own requests, read its own replies; "
                        "observer: read completion and warmup events (zml.events.>), node state and prices, "
                        "nothing else; the services' and admin roles")
    i.add_argument("--out", help="also copy the seed file here (mode 0600)")
    r = verbs.add_parser("revoke", help="delete an identity; its connections are closed at once")
    r.add_argument("name")
    pl = verbs.add_parser("plan", help="give a client identity a plan, change it, or remove it (--none)")
    pl.add_argument("name")
    pl.add_argument("--none", action="store_true", help="remove the identity's plan (no limits on raw NATS)")
    for q in (i, pl):
        q.add_argument("--plan", choices=("maker", "team", "custom"),
                       help="limit this identity's raw NATS requests: maker 60 requests/min, 5 concurrent; "
                            "team 600 and 50; custom: the numbers below")
        q.add_argument("--rpm", type=int, help="requests per minute (overrides the plan's)")
        q.add_argument("--concurrent", type=int, help="requests at once (overrides the plan's)")
        q.add_argument("--tpm", type=int, help="tokens per minute")
        q.add_argument("--key", dest="key_id", help="share this API key's plan and budget (HTTP and NATS count together)")
    for q in (i, r, pl):
        q.add_argument("--nats-url", help="for plans: NATS URL (default: ZML_NATS_URL, then zml.toml)")
        q.add_argument("--config", help="for plans: zml.toml (default: found in this folder or a parent)")
    ls = verbs.add_parser("list", help="every identity with its role and public key")
    init = verbs.add_parser("init", help="create the service and admin identities and nats.conf (what `zml up` "
                                         "does first; compose runs it once)")
    for q in (i, r, pl, ls, init):
        q.add_argument("--data-dir", help="the `zml up` data folder (default ~/.local/share/zml)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from zml.cli import _identities

    data_dir = args.data_dir or str(_identities.default_data_dir())
    if args.verb == "init":
        ids = _identities.ensure_builtin(data_dir)
        conf = _identities.write_server_config(data_dir)
        print(f"{len(ids)} identities in {data_dir}; nats-server config: {conf}")
        return 0
    if args.verb == "list":
        for ident in _identities.identities(data_dir):
            print(f"{ident.name:<20} {ident.role:<8} {ident.public_key}")
        return 0
    wants_plan = bool(getattr(args, "plan", None) or getattr(args, "key_id", None)
                      or any(getattr(args, k, None) is not None for k in ("rpm", "concurrent", "tpm")))
    if args.verb == "plan":
        found = _identities.get(data_dir, args.name)
        if found is None:
            raise ConfigError(f"no identity {args.name!r} in {data_dir}")
        return asyncio.run(_plan(args, data_dir, found, remove=args.none or not wants_plan))
    if args.verb == "issue":
        if wants_plan and args.role != "client":
            raise ConfigError("plans are for client identities (services are limited at the gateway)")
        ident = _identities.issue(data_dir, args.name, role=args.role)
        path = ident.seed_file
        if args.out:
            shutil.copyfile(ident.seed_file, args.out)
            os.chmod(args.out, 0o600)
            path = args.out
        print(f"issued {ident.name} ({ident.role}) {ident.public_key}")
        print(f"seed file: {path}  (keep it secret; use it with ZML_NATS_NKEY={path})")
        if wants_plan:
            asyncio.run(_plan(args, data_dir, ident, remove=False))
    else:
        ident = _identities.revoke(data_dir, args.name)
        print(f"revoked {ident.name} ({ident.role}) {ident.public_key}")
        # Its plan entry can never apply again (the seed is gone; a re-issued name gets a new
        # key), so it is removed only when a broker is named or runs from the folder: best
        # effort, bounded.
        if ident.role == "client" and (args.nats_url or os.environ.get("ZML_NATS_URL")
                                       or _identities.served_urls(data_dir)):
            try:
                asyncio.run(asyncio.wait_for(_plan(args, data_dir, ident, remove=True, quiet=True), 10))
            except Exception as exc:
                print(f"plan of {ident.name} not removed ({type(exc).__name__})", file=sys.stderr)
    done = _identities.reload_server(data_dir)
    if done is None:
        print(f"no running nats-server for {data_dir}: the change applies when it starts "
              "(elsewhere: `nats-server --signal reload`)", file=sys.stderr)
    elif done.confirmed:
        print(f"nats-server {done.pid} reloaded its authorization (no restart)")
    else:
        print(f"nats-server {done.pid} was asked to reload its authorization; it did not confirm within "
              "5 s (see its log)", file=sys.stderr)
    return 0


async def _plan(args: argparse.Namespace, data_dir: str, ident: Any, *, remove: bool, quiet: bool = False) -> int:
    """Write (or remove) ``ident``'s plan in the keys bucket, as the admin identity."""
    import time

    import msgspec

    from zml.cli._bus import operator_nats, resolve
    from zmlcore.errors import BadRequestError
    from zmlcore.access.apikeys import remove_identity_plan, set_identity_plan
    from zmlcore.messages.keys import IdentityPlan
    from zmlcore.access.plans import plan_limits

    if ident.role != "client":
        raise ConfigError("plans are for client identities (services are limited at the gateway)")
    for value in (args.rpm, args.concurrent, args.tpm) if not remove else ():
        if value is not None and value < 1:
            raise BadRequestError("limits must be >= 1")
    # As the folder's admin (ZML_NATS_NKEY wins), on its running server unless a URL is given.
    async with operator_nats(resolve(nats_url=args.nats_url, config_path=args.config, data_dir=data_dir)) as nc:
        if remove:
            gone = await remove_identity_plan(nc, ident.public_key)
            if not quiet:
                print(f"{ident.name}: plan removed" if gone else f"{ident.name}: had no plan")
            return 0
        plan = args.plan or "custom"
        limits = plan_limits(plan, requests_per_minute=args.rpm, concurrent=args.concurrent, tokens_per_minute=args.tpm)
        record = IdentityPlan(name=ident.name, public_key=ident.public_key, plan=plan, limits=limits,
                              key_id=args.key_id or "", created_at=time.time())
        await set_identity_plan(nc, record)
        what = f"API key {record.key_id}'s plan and budget" if record.key_id else \
            f"plan {plan} {msgspec.json.encode(limits).decode()}"
        print(f"{ident.name}: {what} (every router applies it within a second)")
        return 0
