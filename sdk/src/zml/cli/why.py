"""`zml why DECISION_ID`: what a routing decision chose, what the router believed when it chose
(the node's speeds with their source and age, its cache, the estimate) and what happened. The
id is in every reply's routing metadata (``x-zml-decision-id``, ``zml.decision_id``)."""

from __future__ import annotations

import argparse
import asyncio

from zml.cli._bus import add_bus_args


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser(
        "why", help="look up a routing decision by its id (x-zml-decision-id)",
        description="Look up a routing decision by the id in a reply's routing metadata (x-zml-decision-id, "
                    "zml.decision_id): the node chosen, the speeds, cache and estimate the router chose it on "
                    "(with their source and age), the families evaluated, and what happened. Each router "
                    "replica remembers its last 8192 decisions.")
    p.add_argument("decision_id")
    p.add_argument("--json", action="store_true", help="the record as JSON (GET /v1/decisions/{id} gives the same)")
    add_bus_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import msgspec

    from zml.cli._bus import operator_nats, resolve
    from zmlcore.fleet.decisions import explain, lookup_decision

    target = resolve(nats_url=args.nats_url, config_path=args.config, data_dir=args.data_dir)

    async def go() -> None:
        async with operator_nats(target) as nc:
            record = await lookup_decision(nc, args.decision_id)
        if args.json:
            print(msgspec.json.encode(record).decode())
        else:
            print("\n".join(explain(record)))

    asyncio.run(go())
    return 0
