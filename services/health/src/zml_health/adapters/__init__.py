"""Engine adapters: each reads one serving engine's own endpoints and metric names.

``probe(client, endpoint, timeout, poll) -> Probe``; a probe never raises for a node problem,
it reports it (``poll`` counts the node's polls, for checks run only every Nth time).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from zml_health.adapters.base import Probe
from zml_health.adapters.llamacpp import probe as probe_llamacpp
from zml_health.adapters.openai import probe as probe_openai
from zml_health.adapters.sglang import probe as probe_sglang
from zml_health.adapters.tgi import probe as probe_tgi
from zml_health.adapters.vllm import probe as probe_vllm

ProbeFn = Callable[[httpx.AsyncClient, str, float, int], Awaitable[Probe]]

ADAPTERS: dict[str, ProbeFn] = {
    "vllm": probe_vllm,
    "tgi": probe_tgi,
    "sglang": probe_sglang,
    "llamacpp": probe_llamacpp,
    "openai": probe_openai,
}


def adapter_for(backend: str) -> ProbeFn:
    return ADAPTERS.get(backend, probe_openai)


__all__ = ["ADAPTERS", "Probe", "ProbeFn", "adapter_for"]
