"""`zml cost set|clear`: change a node's price at run time (spot prices), no restart."""

from __future__ import annotations

import argparse
import asyncio

from zml.cli._bus import add_bus_args


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("cost", help="set or clear a node's run-time price ($/GPU-hour)")
    verbs = p.add_subparsers(dest="verb", required=True)
    s = verbs.add_parser("set", help="set NODE's price")
    s.add_argument("node")
    s.add_argument("cost_per_hour", type=float)
    s.add_argument("--source", default="manual", help='e.g. "spot:aws"')
    c = verbs.add_parser("clear", help="back to zml.toml's price")
    c.add_argument("node")
    for q in (s, c):
        add_bus_args(q)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zml.cli._bus import operator_nats, resolve
    from zmlcore.fleet.costs import clear_cost, set_cost

    target = resolve(nats_url=args.nats_url, config_path=args.config, data_dir=args.data_dir)

    async def go() -> None:
        async with operator_nats(target) as nc:
            if args.verb == "set":
                entry = await set_cost(nc, args.node, args.cost_per_hour, source=args.source)
                print(f"{args.node}: ${entry.cost_per_hour:g}/h ({entry.source})")
            else:
                await clear_cost(nc, args.node)
                print(f"{args.node}: price from zml.toml")

    asyncio.run(go())
    return 0
