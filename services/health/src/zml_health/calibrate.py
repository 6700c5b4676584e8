"""A calibration request: one short real request through a node's engine, timed, so a node whose
speeds are unknown (new, restarted, a model just loaded, an estimate gone stale) is measured
before, not after, traffic is routed by a guess (docs/routing.md "Learned speeds").

The prompt starts with a random nonce, so no prefix cache holds it and every token is
prefilled; the answer is streamed so the first token and the last are timed. The engine's own
per-request timings win where it reports them (llama.cpp's ``timings``).
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass

import httpx
from zmlcore.messages.node import LORA_ALL_OFF

log = logging.getLogger("zml.health")

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november "
          "oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@dataclass(frozen=True, slots=True)
class Measured:
    prefill_tps: float
    decode_tps: float
    #: True when the speeds are the engine's own (llama.cpp ``timings``), not timed here.
    engine: bool
    ttft_s: float
    prompt_tokens: int


def prompt(tokens: int, rng: random.Random) -> str:
    """About ``tokens`` tokens (the sim counts 4 characters a token, real tokenizers about one
    short word each) behind a nonce no cache holds."""
    words = [f"calibration {rng.getrandbits(64):x}:"]
    n = 0
    while n < tokens * 4:
        w = rng.choice(_WORDS)
        words.append(w)
        n += len(w) + 1
    return " ".join(words)


async def calibrate(client: httpx.AsyncClient, endpoint: str, model: str, *, prompt_tokens: int,
                    max_tokens: int, timeout: float, api_key: str | None = None,
                    rng: random.Random | None = None, lora_off: bool = False) -> Measured | None:
    """Send the request and time it; None when it failed or showed too little to measure.
    ``lora_off``: a llama-server holding --lora adapters is asked with every adapter off (as
    routers ask it for a base model): without a ``lora`` list it runs at the global scales and
    keeps a slot's prompt cache made under other scales, which later requests would reuse."""
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt(prompt_tokens, rng or random.Random())}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if lora_off:
        body["lora"] = list(LORA_ALL_OFF)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = endpoint.rstrip("/") + "/v1/chat/completions"
    first = last = 0.0
    chunks = 0
    usage: dict[str, object] = {}
    timings: dict[str, object] = {}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 200:
                log.info("calibration of %s at %s: HTTP %s", model, endpoint, resp.status_code)
                return None
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    obj = json.loads(data)
                except ValueError:
                    continue
                now = time.perf_counter()
                if isinstance(obj.get("usage"), dict):
                    usage = obj["usage"]
                if isinstance(obj.get("timings"), dict):
                    timings = obj["timings"]
                for ch in obj.get("choices") or ():
                    delta = ch.get("delta") or {}
                    if delta.get("content") or delta.get("reasoning_content"):
                        if not first:
                            first = now
                        last = now
                        chunks += 1
    except (httpx.HTTPError, OSError) as exc:
        log.info("calibration of %s at %s failed: %s", model, endpoint, exc)
        return None
    if not first:
        return None
    ttft = first - t0
    ptoks = _int(usage.get("prompt_tokens")) or prompt_tokens
    gen = _int(usage.get("completion_tokens")) or chunks
    pps, dps = _float(timings.get("prompt_per_second")), _float(timings.get("predicted_per_second"))
    if pps > 0 or dps > 0:
        return Measured(prefill_tps=pps, decode_tps=dps, engine=True, ttft_s=ttft, prompt_tokens=ptoks)
    decode = (gen - 1) / (last - first) if gen > 1 and last > first else 0.0
    return Measured(prefill_tps=ptoks / ttft if ttft > 0 else 0.0, decode_tps=decode, engine=False,
                    ttft_s=ttft, prompt_tokens=ptoks)


def _int(v: object) -> int:
    return v if isinstance(v, int) else 0


def _float(v: object) -> float:
    return float(v) if isinstance(v, (int, float)) else 0.0
