"""Placement: which models and LoRA adapters each node holds, planned from demand, measured
speeds and prices (:func:`plan`), and the make-before-break steps that get the fleet there
(:func:`next_steps`). Pure: the warmup service feeds it and executes its steps.

    from zmlcore.placement import NodeOffer, ModelDemand, plan, next_steps
    target = plan(offers, demands)
    steps = next_steps(current, target.models, serving)
"""

from zmlcore.placement.adapters import place_adapters
from zmlcore.placement.capacity import slo_capacity
from zmlcore.placement.inputs import AdapterDemand, ModelDemand, NodeOffer, Placement, PlanParams
from zmlcore.placement.solve import evaluate, plan, total_demand

__all__ = ["AdapterDemand", "ModelDemand", "NodeOffer", "Placement", "PlanParams", "evaluate", "place_adapters",
           "plan", "slo_capacity", "total_demand"]
