"""What the placement planner reads and what it answers (plain data, no I/O).

A :class:`NodeOffer` is one node as the planner sees it: its price, how many models it may
hold at once (``slots``: 1 for an engine started with one model, llama.cpp router mode's
``--models-max``), its memory, and the requests per second it can serve *within each model's
SLO* (:func:`zmlcore.placement.capacity.slo_capacity`, from the node's measured speeds). A
:class:`ModelDemand` is one model's traffic over the planning window; an
:class:`AdapterDemand` one LoRA adapter's, whose requests run on its base model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class NodeOffer:
    node_id: str
    #: The node's family (for the operator's advice only: the planner never reads a name).
    family: str
    cost_per_hour: float
    #: model -> requests/s this node serves within the model's SLO when it holds only that
    #: model (0 or absent: it cannot: too slow for the SLO, or the weights do not fit).
    capacity: dict[str, float]
    #: Models the engine may hold at once; their capacities share the node's time.
    slots: int = 1
    #: Adapters the engine may hold at once (vLLM ``--max-loras``); 0: no adapters.
    adapter_slots: int = 0
    #: What the node holds now (the plan's stability term counts changes from it).
    models: frozenset[str] = frozenset()
    adapters: frozenset[str] = frozenset()
    #: The engine holds the adapters it was started with and can load no other (llama.cpp:
    #: ``--lora`` files, picked per request by id): ``adapters`` are all it will ever hold, on
    #: the nodes where their base model stays.
    adapters_fixed: bool = False


@dataclass(frozen=True, slots=True)
class ModelDemand:
    model: str
    #: Requests/s over the window, its adapters' requests excluded (the planner adds them).
    rate: float
    #: Replicas kept even without demand (0: a model with no demand may be unloaded everywhere).
    min_replicas: int = 0


@dataclass(frozen=True, slots=True)
class AdapterDemand:
    adapter: str
    base: str
    rate: float


@dataclass(frozen=True, slots=True)
class PlanParams:
    #: $/h a plan must save per model load or unload it asks for (hysteresis: a tiny gain
    #: does not move a model). 0: every saving counts.
    move_cost_per_h: float = 0.25
    #: $/h charged per request/s a plan leaves unserved (far above any node's price, so the
    #: solver serves all demand the fleet can).
    unserved_cost_per_rps: float = 1e4
    #: Solver time limit, seconds.
    time_limit_s: float = 5.0
    #: The solver stops when its answer is proven within this fraction of the optimum's cost.
    #: 0.5%: a 1,000-node day's plan takes ~0.2 s CPU where proving 0.1% took ~1.6 s, for $3 of
    #: $1,400/h (benches/placement_day.py --fluid); small fleets are solved exactly either way.
    mip_rel_gap: float = 5e-3
    #: Nodes whose capacities differ by less than this ratio are planned as one class (their
    #: capacity is the class's lowest): the problem then grows with the fleet's kinds, not its size.
    capacity_bucket: float = 0.05


@dataclass(frozen=True, slots=True)
class Placement:
    #: node -> models it should hold (absent or empty: idle, may sleep or be released).
    models: dict[str, frozenset[str]]
    adapters: dict[str, frozenset[str]]
    #: $/h of the nodes the plan keeps busy.
    cost_per_hour: float
    #: model -> requests/s of SLO capacity the plan gives it (including its adapters' traffic).
    capacity: dict[str, float]
    #: model -> requests/s the fleet cannot serve within SLO (advice: add nodes).
    unserved: dict[str, float]
    #: Loads + unloads from the current placement.
    moves: int
    solve_s: float = 0.0
    status: str = ""
    notes: list[str] = field(default_factory=list)

    def nodes_of(self, model: str) -> list[str]:
        return sorted(n for n, ms in self.models.items() if model in ms)
