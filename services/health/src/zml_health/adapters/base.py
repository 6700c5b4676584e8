from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Probe:
    """What one poll of a node found."""

    ok: bool
    #: The engine says it is starting / loading a model (not a failure of the node).
    loading: bool = False
    models: list[str] = field(default_factory=list)
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    generation_tokens_total: float | None = None
    error: str = ""


async def get_models(client, endpoint: str, timeout: float) -> list[str]:  # type: ignore[no-untyped-def]
    resp = await client.get(endpoint + "/v1/models", timeout=timeout)
    resp.raise_for_status()
    return [m["id"] for m in resp.json().get("data", []) if isinstance(m, dict) and "id" in m]
