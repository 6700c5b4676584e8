"""The two legs of a disaggregated request on the engines' own protocols (docs/disaggregation.md).

* vLLM with a KV connector (NixlConnector and the like; vLLM's disaggregated proxy and
  ``vllm-router --vllm-pd-disaggregation`` do the same): the prefill leg is the request with
  ``max_tokens`` 1, not streamed, and ``kv_transfer_params`` asking for a remote decode; its
  reply's ``kv_transfer_params`` (engine id, block ids, host, port) go into the decode leg,
  which is the caller's request as it came (streamed or not).
* SGLang (``--disaggregation-mode prefill|decode``): both legs carry ``bootstrap_host``,
  ``bootstrap_port`` (the prefill node's bootstrap server: ``kv_bootstrap_port``) and
  ``bootstrap_room`` (random per request) and run *at once*: the decode node pulls the room's
  KV from the prefill node, whose reply is not the answer.
* llama.cpp (``llama-server --slot-save-path DIR`` on both nodes, DIR shared): the prefill leg
  runs on slot :data:`LLAMA_SLOT` with ``cache_prompt``, then ``POST /slots/N?action=save``
  writes the slot's KV to a file; the decode node restores that file into its slot before the
  decode leg, which asks for that slot with ``cache_prompt``: the prompt is found cached.

Which backends split: :data:`SPLIT_BACKENDS` (a node of another engine is never a leg).
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any
from urllib.parse import urlsplit

import msgspec

from zml_router.node.attempt import AttemptError, Failure
from zml_router.node.dispatch import NodeClient, post_json
from zml_router.node.result import Handoff

_encode = msgspec.json.encode
_decode_any = msgspec.json.Decoder()

#: Engines whose legs the router runs.
SPLIT_BACKENDS = frozenset({"vllm", "sglang", "llamacpp"})
#: The llama-server slot both legs use (slot tasks on a busy slot wait for it).
LLAMA_SLOT = 0
#: The prefill leg's ask for a remote decode, as vLLM's proxy and vllm-router send it.
VLLM_PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(backend: str, body: bytes) -> bytes:
    """The prefill leg's body: the caller's request (as the node gets it), one token, whole.

    >>> msgspec.json.decode(prefill_body("vllm", b'{"model":"m","prompt":"p","max_tokens":9,"stream":true,'
    ...                                            b'"stream_options":{"include_usage":true}}'))["max_tokens"]
    1
    """
    data = _decode_any.decode(body)
    data["max_tokens"] = 1
    if "max_completion_tokens" in data:
        data["max_completion_tokens"] = 1
    data["stream"] = False
    data.pop("stream_options", None)
    # min_tokens would ask the prefill for more than one token
    data.pop("min_tokens", None)
    data.pop("min_completion_tokens", None)
    if backend == "vllm":
        data["kv_transfer_params"] = dict(VLLM_PREFILL_PARAMS)
    elif backend == "llamacpp":
        data["id_slot"] = LLAMA_SLOT
        data["cache_prompt"] = True
    return _encode(data)


def slot_file(tag: str) -> str:
    """The llama-server slot file of one prefill leg (a plain name: llama-server refuses paths).

    >>> slot_file("req/1-ab")
    'zml-req_1-ab.bin'
    """
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in tag)[:100]
    return f"zml-{safe}.bin"


def bootstrap(endpoint: str, port: int) -> dict[str, Any]:
    """SGLang's bootstrap fields for a prefill node at ``endpoint`` (``port`` 0: the endpoint's).

    >>> b = bootstrap("http://10.0.0.5:30000", 8998); b["bootstrap_host"], b["bootstrap_port"]
    ('10.0.0.5', 8998)
    """
    u = urlsplit(endpoint)
    return {"bootstrap_host": u.hostname or "", "bootstrap_port": port or u.port or (443 if u.scheme == "https" else 80),
            "bootstrap_room": random.getrandbits(63)}


async def run_prefill(client: NodeClient, backend: str, endpoint: str, path: str, body: bytes,
                      headers: dict[str, str], node_id: str, tag: str, bootstrap_port: int = 0) -> Handoff:
    """Run the prefill leg on ``endpoint``; the Handoff for the decode leg (AttemptError when
    the node fails, or answers without what the decode leg needs). SGLang's runs beside the
    decode leg: it is started here and handed over running."""
    t0 = time.monotonic()
    base = endpoint.rstrip("/")
    if backend == "sglang":
        fields = bootstrap(endpoint, bootstrap_port)
        data = _decode_any.decode(prefill_body(backend, body))
        data.update(fields)
        leg = asyncio.ensure_future(post_json(client, base + path, _encode(data), headers, 16 * 1024 * 1024))
        return Handoff(node_id, fields, 0.0, running=leg)
    reply = await post_json(client, base + path, prefill_body(backend, body), headers, 16 * 1024 * 1024)
    if backend == "vllm":
        try:
            params = _decode_any.decode(reply).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
        if not isinstance(params, dict) or not params:
            raise AttemptError(Failure.SERVER, 200, "the prefill reply has no kv_transfer_params: is the engine "
                               "started with a KV connector (--kv-transfer-config)?")
        return Handoff(node_id, {"kv_transfer_params": params}, (time.monotonic() - t0) * 1e3)
    if backend == "llamacpp":
        name = slot_file(tag)
        await post_json(client, f"{base}/slots/{LLAMA_SLOT}?action=save", _encode({"filename": name}), headers)
        return Handoff(node_id, {"id_slot": LLAMA_SLOT, "cache_prompt": True}, (time.monotonic() - t0) * 1e3,
                       restore=name)
    raise AttemptError(Failure.CLIENT, 0, f"backend {backend!r} has no prefill/decode protocol in ZML")


async def before_decode(client: NodeClient, endpoint: str, handoff: Handoff, headers: dict[str, str]) -> None:
    """What the decode node needs before its leg: llama-server restores the slot file."""
    if handoff.restore:
        await post_json(client, f"{endpoint.rstrip('/')}/slots/{LLAMA_SLOT}?action=restore",
                        _encode({"filename": handoff.restore}), headers)


def decode_body(body: bytes, handoff: Handoff) -> bytes:
    """The decode leg's body: the caller's request with the handed-over fields."""
    data: dict[str, Any] = _decode_any.decode(body)
    data.update(handoff.fields)
    return _encode(data)
