"""The families of the fleet the SDK will talk to, for ``zml.Policy``'s check at creation.

A family registered at run time (``zml nodes add ... --family Edge``) is in no zml.toml, so
when the local zml.toml does not name a family of a policy's chain, the fleet is asked: the
endpoint is ``ZML_ENDPOINT``, else the gateway of the zml.toml found (never a guessed
default), and the answer is ``GET /v1/nodes`` (or ``zml.admin.nodes.list`` over NATS). An
unreachable fleet gives ``None``: the check falls back to what is known locally.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from zml._errors import ZMLError

log = logging.getLogger("zml")

#: Seconds to wait for the fleet's answer (policy creation must stay quick).
ASK_TIMEOUT_S = 2.0
#: Seconds an answer is reused (policies created in a loop ask once).
CACHE_S = 5.0
_cache: dict[str, tuple[float, list[str] | None]] = {}


def fleet_endpoint(config_path: str | os.PathLike[str] | None) -> tuple[str, str | None] | None:
    """(endpoint, api key) of the fleet, when one is named (ZML_ENDPOINT or a zml.toml)."""
    from zml._config import resolve
    from zmlcore.config import find_config

    if not os.environ.get("ZML_ENDPOINT") and config_path is None and find_config() is None:
        return None
    try:
        settings = resolve(None, None, config_path)
    except ZMLError:
        return None
    return settings.endpoint, settings.api_key


def fleet_families(config_path: str | os.PathLike[str] | None = None) -> list[str] | None:
    """Families of the nodes the fleet has (zml.toml's and those registered at run time)."""
    named = fleet_endpoint(config_path)
    if named is None:
        return None
    endpoint, api_key = named
    now = time.monotonic()
    hit = _cache.get(endpoint)
    if hit is not None and now - hit[0] < CACHE_S:
        return hit[1]
    families = _ask(endpoint, api_key)
    _cache[endpoint] = (now, families)
    return families


def _ask(endpoint: str, api_key: str | None) -> list[str] | None:
    from zml._core import decode_nodes

    transport: Any
    try:
        if endpoint.startswith(("nats://", "tls://")):
            from zml._transport_nats import SyncNatsTransport

            transport = SyncNatsTransport(endpoint, ASK_TIMEOUT_S, connect_timeout=ASK_TIMEOUT_S)
        else:
            from zml._transport_http import SyncHTTPTransport

            transport = SyncHTTPTransport(endpoint, api_key, ASK_TIMEOUT_S, 1)
        try:
            nodes = decode_nodes(transport.nodes())
        finally:
            transport.close()
    except (ZMLError, OSError) as exc:
        log.debug("zml: could not ask %s for its families: %s", endpoint, exc)
        return None
    seen: dict[str, None] = {}
    for n in nodes:
        if isinstance(n.get("family"), str) and n["family"]:
            seen.setdefault(n["family"], None)
    return list(seen)
