"""`zml nodes`: the fleet as the health service sees it (GET /v1/nodes or NATS)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from zml._client import Client
from zml.cli._bus import add_bus_args
from zml.cli._common import add_client_args, client_kwargs

COLUMNS = ("NODE", "TYPE", "FAMILY", "MODELS", "HEALTH", "QUEUE", "STATE", "COOLDOWN", "SPEED", "CACHE",
           "ROLES", "ENDPOINT", "NOTE")

DESCRIPTION = """\
Show the fleet as the health service and the routers see it, one row per node.

  MODELS    the models it serves; (loading: ...) being loaded; (missing: ...) configured for
            it (zml.toml, --serves) but not served by its engine (NOTE says why when known)
  HEALTH    score 0-100 from the error rate and the queue (0 when not up)
  QUEUE     requests running + waiting on the engine, as of the last poll
  STATE     up, loading, down or invalid; when not up: for how long (since its last good
            probe) and why, as the health service's probe found it; (asleep): the engine slept
  COOLDOWN  seconds the routers still skip it after a failure (- none)
  SPEED     PREFILL/DECODE tokens/s:SOURCE[:AGE][:CONFIDENCE], the health service's
            learned estimate the routers estimate time to first token with (its busiest
            model's; --json's model_speeds has each model's). SOURCE: measured (the engine's
            counters, its per-request timings or a calibration request), learned (only from
            the routers' observations of requests) or default (the accelerator type's
            profile: nothing seen yet); AGE: since the estimate last moved; CONFIDENCE: the
            chance both speeds are within 25% (an uncertain node is explored: docs/routing.md
            "Learned speeds"). 12.5k = 12,500.
  CACHE     FIDELITY[:BLOCKSxBLOCK_TOKENS][:HIT%][:events-down], e.g. reported:32768x1:65%.
            FIDELITY, how routers know what its prefix cache holds: precise (its KV events
            are bridged), reported (its replies say how many prompt tokens were cached),
            approximate (the routers' own decisions only). BLOCKS x BLOCK_TOKENS: the cache
            size its engine reports (tokens = their product). HIT%: share of prompt tokens its
            engine served from the cache over the last poll. events-down: the KV-event bridge
            is down.
  ROLES     legs of a disaggregated request it takes (docs/disaggregation.md): both,
            prefill or decode; @GROUP:GBPS when it can hand KV to the other nodes of its
            kv_group over a link of that many Gbit/s, e.g. prefill@g1:400.
  NOTE      what does not stop routing but an operator should know (no node probe: hardware
            not validated; slow; its engine calls its model by another name...)
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("nodes", help="show the accelerator fleet", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
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
    a.add_argument("--roles", help="legs of a disaggregated request it takes: prefill, decode, or prefill,decode "
                                   "(the default: both; docs/disaggregation.md)")
    a.add_argument("--kv-group", help="nodes of one group can hand KV to each other (same model, compatible "
                                      "KV connector)")
    a.add_argument("--kv-gbps", type=float, help="its KV transfer link's bandwidth, Gbit/s (with --kv-group)")
    a.add_argument("--kv-bootstrap-port", type=int, help="SGLang prefill node: its --disaggregation-bootstrap-port")
    a.add_argument("--replace", action="store_true", help="overwrite a node with the same id")
    a.add_argument("--wait", type=float, default=10.0, metavar="SECONDS",
                   help="add: wait this long for the node's first poll and say what it serves; exit 1 when it "
                        "does not serve what it was added for (its engine names the model otherwise: "
                        "--served-name) or fails hardware validation (default 10; 0: do not wait)")
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
           "probe_endpoint": args.probe_endpoint, "served_names": names or None,
           "roles": [r.strip() for r in args.roles.split(",") if r.strip()] if args.roles else None,
           "kv_group": args.kv_group, "kv_gbps": args.kv_gbps, "kv_bootstrap_port": args.kv_bootstrap_port}
    try:
        spec = msgspec.convert({k: v for k, v in raw.items() if v is not None}, NodeSpec)
    except msgspec.ValidationError as exc:
        raise BadRequestError(f"invalid node: {with_choices(NodeSpec, str(exc))}") from exc

    async def add_and_watch() -> dict[str, Any] | None:
        async with operator_nats(target) as nc:
            await add_node(nc, spec, replace=args.replace)
            return await first_poll(nc, args.node_id, args.wait)

    state = asyncio.run(add_and_watch())
    code, out, err = after_add(args.node_id, f"{args.accelerator} at {args.node_url}", state, args.wait)
    print(out)
    if err:
        print(err, file=sys.stderr)
    return code


async def first_poll(nc: Any, node_id: str, wait_s: float) -> dict[str, Any] | None:
    """The node's state once the health service has polled it (None: not within ``wait_s``)."""
    import asyncio

    import msgspec

    from zmlcore.fleet.registry import list_nodes

    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while loop.time() < deadline:
        for st in await list_nodes(nc):
            if st.node_id == node_id and st.status != "unknown":
                return msgspec.to_builtins(st)  # type: ignore[no-any-return]
        await asyncio.sleep(0.2)
    return None


def after_add(node_id: str, what: str, state: dict[str, Any] | None, wait_s: float) -> tuple[int, str, str]:
    """(exit code, stdout line, stderr line) for a node just added, from its first polled state:
    exit 1 when it will not serve what it was added for (its engine names the model otherwise,
    or its hardware is not what was declared)."""
    added = f"{node_id}: added ({what})"
    if state is None:
        waited = f"; not polled within {wait_s:g} s" if wait_s > 0 else ""
        return 0, f"{added}{waited}: `zml nodes` shows it after its first poll", ""
    status, models = state.get("status", "unknown"), state.get("models") or []
    missing, unknown = state.get("missing_models") or [], state.get("unknown_models") or []
    why = f" ({state['reason']})" if state.get("reason") else ""
    if status == "invalid":
        return 1, f"{added}; refused by hardware validation", f"zml nodes: {node_id} is invalid{why}: it gets no traffic"
    if status == "loading":
        return 0, f"{added}; its engine is loading: `zml nodes` shows when it is up", ""
    if status == "down":
        return 0, f"{added}; down at its first poll{why}: it gets traffic once its engine answers", ""
    serving = f"serving {', '.join(models)}" if models else "serving nothing yet"
    if missing and unknown:
        return 1, f"{added}; {serving}", (
            f"zml nodes: {node_id} does not serve {', '.join(map(repr, missing))}: its engine calls its models "
            f"{', '.join(map(repr, unknown))}, no model of the fleet's (not routed, not in /v1/models). Give the "
            f"engine's name: run this command again with --served-name {missing[0]}={unknown[0]} --replace")
    if missing:
        return 0, f"{added}; {serving}", (f"zml nodes: {node_id} does not serve {', '.join(map(repr, missing))} yet: "
                                          f"`zml serve {missing[0]} --nodes {node_id}` loads it where its engine can")
    return 0, f"{added}; {serving}", ""


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


def _roles(n: dict[str, Any]) -> str:
    """``both``, ``prefill`` or ``decode``, then ``@GROUP:GBPS`` for a node in a kv_group."""
    roles = n.get("roles") or []
    out = "both" if not roles or set(roles) == {"prefill", "decode"} else ",".join(roles)
    if n.get("kv_group"):
        gbps = n.get("kv_gbps")
        out += f"@{n['kv_group']}" + (f":{float(gbps):g}" if isinstance(gbps, (int, float)) and gbps else "")
    return out


def _age(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.0f}h"


def _tps(v: Any) -> str:
    if not isinstance(v, (int, float)) or v <= 0:
        return "?"
    return f"{v / 1000:.1f}k" if v >= 10_000 else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def speeds_source(n: dict[str, Any]) -> str:
    """Where a node's speeds come from; a health service older than ``speeds_source`` only says
    whether they were measured."""
    return str(n.get("speeds_source") or ("measured" if n.get("speeds_measured") else "default"))


def _speed(n: dict[str, Any], now: float) -> str:
    """``PREFILL/DECODE:SOURCE[:AGE][:CONFIDENCE]``: ``9.8k/58:measured:4s``."""
    parts = [f"{_tps(n.get('prefill_tps'))}/{_tps(n.get('decode_tps'))}", speeds_source(n)]
    at = n.get("speeds_at")
    if isinstance(at, (int, float)) and at > 0:
        parts.append(_age(max(0.0, now - at)))
    conf = n.get("speeds_confidence")
    if isinstance(conf, (int, float)) and conf > 0:
        parts.append(f"{conf * 100:.0f}%")
    return ":".join(parts)


def _state(n: dict[str, Any], now: float) -> str:
    state = str(n.get("status", "unknown"))
    if state in ("down", "invalid", "loading"):
        last_ok = n.get("last_ok")
        if state != "loading" and isinstance(last_ok, (int, float)) and last_ok > 0:
            state += f" {_age(max(0.0, now - last_ok))}"
        if n.get("reason"):
            state += f" ({n['reason']})"
    if n.get("sleeping"):
        state += " (asleep)"
    return state


def rows(nodes: list[dict[str, Any]], now: float) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = []
    for n in nodes:
        models = ",".join(n.get("models") or []) or "-"
        if n.get("loading_models"):
            models += " (loading: " + ",".join(n["loading_models"]) + ")"
        if n.get("missing_models") and n.get("status") == "up":
            models += " (missing: " + ",".join(n["missing_models"]) + ")"
        queue = int(n.get("queue_running", 0)) + int(n.get("queue_waiting", 0))
        out.append((
            str(n.get("node_id", "?")), str(n.get("accelerator_type", "")), str(n.get("family", "")), models,
            f"{float(n.get('health_score', 0.0)):.0f}", str(queue), _state(n, now), _cooldown(n, now),
            _speed(n, now), _cache(n), _roles(n), str(n.get("endpoint") or "-"), str(n.get("note") or "-"),
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
