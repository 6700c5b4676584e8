"""`zml batches`: the Batch API's batches of this key, newest first; `zml batches show ID`,
`zml batches cancel ID`."""

from __future__ import annotations

import argparse
import json
import time

from zml._client import Client
from zml.cli._common import add_client_args, client_kwargs


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("batches", help="list the Batch API's batches (show one, cancel one)", description=__doc__)
    p.add_argument("action", nargs="?", default="list", choices=("list", "show", "cancel"))
    p.add_argument("batch_id", nargs="?", help="the batch of show / cancel")
    p.add_argument("--limit", type=int, default=20, help="batches listed (default 20; --all: every one)")
    p.add_argument("--all", action="store_true", help="list every batch, page after page")
    p.add_argument("--json", action="store_true", help="print OpenAI's batch objects as JSON")
    add_client_args(p)
    p.set_defaults(func=run)


def _age(ts: int) -> str:
    s = max(0, int(time.time()) - ts)
    return f"{s}s" if s < 120 else f"{s // 60}m" if s < 7200 else f"{s // 3600}h"


def run(args: argparse.Namespace) -> int:
    with Client(**client_kwargs(args)) as client:
        if args.action in ("show", "cancel"):
            if not args.batch_id:
                print(f"zml batches {args.action}: give a batch id", flush=True)
                return 2
            batch = client.batches.retrieve(args.batch_id) if args.action == "show" else \
                client.batches.cancel(args.batch_id)
            print(json.dumps(batch.raw, indent=2))
            return 0
        batches, after = [], None
        while True:
            page = client.batches.list(after=after, limit=min(100, args.limit) if not args.all else 100)
            batches += page.data
            if not args.all or not page.has_more or page.last_id is None:
                break
            after = page.last_id
        if args.json:
            print(json.dumps([b.raw for b in batches], indent=2))
            return 0
        print(f"{'ID':<32} {'STATUS':<11} {'DONE':>13} {'FAILED':>7} {'AGE':>5}  ENDPOINT")
        for b in batches:
            c = b.request_counts
            print(f"{b.id:<32} {b.status:<11} {f'{c.completed + c.failed}/{c.total}':>13} {c.failed:>7} "
                  f"{_age(b.created_at):>5}  {b.endpoint}")
        return 0
