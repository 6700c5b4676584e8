"""llama.cpp server (llama-server): ``/health``, ``/v1/models``, ``/props``, ``/metrics``.

Only endpoints that do not wake a sleeping server (``--sleep-idle-seconds``) are polled: llama.cpp
answers ``/health``, ``/props``, ``/v1/models`` and ``/metrics`` from a cache while asleep and
does not count them as activity, whereas ``/slots`` queues a task that reloads the model.

* ``/health`` answers 503 ``{"error": {"code": 503, "message": "Loading model", ...}}`` while the
  model loads: "loading".
* ``/v1/models``: a single-model server lists its model; router mode (no ``--model``) lists every
  model it can load with ``status.value``: "loaded" and "sleeping" ones are served (a request
  wakes a sleeping one), "loading" ones are loading, the rest are not served.
* ``/props`` gives the capacity (``total_slots``: one per parallel sequence) and ``is_sleeping``.
* ``/metrics`` (only with ``--metrics``): ``llamacpp:requests_processing`` (running),
  ``llamacpp:requests_deferred`` (waiting), and the counters that give measured speeds:
  ``prompt_tokens_total`` / ``prompt_seconds_total`` (prefill tokens/s) and
  ``tokens_predicted_total`` / ``tokens_predicted_seconds_total`` (decode tokens/s of one
  sequence), with ``n_decode_total`` and ``n_busy_slots_per_decode`` (mean sequences per decode
  step since start) giving the batch size of each window, to divide decode back to batch 1.
  Times are summed per slot, so both are per-sequence speeds.

LoRA adapters (``--lora FILE``, one id per file in the order given) are read from
``GET /lora-adapters`` (:func:`read_loras`), once per engine start, not every poll: it queues a
task on the server, which counts as activity for ``--sleep-idle-seconds`` (and waits for a
sleeping server to wake), and the list cannot change while the server runs: llama-server loads
no adapter after start. ``POST /lora-adapters`` only sets the global scales of those adapters.
In router mode ``/lora-adapters`` needs ``?model=`` and each model's instance has its own
adapters (a ``--models-preset`` INI section's ``lora = a.gguf,b.gguf``); ``/v1/models`` lists
each model's launch arguments (``status.args``, loaded or not), so its ``--lora`` files are
read from the listing every poll (:func:`launch_loras`), with no request of their own.

llama-server exposes no KV-cache gauge: ``kv_cache_usage`` stays 0. Its prompt cache is per
slot and token by token: ``llamacpp:prompt_tokens_cached_total`` counts prompt tokens reused
(``prompt_tokens_total`` the computed ones), so its hits and queries are those two; its size is
``total_slots`` x ``n_ctx`` tokens at one token per block.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import httpx

from zml_health.adapters.base import Probe, error_message, failure
from zml_health.prometheus import parse_metrics


async def probe(client: httpx.AsyncClient, endpoint: str, timeout: float, poll: int = 0) -> Probe:
    try:
        health = await client.get(endpoint + "/health", timeout=timeout)
        if health.status_code == 503:
            msg = error_message(health)
            return Probe(ok=False, loading="loading" in msg.lower(), error=msg or "/health answered 503")
        if health.status_code != 200:
            return Probe(ok=False, error=f"/health answered {health.status_code}")
        listed = await client.get(endpoint + "/v1/models", timeout=timeout)
        listed.raise_for_status()
        listing = listed.json()
        models, loading = router_models(listing)
        props = await client.get(endpoint + "/props", timeout=timeout)
        metrics = await client.get(endpoint + "/metrics", timeout=timeout)
    except httpx.HTTPError as exc:
        return failure(exc, "llama.cpp probe")
    except ValueError as exc:
        return Probe(ok=False, error=f"/v1/models: bad JSON ({exc})")
    try:
        body = props.json() if props.status_code == 200 else {}
    except ValueError:
        body = {}
    m = parse_metrics(metrics.text) if metrics.status_code == 200 else {}
    p = from_parts(models, body if isinstance(body, dict) else {}, m)
    p.loading_models = loading
    p.model_loras = launch_loras(listing)
    return p


def launch_loras(payload: Any) -> dict[str, list[str]] | None:
    """Router mode: each listed model's ``--lora`` / ``--lora-scaled`` files from its launch
    arguments (``status.args``), in the order llama-server numbers them; None for a
    single-model server (its listing has no ``status.args``: ``/lora-adapters`` says).

    >>> launch_loras({"data": [{"id": "tiny", "status": {"value": "unloaded", "args": [
    ...     "llama-server", "--lora", "/l/a.gguf,/l/b.gguf", "--lora-scaled", "/l/c.gguf:0.5", "--model", "t"]}},
    ...     {"id": "other", "status": {"value": "loaded", "args": ["llama-server", "--model", "o"]}}]})
    {'tiny': ['/l/a.gguf', '/l/b.gguf', '/l/c.gguf'], 'other': []}
    >>> launch_loras({"data": [{"id": "tiny-llama", "object": "model"}]}) is None
    True
    """
    data = payload.get("data", []) if isinstance(payload, dict) else []
    out: dict[str, list[str]] = {}
    router = False
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        status = m.get("status")
        args = status.get("args") if isinstance(status, dict) else None
        if not isinstance(args, list):
            continue  # a single-model server's entry (or a build that does not list them)
        router = True
        files: list[str] = []
        for flag, value in zip(args, args[1:]):
            if flag == "--lora" and isinstance(value, str):
                files += [f for f in value.split(",") if f]
            elif flag == "--lora-scaled" and isinstance(value, str):
                files += [f.rsplit(":", 1)[0] for f in value.split(",") if f]
        out[m["id"]] = files
    return out if router else None


def router_models(payload: Any) -> tuple[list[str], list[str]]:
    """(served, loading) model ids from ``/v1/models`` (single-model or router mode)."""
    served: list[str] = []
    loading: list[str] = []
    data = payload.get("data", []) if isinstance(payload, dict) else []
    for m in data:
        if not isinstance(m, dict) or not isinstance(m.get("id"), str):
            continue
        status = m.get("status")
        value = status.get("value") if isinstance(status, dict) else None
        if value is None or value in ("loaded", "sleeping"):
            served.append(m["id"])
        elif value == "loading":
            loading.append(m["id"])
    return served, loading


def from_parts(models: list[str], props: dict[str, Any], m: dict[str, float]) -> Probe:
    slots = props.get("total_slots")
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    computed, cached = m.get("llamacpp:prompt_tokens_total"), m.get("llamacpp:prompt_tokens_cached_total")
    steps = m.get("llamacpp:n_decode_total")
    per_step = m.get("llamacpp:n_busy_slots_per_decode")
    return Probe(
        ok=True,
        models=models,
        sleeping=props.get("is_sleeping") is True,
        running=int(m.get("llamacpp:requests_processing", 0)),
        waiting=int(m.get("llamacpp:requests_deferred", 0)),
        max_concurrency=slots if isinstance(slots, int) and not isinstance(slots, bool) and slots > 0 else None,
        generation_tokens_total=m.get("llamacpp:tokens_predicted_total"),
        prompt_tokens_total=m.get("llamacpp:prompt_tokens_total"),
        prefill_time_sum=m.get("llamacpp:prompt_seconds_total"),
        # Counted while decoding, so no per-request first token to subtract.
        request_gen_tokens_sum=m.get("llamacpp:tokens_predicted_total"),
        request_gen_tokens_count=0.0 if "llamacpp:tokens_predicted_total" in m else None,
        decode_time_sum=m.get("llamacpp:tokens_predicted_seconds_total"),
        decode_steps_total=steps,
        # The gauge is a mean since start: times the step count it gives the busy-slot counter.
        busy_slot_steps_total=per_step * steps if steps is not None and per_step is not None else None,
        prefix_queries_total=computed + cached if computed is not None and cached is not None else None,
        prefix_hits_total=cached,
        kv_block_size=1,
        kv_cache_blocks=n_ctx * slots if isinstance(n_ctx, int) and isinstance(slots, int)
        and _positive(n_ctx) and _positive(slots) else None,
    )


def _positive(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


class Lora(NamedTuple):
    """One of a llama-server's ``--lora`` files as ``GET /lora-adapters`` lists it."""

    id: int
    path: str
    scale: float


async def read_loras(client: httpx.AsyncClient, endpoint: str, timeout: float) -> list[Lora] | None:
    """The adapters a llama-server was started with ([] for none; a server whose build has no
    ``/lora-adapters``, 404, has none); None when it could not be read now (ask again later)."""
    try:
        r = await client.get(endpoint + "/lora-adapters", timeout=timeout)
    except httpx.HTTPError:
        return None
    if r.status_code in (404, 405, 501):
        return []
    if r.status_code != 200:
        return None
    try:
        return parse_loras(r.json())
    except ValueError:
        return None


def parse_loras(payload: Any) -> list[Lora]:
    """``[{"id": 0, "path": "a.gguf", "scale": 1.0, ...}, ...]`` -> Loras (malformed entries left out).

    >>> parse_loras([{"id": 0, "path": "/lora/pirate.gguf", "scale": 1.0}, {"path": "x"}])
    [Lora(id=0, path='/lora/pirate.gguf', scale=1.0)]
    """
    out: list[Lora] = []
    for a in payload if isinstance(payload, list) else []:
        if not isinstance(a, dict) or not _index(a.get("id")):
            continue
        scale = a.get("scale", 0.0)
        out.append(Lora(a["id"], str(a.get("path", "")),
                        float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else 0.0))
    return out


def _index(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
