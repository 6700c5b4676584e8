"""`zml nodes`: the fleet as the health service sees it (GET /v1/nodes or NATS)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from zml._client import Client
from zml.cli._common import add_client_args, client_kwargs

COLUMNS = ("NODE", "TYPE", "FAMILY", "MODELS", "HEALTH", "QUEUE", "STATE", "COOLDOWN")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("nodes", help="show the accelerator fleet", description="Show the fleet: node, type, "
                       "models, health score, queue depth (running+waiting), state and cooldown.")
    p.add_argument("--json", action="store_true", help="print the node list as JSON")
    add_client_args(p, retries=1)
    p.set_defaults(func=run)


def _cooldown(n: dict[str, Any], now: float) -> str:
    for key in ("cooldown_remaining_s", "cooldown_s"):
        if isinstance(n.get(key), (int, float)):
            return f"{float(n[key]):.1f}s" if n[key] > 0 else "-"
    until = n.get("cooldown_until")
    if isinstance(until, (int, float)) and until > now:
        return f"{until - now:.1f}s"
    return "-"


def rows(nodes: list[dict[str, Any]], now: float) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for n in nodes:
        models = ",".join(n.get("models") or []) or "-"
        if n.get("loading_models"):
            models += " (loading: " + ",".join(n["loading_models"]) + ")"
        state = str(n.get("status", "unknown"))
        if n.get("reason") and state != "up":
            state += f" ({n['reason']})"
        queue = int(n.get("queue_running", 0)) + int(n.get("queue_waiting", 0))
        out.append((
            str(n.get("node_id", "?")), str(n.get("accelerator_type", "")), str(n.get("family", "")), models,
            f"{float(n.get('health_score', 0.0)):.0f}", str(queue), state, _cooldown(n, now),
        ))
    return out


def render(nodes: list[dict[str, Any]], now: float | None = None) -> str:
    table = [COLUMNS, *rows(nodes, time.time() if now is None else now)]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def run(args: argparse.Namespace) -> int:
    with Client(**client_kwargs(args)) as client:
        nodes = client._nodes_raw()
    if args.json:
        print(json.dumps(nodes, indent=2))
    elif not nodes:
        print("no nodes registered (add [[nodes]] to zml.toml)")
    else:
        print(render(nodes))
    return 0
