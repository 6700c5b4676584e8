"""The accelerator families a fleet has, for ``zml.Policy``'s check at creation.

Two sources, read in this order:

1. the zml.toml given (``config_path``), or found from the working directory: its nodes'
   families. Read here, with no network.
2. the fleet itself, when that file does not name every family of a policy's chain, since a
   family can be registered at run time (``zml nodes add ... --family Edge``). The fleet is the
   one ``ZML_ENDPOINT`` names, else the gateway of the zml.toml found (never a guessed
   default). It is asked once, its answer is kept for :data:`CACHE_S`, and a fleet that does not
   answer within :data:`ASK_TIMEOUT_S` gives ``None``, so the check falls back to what is known
   locally.

This module sits below ``_models`` (Policy calls it) and below the transports and clients, and
imports none of them. It does not ask the fleet itself. It calls the *asker* the package wires in
(:func:`ask_with`, from ``zml/__init__.py``), which lists the fleet's nodes through a real
``zml.Client``. Why not a small client of its own here: the fleet answers over http(s)://,
grpc(s):// and nats:// (with zml.toml's nkey identity and TLS), and a second client would be a
second copy of each transport's connection, authentication and error translation to keep in step.
Why not import the transports here: that made the circle this module exists to break (models
-> fleet -> transports -> core -> models). Without an asker (this module loaded on its own) only
zml.toml is consulted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence

from zml._config import resolve
from zml._errors import ConfigError, ZMLError
from zmlcore.config import find_config, load_config

__all__ = ["ASK_TIMEOUT_S", "CACHE_S", "Asker", "ask_with", "fleet_endpoint", "fleet_families", "known_families",
           "local_families"]

log = logging.getLogger("zml")

#: Seconds to wait for the fleet's answer (policy creation must stay quick).
ASK_TIMEOUT_S = 2.0
#: Seconds an answer is reused (policies created in a loop ask once).
CACHE_S = 5.0

#: ``asker(endpoint, api_key, config_path, timeout_s)``: the families of the nodes of the fleet at
#: ``endpoint``. Raises ZMLError or OSError when the fleet cannot tell.
Asker = Callable[[str, str | None, str | os.PathLike[str] | None, float], Sequence[str]]

_asker: Asker | None = None
_cache: dict[str, tuple[float, list[str] | None]] = {}


def ask_with(asker: Asker | None) -> None:
    """Install how the fleet is asked (``zml/__init__.py`` installs ``zml._client.fleet_families``).
    ``None`` turns asking off: only zml.toml is consulted."""
    global _asker
    _asker = asker
    _cache.clear()


def local_families(config_path: str | os.PathLike[str] | None) -> list[str] | None:
    """Families of the zml.toml given (or found from the working directory), if any. A broken
    zml.toml that was found (not given) is ignored here; a given one raises its ConfigError."""
    path = config_path if config_path is not None else find_config()
    if path is None:
        return None
    try:
        cfg = load_config(path, env={})
    except ConfigError as exc:
        if config_path is not None:
            raise
        log.debug("zml: ignoring %s for policy validation: %s", path, exc)
        return None
    return cfg.families() or None


def fleet_endpoint(config_path: str | os.PathLike[str] | None) -> tuple[str, str | None] | None:
    """(endpoint, api key) of the fleet, when one is named (ZML_ENDPOINT or a zml.toml)."""
    if not os.environ.get("ZML_ENDPOINT") and config_path is None and find_config() is None:
        return None
    try:
        settings = resolve(None, None, config_path)
    except ZMLError:
        return None
    return settings.endpoint, settings.api_key


def fleet_families(config_path: str | os.PathLike[str] | None = None) -> list[str] | None:
    """Families of the nodes the fleet has (zml.toml's and those registered at run time), or
    None when no fleet is named, none answers, or no asker is installed."""
    if _asker is None:
        return None
    named = fleet_endpoint(config_path)
    if named is None:
        return None
    endpoint, api_key = named
    now = time.monotonic()
    hit = _cache.get(endpoint)
    if hit is not None and now - hit[0] < CACHE_S:
        return hit[1]
    try:
        families: list[str] | None = list(dict.fromkeys(f for f in _asker(endpoint, api_key, config_path,
                                                                             ASK_TIMEOUT_S) if f))
    except (ZMLError, OSError) as exc:
        log.debug("zml: could not ask %s for its families: %s", endpoint, exc)
        families = None
    _cache[endpoint] = (now, families)
    return families


def known_families(chain: Sequence[str], config_path: str | os.PathLike[str] | None) -> list[str] | None:
    """The families a policy's ``chain`` is checked against: zml.toml's, plus the fleet's when
    zml.toml does not name every family of the chain. None: no fleet is known (only the
    policy's values can be checked)."""
    known = local_families(config_path)
    have = {f.lower() for f in known or ()}
    if all(f.lower() in have for f in chain):
        return known
    fleet = fleet_families(config_path)
    if fleet is None:
        return known
    return [*(known or ()), *fleet]
