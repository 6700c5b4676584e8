"""Disaggregated prefill/decode in a simulated node: the engines' own protocols, as a router
drives them (docs/disaggregation.md).

* vLLM with a KV connector (NixlConnector): a request whose ``kv_transfer_params`` say
  ``do_remote_decode`` is prefilled (``max_tokens`` 1, not streamed) and its prompt's blocks
  are *held* until a decode node pulls them or :data:`VLLM_HOLD_S` passes (vLLM's
  ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``); its reply carries ``kv_transfer_params``
  (``do_remote_prefill``, ``remote_engine_id``, ``remote_block_ids``, ``remote_host``,
  ``remote_port``, ``tp_size``). A request carrying those params pulls the blocks from that
  host at the link's speed and prefills only what they lack; unknown or expired params are
  refused. Its usage counts the pulled tokens as cached, as vLLM counts tokens loaded through
  a KV connector (``num_cached_tokens`` includes them).
* SGLang: both legs carry ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room``; the node
  they name prefills and holds the room's KV, any other node decodes, pulling the room (it
  waits for the prefill, which runs at the same time, up to :data:`SGLANG_WAIT_S`).

A sim's bootstrap (vLLM's NIXL side channel, SGLang's bootstrap server) is its HTTP port:
``POST /sim/kv/pull``.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import aiohttp

#: vLLM frees blocks held for a remote decode after this long (VLLM_NIXL_ABORT_REQUEST_TIMEOUT).
VLLM_HOLD_S = 480.0
#: How long an SGLang decode leg waits for its room's prefill.
SGLANG_WAIT_S = 30.0


class HandoffError(Exception):
    """A pull that cannot be served: unknown or expired blocks, an unreachable peer."""


@dataclass(slots=True)
class Held:
    model: str
    tokens: list[int]
    expires: float
    taken: asyncio.Event = field(default_factory=asyncio.Event)


class KVHandoff:
    """One node's held prompts (by vLLM block ids or SGLang room) and its pulls."""

    def __init__(self, node_id: str, *, gbps: float | None = None, hold_s: float = VLLM_HOLD_S,
                 block_size: int = 16) -> None:
        self.engine_id = f"sim-{node_id}"
        #: this node's KV link, Gbit/s (None: instant)
        self.gbps = gbps
        self.hold_s = hold_s
        self.block_size = block_size
        self._blocks = itertools.count(1)
        self._held: dict[str, Held] = {}
        self._ready: dict[str, asyncio.Event] = {}
        #: counters for /sim/state and tests
        self.held_total = 0
        self.pulled_total = 0
        self.expired_total = 0
        self.pulled_tokens = 0

    # --- the prefill side ----------------------------------------------------------------
    def hold(self, key: str, model: str, tokens: list[int], now: float) -> None:
        self._expire(now)
        self._held[key] = Held(model, list(tokens), now + self.hold_s)
        self.held_total += 1
        self._ready.setdefault(key, asyncio.Event()).set()

    def vllm_params(self, model: str, tokens: list[int], host: str, port: int, now: float) -> dict[str, Any]:
        """Hold a prefilled prompt's blocks; the ``kv_transfer_params`` of the prefill's reply."""
        n = max(1, -(-len(tokens) // self.block_size))
        ids = [next(self._blocks) for _ in range(n)]
        self.hold(_block_key(ids), model, tokens, now)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": ids,
                "remote_engine_id": self.engine_id, "remote_host": host, "remote_port": port, "tp_size": 1}

    async def take(self, body: dict[str, Any], now: float) -> Held:
        """Serve a pull: the held prompt, released. ``room`` pulls may wait for it."""
        if "room" in body:
            key = f"room:{body['room']}"
            ready = self._ready.setdefault(key, asyncio.Event())
            wait = float(body.get("wait_s") or 0.0)
            if key not in self._held and wait > 0:
                try:
                    await asyncio.wait_for(ready.wait(), wait)
                except TimeoutError:
                    pass
        else:
            if body.get("engine_id") != self.engine_id:
                raise HandoffError(f"unknown remote_engine_id {body.get('engine_id')!r}")
            ids = body.get("block_ids")
            if not isinstance(ids, list) or not ids:
                raise HandoffError("remote_block_ids missing")
            key = _block_key(ids)
        self._expire(now)
        held = self._held.pop(key, None)
        self._ready.pop(key, None)
        if held is None:
            raise HandoffError("remote blocks unknown or expired")
        self.pulled_total += 1
        self.pulled_tokens += len(held.tokens)
        return held

    def _expire(self, now: float) -> None:
        for key in [k for k, h in self._held.items() if h.expires <= now]:
            del self._held[key]
            self._ready.pop(key, None)
            self.expired_total += 1

    @property
    def holding(self) -> int:
        return len(self._held)

    # --- the decode side -----------------------------------------------------------------
    def transfer_s(self, tokens: int, bytes_per_token: int) -> float:
        """Model seconds to move ``tokens`` of KV over this node's link."""
        if not self.gbps or tokens <= 0:
            return 0.0
        return tokens * bytes_per_token / (self.gbps * 1e9 / 8.0)

    async def pull(self, host: str, port: int, body: dict[str, Any], timeout_s: float) -> tuple[str, list[int]]:
        """Ask the holder for its prompt; (model, tokens). HandoffError when it refuses."""
        url = f"http://{'[' + host + ']' if ':' in host else host}:{int(port)}/sim/kv/pull"
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as s:
                async with s.post(url, json=body) as resp:
                    data = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise HandoffError(str((data or {}).get("error", {}).get("message", resp.status)))
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise HandoffError(f"KV pull from {host}:{port} failed: {exc}") from exc
        return str(data["model"]), [int(t) for t in data["tokens"]]

    def state(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "holding": self.holding, "held": self.held_total,
                "pulled": self.pulled_total, "pulled_tokens": self.pulled_tokens, "expired": self.expired_total,
                "kv_gbps": self.gbps}


def _block_key(ids: list[Any]) -> str:
    return "blocks:" + ",".join(str(i) for i in ids)


def loaded_tokens(held: list[int], prompt: list[int] | None, block_size: int) -> int:
    """Prompt tokens the pulled KV covers: the common prefix, whole blocks only (a connector
    moves blocks; the partial last block is computed again, as NixlConnector rounds down).

    >>> loaded_tokens([1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6], 2)
    4
    >>> loaded_tokens([1, 2, 3], [9, 2, 3], 1)
    0
    """
    if prompt is None:
        return 0
    n = 0
    for a, b in zip(held, prompt):
        if a != b:
            break
        n += 1
    return n - n % block_size
