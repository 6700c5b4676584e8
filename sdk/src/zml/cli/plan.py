"""`zml plan [--fresh] [--json]`: the placement planner's current and proposed placement.

Asks the warmup service (NATS ``zml.warmup.plan``) and prints, per model, its demand, the nodes
holding it now and in the plan, its SLO capacity and predicted SLO attainment both ways; the
$/h now and planned; the moves (each with what it waits for in apply mode); and the advice
(nodes to add or release per family). Nothing moves unless ``[planner] mode = "apply"``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from zml.cli._bus import Target, add_bus_args, resolve


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("plan", help="show the placement planner's plan: models per node now and proposed, $/h, "
                                    "moves", description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--fresh", action="store_true", help="plan again now instead of showing the last plan")
    p.add_argument("--json", action="store_true", help="print the plan as JSON (PlanReply)")
    add_bus_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = resolve(nats_url=args.nats_url, config_path=args.config, data_dir=args.data_dir)
    return asyncio.run(show(target, fresh=args.fresh, as_json=args.json))


async def show(target: Target, *, fresh: bool = False, as_json: bool = False, out: Any = None) -> int:
    import msgspec
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from zml.cli._bus import check_denied, operator_nats
    from zmlcore import subjects
    from zmlcore.errors import ErrorBody, from_wire
    from zmlcore.messages.placement import PlanRequest, plan_reply_decoder

    stream = out or sys.stdout
    async with operator_nats(target) as nc:
        try:
            msg = await nc.request(subjects.WARMUP_PLAN, msgspec.json.encode(PlanRequest(fresh=fresh)), timeout=30.0)
        except NoRespondersError:
            print("zml plan: no warmup service answers (start `zml warmup`, or use `zml up`)", file=stream)
            return 2
        except NatsTimeout:
            check_denied(nc, target)
            print("zml plan: the warmup service did not answer in time", file=stream)
            return 1
    if msg.headers and subjects.H_ERROR_CODE in msg.headers:
        raise from_wire(msgspec.json.decode(msg.data, type=ErrorBody).error)
    rep = plan_reply_decoder.decode(msg.data)
    if as_json:
        print(msgspec.json.encode(rep).decode(), file=stream)
        return 0
    for line in render(rep):
        print(line, file=stream)
    return 0


def render(rep: Any) -> list[str]:
    """The plan as lines of text (``rep``: a PlanReply)."""
    if not rep.planned_at:
        return [f"planner mode {rep.mode}: {rep.message or 'no plan yet'}"]
    lines = [f"planner mode {rep.mode}: ${rep.cost_now_per_h:.2f}/h now, ${rep.cost_plan_per_h:.2f}/h planned "
             f"({len(rep.moves)} move(s), solved in {rep.solve_s * 1000:.0f} ms)"]
    lines.append(f"{'MODEL':<24} {'REQ/S':>7} {'SLO NOW':>8} {'SLO PLAN':>9}  NODES NOW -> PLANNED")
    for m in rep.models:
        lines.append(f"{m.model:<24} {m.demand_rps:>7.2f} {m.slo_now:>8.1%} {m.slo_plan:>9.1%}  "
                     f"{','.join(m.nodes_now) or '-'} -> {','.join(m.nodes_plan) or '-'}")
    if rep.adapters_plan or rep.adapters_now:
        lines.append("adapters:")
        for node in sorted(set(rep.adapters_now) | set(rep.adapters_plan)):
            lines.append(f"  {node}: {','.join(rep.adapters_now.get(node, [])) or '-'} -> "
                         f"{','.join(rep.adapters_plan.get(node, [])) or '-'}")
    if rep.moves:
        lines.append("moves (make before break):")
        for mv in rep.moves:
            verb = mv.kind.replace("_", " ")
            lines.append(f"  {verb} {mv.name} on {mv.node_id}" + (f"  (waits: {mv.waiting})" if mv.waiting else ""))
    if rep.blocked:
        lines.append("blocked: the remaining moves need a spare node (each waits for another)")
    for a in rep.advice:
        lines.append(f"advice: {a}")
    return lines
