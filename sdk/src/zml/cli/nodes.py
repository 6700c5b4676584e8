"""`zml nodes`: the fleet as the health service sees it (GET /v1/nodes or NATS)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from zml._client import Client
from zml.cli._bus import add_bus_args
from zml.cli._common import add_client_args, client_kwargs

COLUMNS = ("NODE", "TYPE", "FAMILY", "MODELS", "HEALTH", "QUEUE", "STATE", "COOLDOWN", "CACHE", "ENDPOINT")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("nodes", help="show the accelerator fleet", description="Show the fleet: node, type, "
                       "models, health score, queue depth (running+waiting), state, cooldown and endpoint.")
    p.add_argument("action", nargs="?", choices=("list", "add", "remove"), default="list",
                   help="list (default), add a node at run time, or remove one")
    p.add_argument("node_id", nargs="?", help="add/remove: the node id")
    p.add_argument("--json", action="store_true",
                   help='print {"nodes": [...]}, the object GET /v1/nodes answers (not a bare list: '
                        "`jq '.nodes[]'` reads it)")
    a = p.add_argument_group("add / remove (a request to the health service over NATS; survives its restarts)")
    a.add_argument("--accelerator", help="type ID: nvidia_h100, nvidia_a100, amd_mi300x, intel_gaudi2, aws_inferentia2, cpu")
    a.add_argument("--url", dest="node_url", help="the engine's base URL, e.g. http://10.0.0.9:8000")
    a.add_argument("--backend", default="vllm", type=_backend,
                   help="vllm, tgi, sglang, llamacpp (llama.cpp's llama-server) or openai (default vllm)")
    a.add_argument("--serves", action="append", default=[], metavar="MODEL", help="a model it serves (repeatable)")
    a.add_argument("--served-name", action="append", default=[], metavar="MODEL=NAME",
                   help="the engine's own name for a model it serves, e.g. "
                        "llama-3-8b=/models/Meta-Llama-3-8B.gguf (repeatable)")
    a.add_argument("--family", help="family for policy chains (default: the accelerator's)")
    a.add_argument("--cost-per-hour", type=float, help="price (default: the accelerator's list price)")
    a.add_argument("--probe-endpoint", help="node probe (zml node-agent) URL")
    a.add_argument("--replace", action="store_true", help="overwrite a node with the same id")
    add_bus_args(a, config=False, data_dir=False)
    add_client_args(p, retries=1)
    p.set_defaults(func=run)


def _backend(text: str) -> str:
    from zmlcore.config import BACKENDS, canonical_backend

    name = canonical_backend(text)
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown engine {text!r} (one of: {', '.join(BACKENDS)})")
    return name


def _admin(args: argparse.Namespace) -> int:
    import asyncio

    import msgspec

    from zml.cli._bus import operator_nats, resolve
    from zmlcore.config import with_choices
    from zmlcore.errors import BadRequestError
    from zmlcore.fleet.registry import add_node, remove_node
    from zmlcore.messages import NodeSpec

    if not args.node_id:
        raise BadRequestError(f"zml nodes {args.action} needs a node id")
    target = resolve(nats_url=args.nats_url, config_path=args.config_path, data_dir=args.data_dir)

    async def call(fn: Any, *a: Any, **kw: Any) -> Any:
        async with operator_nats(target) as nc:
            return await fn(nc, *a, **kw)

    if args.action == "remove":
        asyncio.run(call(remove_node, args.node_id))
        print(f"{args.node_id}: removed")
        return 0
    if not (args.accelerator and args.node_url):
        raise BadRequestError("zml nodes add needs --accelerator and --url")
    names = served_names(args.served_name)
    unserved = sorted(set(names) - set(args.serves))
    if unserved:
        raise BadRequestError(f"--served-name for {unserved[0]!r}, which is not given with --serves")
    raw = {"id": args.node_id, "accelerator": args.accelerator, "endpoint": args.node_url, "backend": args.backend,
           "models": args.serves, "family": args.family, "cost_per_hour": args.cost_per_hour,
           "probe_endpoint": args.probe_endpoint, "served_names": names or None}
    try:
        spec = msgspec.convert({k: v for k, v in raw.items() if v is not None}, NodeSpec)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"invalid node: {with_choices(NodeSpec, str(exc))}") from exc
    asyncio.run(call(add_node, spec, replace=args.replace))
    print(f"{args.node_id}: added ({args.accelerator} at {args.node_url}); `zml nodes` shows it after its first poll")
    return 0


def served_names(pairs: list[str]) -> dict[str, str]:
    """``["MODEL=NAME", ...]`` -> ``{MODEL: NAME}`` (the name may itself contain ``=``)."""
    from zmlcore.errors import BadRequestError

    out: dict[str, str] = {}
    for pair in pairs:
        model, sep, name = pair.partition("=")
        if not sep or not model.strip() or not name.strip():
            raise BadRequestError(f"--served-name {pair!r}: expected MODEL=ENGINE_NAME")
        out[model.strip()] = name.strip()
    return out


def _cooldown(n: dict[str, Any], now: float) -> str:
    for key in ("cooldown_remaining_s", "cooldown_s"):
        if isinstance(n.get(key), (int, float)):
            return f"{float(n[key]):.1f}s" if n[key] > 0 else "-"
    until = n.get("cooldown_until")
    if isinstance(until, (int, float)) and until > now:
        return f"{until - now:.1f}s"
    return "-"


def _cache(n: dict[str, Any]) -> str:
    """How routers know the node's prefix cache, its size (blocks x tokens a block) and the
    share of prompt tokens its engine served from it lately: ``precise:8192x64:42%``."""
    parts = [str(n.get("cache_fidelity") or "-")]
    bs, blocks = n.get("kv_block_size"), n.get("kv_blocks")
    if isinstance(bs, int) and isinstance(blocks, int) and bs and blocks:
        parts.append(f"{blocks}x{bs}")
    hit = n.get("prefix_cache_hit_rate")
    if isinstance(hit, (int, float)):
        parts.append(f"{hit * 100:.0f}%")
    events = n.get("kv_events")
    if isinstance(events, str) and events.startswith("down"):
        parts.append("events-down")
    return ":".join(parts)


def rows(nodes: list[dict[str, Any]], now: float) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for n in nodes:
        models = ",".join(n.get("models") or []) or "-"
        if n.get("loading_models"):
            models += " (loading: " + ",".join(n["loading_models"]) + ")"
        state = str(n.get("status", "unknown"))
        if n.get("reason") and state != "up":
            state += f" ({n['reason']})"
        if n.get("sleeping"):
            state += " (asleep)"
        queue = int(n.get("queue_running", 0)) + int(n.get("queue_waiting", 0))
        out.append((
            str(n.get("node_id", "?")), str(n.get("accelerator_type", "")), str(n.get("family", "")), models,
            f"{float(n.get('health_score', 0.0)):.0f}", str(queue), state, _cooldown(n, now), _cache(n),
            str(n.get("endpoint") or "-"),
        ))
    return out


def render(nodes: list[dict[str, Any]], now: float | None = None) -> str:
    table = [COLUMNS, *rows(nodes, time.time() if now is None else now)]
    widths = [max(len(r[i]) for r in table) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table)


def run(args: argparse.Namespace) -> int:
    if args.action != "list":
        return _admin(args)
    with Client(**client_kwargs(args)) as client:
        nodes = client._nodes_raw()
    if args.json:
        print(json.dumps({"nodes": nodes}, indent=2))  # GET /v1/nodes' shape, whatever the transport
    elif not nodes:
        print("no nodes registered (add [[nodes]] to zml.toml)")
    else:
        print(render(nodes))
    return 0
