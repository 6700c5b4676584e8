"""`zml keys create|list|revoke`: API keys with plans, stored hashed in NATS KV (no restart).

    zml keys create --plan team --name ci       # prints the key once
    zml keys list
    zml keys revoke 3f9a0c21b7de                # every gateway refuses it within a second
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from zml.cli._bus import add_bus_args


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("keys", help="create, list and revoke API keys (plans: maker, team, custom)")
    verbs = p.add_subparsers(dest="verb", required=True)
    c = verbs.add_parser("create", help="create a key; it is printed once and stored only as a SHA-256")
    c.add_argument("--plan", default="maker", choices=("maker", "team", "custom"),
                   help="maker: 60 requests/min, 5 concurrent; team: 600 and 50; custom: the numbers below")
    c.add_argument("--name", default="", help="who or what the key is for")
    c.add_argument("--rpm", type=int, help="requests per minute (overrides the plan's)")
    c.add_argument("--concurrent", type=int, help="requests at once (overrides the plan's)")
    c.add_argument("--tpm", type=int, help="tokens per minute")
    c.add_argument("--model", action="append", default=[], dest="models", metavar="MODEL",
                   help="a model the key may use (repeatable; default: all)")
    c.add_argument("--policy", default="", help="routing policy for requests that name none")
    c.add_argument("--label", default="", help="cost-attribution label (routing metadata, completion events)")
    bands = ("critical", "standard", "sheddable", "batch")
    c.add_argument("--priority", default="", choices=("",) + bands, metavar="BAND",
                   help="band of the key's requests that name none (default: [flow] default_priority)")
    c.add_argument("--max-priority", default="", choices=("",) + bands, metavar="BAND",
                   help="highest band the key's requests may claim; a claim above it is lowered "
                        "(default: [flow] max_priority)")
    c.add_argument("--weight", type=float, default=1.0,
                   help="the key's weight in the fair share of the fleet between tenants (default 1)")
    ls = verbs.add_parser("list", help="list keys (ids, plans, limits; never the keys)")
    ls.add_argument("--json", action="store_true")
    r = verbs.add_parser("revoke", help="revoke a key by id")
    r.add_argument("key_id")
    for q in (c, ls, r):
        add_bus_args(q)
    p.set_defaults(func=run)


def _limits_text(limits: dict[str, int]) -> str:
    parts = [f"{limits[k]} {label}" for k, label in (("requests_per_minute", "req/min"), ("concurrent", "concurrent"),
                                                     ("tokens_per_minute", "tok/min")) if limits.get(k) is not None]
    return ", ".join(parts) or "no limits"


def run(args: argparse.Namespace) -> int:
    import msgspec

    from zml.cli._bus import operator_nats, resolve
    from zmlcore.errors import BadRequestError
    from zmlcore.access.apikeys import create_key, list_keys, revoke_key
    from zmlcore.access.plans import plan_limits

    target = resolve(nats_url=args.nats_url, config_path=args.config, data_dir=args.data_dir)
    for value in (getattr(args, "rpm", None), getattr(args, "concurrent", None), getattr(args, "tpm", None)):
        if value is not None and value < 1:
            raise BadRequestError("limits must be >= 1")

    async def go() -> int:
        async with operator_nats(target) as nc:
            if args.verb == "create":
                limits = plan_limits(args.plan, requests_per_minute=args.rpm, concurrent=args.concurrent,
                                     tokens_per_minute=args.tpm)
                key, rec = await create_key(nc, plan=args.plan, limits=limits, name=args.name, models=args.models,
                                            default_policy=args.policy, label=args.label, priority=args.priority,
                                            max_priority=args.max_priority, weight=args.weight)
                print(f"id:   {rec.id}\nplan: {rec.plan} ({_limits_text(msgspec.to_builtins(rec.limits))})")
                print(f"key:  {key}\n(shown once: only its SHA-256 is stored)")
                return 0
            if args.verb == "list":
                records = await list_keys(nc)
                if args.json:
                    print(json.dumps([{k: v for k, v in msgspec.to_builtins(r).items() if k != "sha256"}
                                      for r in records], indent=2))
                    return 0
                if not records:
                    print("no API keys (create one with `zml keys create --plan maker`)")
                for r in records:
                    created = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r.created_at))
                    extra = "".join(f"  {k}={v}" for k, v in (("models", ",".join(r.models)), ("policy", r.default_policy),
                                                              ("label", r.label), ("priority", r.priority),
                                                              ("max_priority", r.max_priority),
                                                              ("weight", f"{r.weight:g}" if r.weight != 1.0 else ""))
                    if v)
                    print(f"{r.id}  {r.plan:<6}  {_limits_text(msgspec.to_builtins(r.limits)):<34}  "
                          f"{created}  {r.name or '-'}{extra}")
                return 0
            if await revoke_key(nc, args.key_id):
                print(f"{args.key_id}: revoked")
                return 0
            print(f"{args.key_id}: no such key")
            return 1

    return asyncio.run(go())
