"""`zml cost set|clear`: change a node's price at run time (spot prices), no restart."""

from __future__ import annotations

import argparse
import asyncio


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
        q.add_argument("--nats-url", help="NATS URL (default: ZML_NATS_URL, then zml.toml, then nats://127.0.0.1:4222)")
        q.add_argument("--config", help="zml.toml (default: found in this folder or a parent)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from zmlcore.config import find_config, load_config
    from zmlcore.fleet.costs import clear_cost, set_cost
    from zmlcore.access.identity import cli_options
    from zmlcore.bus.connect import connect

    url = args.nats_url or load_config(args.config or find_config()).nats.url

    async def go() -> None:
        nc = await connect(url, "zml-cli", connect_timeout=3, **cli_options(args.config))
        try:
            if args.verb == "set":
                entry = await set_cost(nc, args.node, args.cost_per_hour, source=args.source)
                print(f"{args.node}: ${entry.cost_per_hour:g}/h ({entry.source})")
            else:
                await clear_cost(nc, args.node)
                print(f"{args.node}: price from zml.toml")
        finally:
            await nc.close()

    asyncio.run(go())
    return 0
