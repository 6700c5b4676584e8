"""The node probe: ``GET /zml/v1/node`` (``zml node-agent`` beside an engine, or ``zml sim``).

Returns the document, ``None`` when the node has no probe endpoint, or raises ``Unreachable``
when it cannot tell (engine down, timeout) so the caller keeps what it knew.
"""

from __future__ import annotations

from typing import Any

import httpx

PATH = "/zml/v1/node"


class Unreachable(Exception):
    pass


async def fetch(client: httpx.AsyncClient, base: str, timeout: float, *, separate: bool) -> dict[str, Any] | None:
    """``separate``: the probe has its own endpoint (an agent), so a refused connection means
    "no agent" rather than "engine not up yet"."""
    try:
        resp = await client.get(base.rstrip("/") + PATH, timeout=timeout)
    except httpx.ConnectError as exc:
        if separate:
            return None
        raise Unreachable(str(exc)) from exc
    except httpx.HTTPError as exc:
        raise Unreachable(str(exc)) from exc
    if resp.status_code in (404, 405, 501):
        return None
    if resp.status_code != 200:
        raise Unreachable(f"{PATH} answered {resp.status_code}")
    try:
        doc = resp.json()
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
