"""Flow control for a shared fleet: pure decisions, no I/O, time passed in (docs/routing.md,
"Flow control").

- ``bands``: priority bands (critical > standard > sheddable > batch) and a key's ceiling;
- ``shares``: token-fair shares between tenants (decayed weighted-token counters, merged across
  router replicas over NATS);
- ``slo``: SLO admission (predicted TTFT / TPOT per node, and per prefill/decode pair when no
  node meets it; SLO_UNATTAINABLE when nothing does);
- ``order``: the saturation queue's order (band, then least service per weight, then arrival),
  aging and displacement (SHED);
- ``ask``: what a request asks (band, tenant, weight, targets) from its headers and the config.

The router runs these, and so does the flow simulator (benches/flow_sim.py): what is measured
is what ships.
"""

from zmlcore.flowctl.ask import Ask, ask_of
from zmlcore.flowctl.bands import BATCH, CRITICAL, NAMES, SHEDDABLE, STANDARD, band_of, claim, name_of
from zmlcore.flowctl.order import Waiting, displaced, effective_band, pick, ranked
from zmlcore.flowctl.shares import ShareBook
from zmlcore.flowctl.slo import Calibration, Pairs, Slo, SloVerdict, admit_slo, model_tpot, predict_tpot, queue_budget_s, tpot_at

__all__ = [
    "BATCH",
    "CRITICAL",
    "NAMES",
    "SHEDDABLE",
    "STANDARD",
    "Ask",
    "Calibration",
    "Pairs",
    "ShareBook",
    "Slo",
    "SloVerdict",
    "Waiting",
    "admit_slo",
    "ask_of",
    "band_of",
    "claim",
    "displaced",
    "effective_band",
    "model_tpot",
    "name_of",
    "pick",
    "predict_tpot",
    "queue_budget_s",
    "ranked",
    "tpot_at",
]
