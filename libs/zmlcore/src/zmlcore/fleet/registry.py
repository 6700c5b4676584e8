"""Client of the health service's run-time node registration (``zml.admin.nodes.*``).

What ``zml nodes add|remove`` calls. Errors come back as the ZML error they were sent as
(``BadRequestError`` for an invalid node, an unknown id...).

Example::

    import nats
    from zmlcore.fleet.registry import add_node, remove_node
    from zmlcore.messages import NodeSpec

    nc = await nats.connect("nats://127.0.0.1:4222")
    await add_node(nc, NodeSpec(id="mi300x-9", accelerator="amd_mi300x",
                                endpoint="http://10.0.1.9:8000", models=["m"]))
    await remove_node(nc, "mi300x-9")
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from zmlcore import subjects
from zmlcore.errors import ErrorBody, NoHealthyNodesError, TimeoutError, ZMLError, from_wire
from zmlcore.messages.admin import NodeAdd, NodeAdded, NodeRemove, NodeRemoved, NodeSpec
from zmlcore.messages.node import NodeState

_encode = msgspec.json.encode
_error_decoder = msgspec.json.Decoder(ErrorBody)
_added = msgspec.json.Decoder(NodeAdded)
_removed = msgspec.json.Decoder(NodeRemoved)
_listing = msgspec.json.Decoder(dict[str, list[NodeState]])


async def _request(nc: NATS, verb: str, payload: bytes, timeout: float) -> bytes:
    subject = subjects.admin_nodes(verb)
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except NoRespondersError as exc:
        raise NoHealthyNodesError(f"no health service answers on {subject}: is `zml health` running?") from exc
    except NatsTimeoutError as exc:
        raise TimeoutError(f"the health service did not answer on {subject} within {timeout:g} s") from exc
    if msg.headers and subjects.H_ERROR_CODE in msg.headers:
        try:
            raise from_wire(_error_decoder.decode(msg.data).error)
        except msgspec.DecodeError:
            raise ZMLError(f"{subject}: error {msg.headers[subjects.H_ERROR_CODE]}") from None
    return bytes(msg.data)


async def add_node(nc: NATS, node: NodeSpec, *, replace: bool = False, timeout: float = 5.0) -> NodeAdded:
    """Register ``node`` (kept across health restarts). ``replace``: overwrite an existing id."""
    return _added.decode(await _request(nc, "add", _encode(NodeAdd(node=node, replace=replace)), timeout))


async def remove_node(nc: NATS, node_id: str, *, timeout: float = 5.0) -> NodeRemoved:
    """Remove a node (run-time or zml.toml); routers drop it at once."""
    return _removed.decode(await _request(nc, "remove", _encode(NodeRemove(node_id=node_id)), timeout))


async def list_nodes(nc: NATS, *, timeout: float = 5.0) -> list[NodeState]:
    """Every node's state as the health service sees it now (each with ``age_s``)."""
    return _listing.decode(await _request(nc, "list", b"", timeout)).get("nodes", [])
