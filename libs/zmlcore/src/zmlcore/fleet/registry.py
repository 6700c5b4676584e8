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

    # or, without an event loop of your own:
    add_node_sync("nats://127.0.0.1:4222", NodeSpec(...))
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


def _sync(nats_url: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    async def run() -> Any:
        import nats

        from zmlcore.bus.link import split_urls

        nc = await nats.connect(servers=split_urls(nats_url), connect_timeout=kwargs.pop("connect_timeout", 2.0),
                                max_reconnect_attempts=0, **(kwargs.pop("connect_options", None) or {}))
        try:
            return await fn(nc, *args, **kwargs)
        finally:
            await nc.close()

    return asyncio.run(run())


def add_node_sync(nats_url: str, node: NodeSpec, *, replace: bool = False, timeout: float = 5.0,
                  connect_options: dict[str, Any] | None = None) -> NodeAdded:
    """:func:`add_node` for callers without an event loop (the CLI); ``connect_options``: the
    caller's identity and TLS (zmlcore.access.identity)."""
    return _sync(nats_url, add_node, node, replace=replace, timeout=timeout, connect_options=connect_options)  # type: ignore[no-any-return]


def remove_node_sync(nats_url: str, node_id: str, *, timeout: float = 5.0,
                     connect_options: dict[str, Any] | None = None) -> NodeRemoved:
    """:func:`remove_node` for callers without an event loop (the CLI)."""
    return _sync(nats_url, remove_node, node_id, timeout=timeout, connect_options=connect_options)  # type: ignore[no-any-return]
