"""What the parts of a simulated node see of it.

The engine faces (:mod:`zml_sim.faces`), the ``/sim`` admin routes (:mod:`zml_sim.admin`) and
the metrics page (:mod:`zml_sim.metrics`) are given a :class:`NodeView`, which
:class:`zml_sim.server.SimNode` implements: they depend on this small surface, never on the
server module (which imports them to build its app).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from aiohttp import web

from zml_sim.engine import SimEngine


class NodeView(Protocol):
    node_id: str
    #: the imitated engine's name (``--engine``: vllm, tgi, sglang, llamacpp, openai)
    engine_kind: str
    engine: SimEngine
    #: vLLM sleep mode: the models offloaded by POST /sleep, reloaded by POST /wake_up
    sleeping: list[str]
    #: LoRA adapters loaded at run time (vLLM): name -> path
    adapters: dict[str, str]
    #: llama.cpp's --lora files: [{"id", "path", "scale"}] (scale: the global one)
    loras: list[dict[str, Any]]
    #: llama.cpp: adapter id -> requests that asked for it at a scale > 0
    lora_requests: dict[int, int]
    #: requests that ran on each adapter (zml_sim.faces: vLLM names it, SGLang "base:adapter")
    adapter_requests: dict[str, int]
    #: seconds (simulated) an adapter load takes
    adapter_load_s: float
    #: vLLM's lora_filesystem_resolver cache dir (None: no resolver)
    lora_resolver_dir: str | None

    def error(self, status: int, message: str, kind: str,
              headers: dict[str, str] | None = None) -> web.Response:
        """An error in the imitated engine's shape. ``kind``: bad_request, not_found,
        overloaded, loading, internal."""
        ...

    def loading_error(self) -> web.Response:
        """The imitated engine's answer while its model loads."""
        ...

    async def health(self, request: web.Request) -> web.Response:
        """The health route (its engine's ``/health``, and its aliases)."""
        ...

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` beside the request (cancelled when the node stops)."""
        ...

    async def crash(self, for_s: float | None = None) -> None:
        ...

    def state(self) -> dict[str, Any]:
        """The ``/sim/state`` document."""
        ...
