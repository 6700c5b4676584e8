#!/usr/bin/env python3
"""Per-run detail of a ``benches/real_fleet.py --save`` file: what each run's table row does not
show. For every run: the box load, the engines' batch-1 speeds, ZML's estimates before the
workload (what its first burst was split on), where the first turns went, the prompt tokens the
engines computed beyond the replies' own (requests ZML's health service sent during the
workload), and ZML's TTFT predicted at dispatch against the router's observed (median of
``|observed - predicted| / observed``, first turns and follow-ups apart).

    .venv/bin/python benches/real_fleet_detail.py $SCRATCH/real_fleet.json
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any


def error(rows: list[tuple[float, float]]) -> str:
    return f"{statistics.median(abs(o - p) / o for p, o in rows):.0%}" if rows else "-"


def detail(run: dict[str, Any]) -> list[str]:
    out = [f"{run['router']} round {run['round']}: load {run['loadavg_1m']}, TTFT p50 {run['ttft_p50_s']}, "
           f"follow-up p90 {run['followup_ttft_p90_s']}, first-turn p50 {run['first_turn_ttft_p50_s']}, "
           f"wall {run['wall_s']}"]
    eng = run.get("engine_speeds") or {}
    out.append("  engines (batch 1): " + ", ".join(f"{n} {s['prompt_tps']:,} / {s['decode_tps']:,}" for n, s in eng.items()))
    for n, v in (run.get("zml_nodes_before") or {}).items():
        m = next(iter((v.get("model_speeds") or {}).values()), None) or v
        out.append(f"  ZML before, {n}: prefill {m['prefill_tps']:,.0f} decode {m['decode_tps']:,.0f} tok/s")
    reqs = run["requests_detail"]
    computed = sum(run["uncached_prompt_tokens"].values())
    replied = sum((r.get("timings") or {}).get("prompt_n", 0) for r in reqs)
    out.append(f"  prompt tokens computed {computed:,}, of them the replies' own {replied:,} "
               f"(other requests: {computed - replied:,})")
    first: dict[str, int] = {}
    pred: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for r in reqs:
        if r["turn"] == 0 and r.get("node"):
            first[r["node"]] = first.get(r["node"], 0) + 1
        h = r.get("zml_headers") or {}
        if h.get("predicted-ttft-ms") and h.get("time-to-first-token"):
            pred[r["turn"] == 0].append((float(h["predicted-ttft-ms"]) / 1000, float(h["time-to-first-token"])))
    if first:
        out.append(f"  first turns by node: {first}; requests by node: {run.get('served_by')}")
    if pred[True] or pred[False]:
        out.append(f"  TTFT prediction error (median): all {error(pred[True] + pred[False])}, "
                   f"first turns {error(pred[True])}, follow-ups {error(pred[False])}")
    return out


def main() -> int:
    data = json.load(open(sys.argv[1]))
    print(f"{data['date']}, load {data['loadavg_at_start']} -> {data['loadavg_at_end']}: {data['command']}")
    for run in sorted(data["runs"], key=lambda r: (r["router"], r["round"])):
        print("\n".join(detail(run)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
