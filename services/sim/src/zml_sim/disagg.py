"""A simulated node's side of a disaggregated request (zml_sim.kvhandoff): which leg a request
is, a prefill leg's KV held for its decode node, a decode leg's KV pulled at the link's speed,
and the route the decode node pulls from."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
from aiohttp import web

from zml_sim.engine import KV_BYTES_PER_TOKEN
from zml_sim.engine import SimEngine
from zml_sim.engine import SimRequest
from zml_sim.kvhandoff import SGLANG_WAIT_S, HandoffError, KVHandoff, loaded_tokens
from zml_sim.faces.base import json_response
from zml_sim.faces.base import Face


_decode = msgspec.json.Decoder()
_json_response = json_response


class KVLegs:
    """The prefill and decode legs of :class:`~zml_sim.server.SimNode` (a part of it: the node's
    state is its own, declared here for the type checker)."""

    host: str
    port: int
    engine: SimEngine
    face: Face
    handoff: KVHandoff

    def _handoff_leg(self, args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """("hold", how) for a prefill leg whose KV a remote decode will pull, ("pull", from
        where) for a decode leg, None for a whole request."""
        kvp = args["kv_transfer_params"]
        if self.face.name == "vllm" and kvp is not None:
            if kvp.get("do_remote_prefill"):
                return "pull", {"host": kvp.get("remote_host"), "port": kvp.get("remote_port"),
                                "body": {"engine_id": kvp.get("remote_engine_id"),
                                         "block_ids": kvp.get("remote_block_ids")}}
            if kvp.get("do_remote_decode"):
                return "hold", {"vllm": True}
            return None
        boot = args["bootstrap"]
        if self.face.name == "sglang" and boot is not None:
            host, port, room = boot
            if self._is_me(host, port):
                return "hold", {"room": room}
            return "pull", {"host": host, "port": port, "body": {"room": room, "wait_s": SGLANG_WAIT_S}}
        return None

    def _is_me(self, host: str, port: Any) -> bool:
        try:
            return int(port) == self.port and host in (self.host, "localhost", "127.0.0.1", "::1")
        except (TypeError, ValueError):
            return False

    async def _pull_kv(self, model: str, tokens: list[int] | None, where: dict[str, Any]) -> int:
        """Pull a prompt's KV from its prefill node at the link's speed; the tokens it covers."""
        if not where.get("host") or where.get("port") is None:
            raise HandoffError("remote_host and remote_port are required")
        held_model, held = await self.handoff.pull(str(where["host"]), where["port"], where["body"],
                                                   timeout_s=SGLANG_WAIT_S + 5.0)
        if held_model != model:
            raise HandoffError(f"the remote blocks are of model {held_model!r}, not {model!r}")
        n = loaded_tokens(held, tokens, self.engine.profile.kv_block_size)
        cache = self.engine.prefix_cache
        local = 0
        if cache is not None and tokens is not None:
            local = self.engine.cached_prefix(model, tokens)
        delay = self.handoff.transfer_s(max(0, n - local), KV_BYTES_PER_TOKEN)
        if delay > 0:
            await asyncio.sleep(self.engine.real_seconds(delay))
        return n

    def _hold_kv(self, req: SimRequest, hold: dict[str, Any]) -> dict[str, Any]:
        """After a prefill leg: hold its prompt for the decode node; vLLM's reply params."""
        now = time.monotonic()
        tokens = req.tokens or []
        if "room" in hold:
            self.handoff.hold(f"room:{hold['room']}", req.model, tokens, now)
            return {}
        return {"kv_transfer_params": self.handoff.vllm_params(req.model, tokens, self.host, self.port, now)}

    async def _kv_pull(self, request: web.Request) -> web.Response:
        try:
            body = _decode.decode(await request.read() or b"{}")
            if not isinstance(body, dict):
                raise HandoffError("expected a JSON object")
            held = await self.handoff.take(body, time.monotonic())
        except (msgspec.DecodeError, HandoffError) as exc:
            return self.face.error(404, str(exc), "not_found", None)
        return _json_response({"model": held.model, "tokens": held.tokens})

