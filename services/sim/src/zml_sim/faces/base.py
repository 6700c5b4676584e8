"""What every engine face provides; the defaults are vLLM's OpenAI server."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from zml_sim.engine import SimRequest
from zml_sim.nodeview import NodeView


#: Context window every simulated model advertises (vLLM's /v1/models ``max_model_len``) and
#: enforces: prompt + max_tokens above it is a 400, as vLLM answers.
MAX_MODEL_LEN = 8192
#: Retry-After sent with an overload answer when the retry_after_s fault is unset.
DEFAULT_RETRY_AFTER_S = 1

_json = msgspec.json.Encoder()


def json_response(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json",
                        headers=headers)


def retry_headers(node: NodeView, default: float | None = None) -> dict[str, str]:
    value = node.engine.faults.retry_after_s
    if value is None:
        value = default
    if value is None:
        return {}
    return {"Retry-After": str(max(0, round(value)))}


class Face:
    """One imitated engine. Stateless: a node keeps its state, the face only shapes answers."""

    #: the ``--engine`` name
    name = "vllm"
    #: ``owned_by`` in /v1/models
    owner = "vllm"
    #: Refuses connections until its model is loaded (else: listens at once, 503 while loading).
    listen_after_load = True
    #: A request for a model still loading gets the loading error (else: 404 like unknown).
    loading_answers_503 = False
    #: A router (llama.cpp router mode) that holds no model and loads none is up and idle,
    #: not loading: its /health answers 200 as the real one does.
    idle_router = False

    def error_body(self, status: int, message: str, kind: str) -> Any:
        """The error body. ``kind``: bad_request, not_found, overloaded, loading, internal."""
        vtype = {"bad_request": "BadRequestError", "not_found": "NotFoundError",
                 "overloaded": "ServiceUnavailableError", "loading": "ServiceUnavailableError",
                 }.get(kind, "InternalServerError")
        return {"error": {"message": message, "type": vtype, "param": None, "code": status}}

    def error(self, status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
        return json_response(self.error_body(status, message, kind), status, headers)

    def overload(self, node: NodeView) -> web.Response:
        message = "The server is overloaded: too many requests waiting. Retry later."
        return self.error(503, message, "overloaded", retry_headers(node, DEFAULT_RETRY_AFTER_S))

    def loading_error(self) -> web.Response:
        return self.error(503, "The model is still loading", "loading")

    def health_ok(self) -> web.Response:
        return web.Response(status=200)

    #: Replies say how many prompt tokens came from the prefix cache
    #: (``usage.prompt_tokens_details.cached_tokens``: vLLM with --enable-prompt-tokens-details,
    #: SGLang with --enable-cache-report, OpenAI's API, llama-server).
    reports_cached_tokens = True

    def usage(self, usage: dict[str, Any], req: SimRequest) -> dict[str, Any]:
        """The ``usage`` object of a reply (final chunk of a stream)."""
        if self.reports_cached_tokens:
            usage["prompt_tokens_details"] = {"cached_tokens": req.cached_tokens}
        return usage

    #: How the engine continues a chat whose last message is the assistant's (assistant
    #: prefill, what the router continues a failed stream with): "flag" when the request says
    #: ``continue_final_message: true`` (vLLM, SGLang, TGI), "always" (llama-server, whose
    #: ``--prefill-assistant`` is on by default), "never" (OpenAI's API answers a new message).
    prefill = "flag"

    def continues(self, body: dict[str, Any]) -> bool:
        """Whether this chat body (its last message the assistant's) continues that message;
        ValueError with the engine's wording for a combination it refuses."""
        if self.prefill == "always":
            return True
        return self.prefill == "flag" and body.get("continue_final_message") is True

    def check_request(self, node: NodeView, body: dict[str, Any]) -> None:
        """The engine's own request fields: ValueError (a 400 with its message) for one it
        refuses. Called once per request, after the body parsed."""

    def reply_extra(self, req: SimRequest) -> dict[str, Any]:
        """Top-level fields beside ``usage`` in a reply and a stream's last chunks."""
        return {}

    def adapter_of(self, node: NodeView, model: str) -> str | None:
        """The loaded LoRA adapter a request's ``model`` runs on, or None (vLLM: the adapter's
        own name, as ``/v1/load_lora_adapter`` named it)."""
        return model if model in node.adapters else None

    def add_routes(self, node: NodeView, r: web.UrlDispatcher) -> None:
        """The engine's own routes beside the shared OpenAI, health, metrics and /sim ones."""
