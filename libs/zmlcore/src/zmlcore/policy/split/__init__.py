"""Disaggregated prefill/decode: which nodes can hand KV to which (``links``) and, per
request, whether to split and over which pair (``decide``). Pure, like the rest of
``zmlcore.policy``; docs/disaggregation.md."""

from zmlcore.policy.split.decide import Option, SplitDecision, SplitSettings, decide_split, objective_of
from zmlcore.policy.split.index import SplitIndex
from zmlcore.policy.split.links import KVLinks

__all__ = ["KVLinks", "Option", "SplitDecision", "SplitIndex", "SplitSettings", "decide_split", "objective_of"]
