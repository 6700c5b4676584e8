"""`zml creds issue|revoke|list`: NATS identities of a `zml up` data folder, without restarts.

Issuing writes the identity's nkey seed (mode 0600) and adds it, with its role's permissions,
to the server's auth.conf; revoking removes both. Either way the running nats-server of that
folder reloads its config (SIGHUP: no restart) and closes a revoked identity's connections.
"""

from __future__ import annotations

import argparse
import shutil
import sys


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from zmlcore.natsperms import ROLES

    p = sub.add_parser("creds", help="issue, revoke or list NATS identities (client, admin, services)")
    verbs = p.add_subparsers(dest="verb", required=True)
    i = verbs.add_parser("issue", help="create an identity and print its seed file")
    i.add_argument("name", help="letters, digits, - and _")
    i.add_argument("--role", default="client", choices=ROLES,
                   help="client (default): request zml.infer, cancel its own requests, read its own replies")
    i.add_argument("--out", help="also copy the seed file here (mode 0600)")
    r = verbs.add_parser("revoke", help="delete an identity; its connections are closed at once")
    r.add_argument("name")
    ls = verbs.add_parser("list", help="every identity with its role and public key")
    init = verbs.add_parser("init", help="create the service and admin identities and nats.conf (what `zml up` "
                                         "does first; compose runs it once)")
    for q in (i, r, ls, init):
        q.add_argument("--data-dir", help="the `zml up` data folder (default ~/.local/share/zml)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    from zmlcore import natscreds

    data_dir = args.data_dir or str(natscreds.default_data_dir())
    if args.verb == "init":
        ids = natscreds.ensure_builtin(data_dir)
        conf = natscreds.write_server_config(data_dir)
        print(f"{len(ids)} identities in {data_dir}; nats-server config: {conf}")
        return 0
    if args.verb == "list":
        for ident in natscreds.identities(data_dir):
            print(f"{ident.name:<20} {ident.role:<8} {ident.public_key}")
        return 0
    if args.verb == "issue":
        ident = natscreds.issue(data_dir, args.name, role=args.role)
        path = ident.seed_file
        if args.out:
            shutil.copyfile(ident.seed_file, args.out)
            os.chmod(args.out, 0o600)
            path = args.out
        print(f"issued {ident.name} ({ident.role}) {ident.public_key}")
        print(f"seed file: {path}  (keep it secret; use it with ZML_NATS_NKEY={path})")
    else:
        ident = natscreds.revoke(data_dir, args.name)
        print(f"revoked {ident.name} ({ident.role}) {ident.public_key}")
    pid = natscreds.reload_server(data_dir)
    if pid is None:
        print(f"no running nats-server for {data_dir}: the change applies when it starts "
              "(elsewhere: `nats-server --signal reload`)", file=sys.stderr)
    else:
        print(f"nats-server {pid} reloaded its authorization (no restart)")
    return 0
