"""What one poll of a node found, and the helpers every adapter shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass(slots=True)
class Probe:
    """What one poll of a node found. An adapter never raises for a node problem: it says so."""

    ok: bool
    #: The engine says it is starting / loading a model (not a failure of the node).
    loading: bool = False
    #: The probe timed out: the node may just be busy (counts towards "down", not the error rate).
    slow: bool = False
    #: The engine put its model to sleep (llama.cpp --sleep-idle-seconds, vLLM sleep mode).
    sleeping: bool = False
    models: list[str] = field(default_factory=list)
    #: Models the engine says it is loading (llama.cpp router mode).
    loading_models: list[str] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    #: Engine-reported capacity (sequences decoded together), when the engine says.
    max_concurrency: int | None = None
    #: Monotonic counters from /metrics (None: the engine does not expose them).
    generation_tokens_total: float | None = None
    requests_ok_total: float | None = None
    requests_failed_total: float | None = None
    ttft_sum: float | None = None
    ttft_count: float | None = None
    #: For measured speeds: prompt tokens, and vLLM's prefill/decode interval histograms
    #: with the finished requests' generated tokens (sum and count).
    prompt_tokens_total: float | None = None
    prefill_time_sum: float | None = None
    decode_time_sum: float | None = None
    request_gen_tokens_sum: float | None = None
    request_gen_tokens_count: float | None = None
    #: llama.cpp: decode steps, and busy slots summed over them (the window's batch size is
    #: their ratio); None: the running count stands for the batch size.
    decode_steps_total: float | None = None
    busy_slot_steps_total: float | None = None
    #: Prefix cache, as the engine reports it: prompt tokens looked up and found (counters), and
    #: its size (tokens per block, blocks; vLLM's ``cache_config_info``, llama.cpp's slots x n_ctx
    #: at one token per "block").
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    kv_block_size: int | None = None
    kv_cache_blocks: int | None = None
    #: llama.cpp router mode: each model it lists (its engine name) with the ``--lora`` files its
    #: instance is launched with (from a ``--models-preset`` section's ``lora``), in id order;
    #: None: not router mode.
    model_loras: dict[str, list[str]] | None = None
    error: str = ""


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def failure(exc: httpx.HTTPError, what: str) -> Probe:
    """A transport error as a probe result: a timeout is "slow", anything else a failure."""
    if isinstance(exc, httpx.TimeoutException):
        return Probe(ok=False, slow=True, error=f"{what} timed out")
    return Probe(ok=False, error=f"{what}: {describe(exc)}")


def model_ids(payload: Any) -> list[str]:
    """Model ids from an OpenAI ``/v1/models`` body."""
    data = payload.get("data", []) if isinstance(payload, dict) else []
    return [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]


async def get_models(client: httpx.AsyncClient, endpoint: str, timeout: float) -> list[str]:
    resp = await client.get(endpoint + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    return model_ids(resp.json())


def first(metrics: dict[str, float], *names: str) -> float | None:
    """The first of ``names`` present (engines renamed metrics across releases)."""
    for name in names:
        if name in metrics:
            return metrics[name]
    return None


def error_message(resp: httpx.Response) -> str:
    """The engine's error message, whatever its error shape (OpenAI, TGI, llama.cpp)."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:200]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", ""))
        if isinstance(err, str):
            return err
        if isinstance(body.get("message"), str):
            return str(body["message"])
    return resp.text[:200]
