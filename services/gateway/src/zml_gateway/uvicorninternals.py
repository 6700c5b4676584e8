"""Everything the gateway takes from uvicorn beyond its documented API, and the start-up check
that it is there.

uvicorn documents ``Config``, ``Server`` and the ASGI interface, not its protocol classes. The
gateway subclasses two of them (zml_gateway.protocol): ``HttpToolsProtocol``, to bound request
heads (431/408) and hand HTTP/2 connections over, and ``RequestResponseCycle`` (``FastCycle``),
to write a fixed-length response in one write and tell the app of a lost client without a
task. They come from here, the only module that imports uvicorn's internal modules, and rely on:

- the ``HttpToolsProtocol`` callbacks they override (:data:`PROTOCOL_HOOKS`): an override of a
  method uvicorn stopped calling would silently drop the head bounds;
- the protocol's and the cycle's state they read and write, stored where :data:`STATE` says
  (uvicorn builds each request's cycle in ``on_headers_complete``; it becomes a ``FastCycle``
  right after);
- ``ServerState``'s connection and task sets (graceful shutdown of HTTP/2 connections);
- ``Server.serve`` entering ``Server.capture_signals`` (see :class:`GatewayServer`).

:func:`check` runs when the gateway service is built, before it connects: a missing piece is a
ConfigError naming the uvicorn version and the piece (one line, exit 2). Only the signals piece
has a fallback, logged. The versions checked against are :data:`VERIFIED`, the range
pyproject.toml allows; CI also runs the suites against the newest release (.ci/run).
"""

from __future__ import annotations

import contextlib
import dis
import importlib.metadata
import logging
from collections.abc import Iterator
from typing import Any

import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
# The checks and status lines uvicorn writes a response head with (zml_gateway.protocol.FastCycle
# writes the head of a whole reply itself, checked the same): in every release VERIFIED spans.
from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)
from uvicorn.server import ServerState

from zmlcore.errors import ConfigError

__all__ = ["HEADER_RE", "HEADER_VALUE_RE", "STATUS_LINE", "GatewayServer", "HttpToolsProtocol",
           "RequestResponseCycle", "ServerState", "check"]

log = logging.getLogger("zml.gateway")

#: The uvicorn releases the gateway was checked against (oldest, newest), and the range
#: pyproject.toml allows from them (a test keeps the two equal).
VERIFIED = ("0.31.0", "0.55.0")
REQUIREMENT = "uvicorn>=0.31,<0.56"

#: HttpToolsProtocol methods zml_gateway.protocol overrides (and calls through super()).
PROTOCOL_HOOKS: tuple[tuple[type, str], ...] = (
    *((HttpToolsProtocol, m) for m in ("connection_made", "connection_lost", "data_received", "on_message_begin",
                                       "on_url", "on_header", "on_headers_complete", "send_400_response")),
    (RequestResponseCycle, "send"),
    (FlowControl, "drain"),
)

#: (class, method, attributes that method stores): the state zml_gateway.protocol and http2 use.
STATE: tuple[tuple[type, str, tuple[str, ...]], ...] = (
    (HttpToolsProtocol, "__init__", ("connections", "server_state", "loop", "app", "flow", "cycle")),
    (HttpToolsProtocol, "connection_made", ("transport", "client", "server", "scheme")),
    (HttpToolsProtocol, "on_headers_complete", ("cycle",)),
    (RequestResponseCycle, "__init__", ("scope", "transport", "flow", "disconnected", "keep_alive", "more_body",
                                        "response_started", "response_complete", "chunked_encoding",
                                        "expected_content_length", "message_event", "on_response",
                                        "access_log", "default_headers", "waiting_for_100_continue")),
    (FlowControl, "__init__", ("write_paused",)),
    (ServerState, "__init__", ("connections", "tasks", "default_headers")),
)


def version() -> str:
    try:
        return importlib.metadata.version("uvicorn")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "(unknown version)"


def _code(owner: type, method: str) -> Any:
    return getattr(getattr(owner, method, None), "__code__", None)


def _stores(owner: type, method: str) -> set[str]:
    """Attribute names ``owner.method`` assigns, read from its bytecode (nothing runs)."""
    code = _code(owner, method)
    return {str(i.argval) for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"} if code else set()


def missing(hooks: tuple[tuple[type, str], ...] = PROTOCOL_HOOKS,
            state: tuple[tuple[type, str, tuple[str, ...]], ...] = STATE) -> list[str]:
    """What this uvicorn lacks, as ``Class.method()`` or ``Class.attribute (set in method)``."""
    out = [f"{c.__qualname__}.{m}()" for c, m in hooks if not callable(getattr(c, m, None))]
    for owner, method, names in state:
        stored = _stores(owner, method)
        out += [f"{owner.__qualname__}.{n} (set in {method})" for n in names if n not in stored]
    return out


def serve_captures_signals(server: type = uvicorn.Server) -> bool:
    """Whether ``Server.serve`` installs its signal handlers through ``capture_signals``."""
    code = _code(server, "serve")
    return bool(code is not None and "capture_signals" in code.co_names and callable(getattr(server, "capture_signals", None)))


def check(found: list[str] | None = None, signals: bool | None = None, uvicorn_version: str | None = None) -> None:
    """Raise ConfigError if this uvicorn lacks what the gateway's protocol relies on; log once
    if uvicorn's own signal handlers cannot be kept out (see :class:`GatewayServer`)."""
    v = uvicorn_version or version()
    gone = missing() if found is None else found
    if gone:
        raise ConfigError(
            f"uvicorn {v} lacks {', '.join(gone)}, which the gateway's HTTP protocol relies on "
            f"(zml_gateway.uvicorninternals); the gateway is verified with uvicorn {VERIFIED[0]} to {VERIFIED[1]}: "
            f"pip install '{REQUIREMENT}'")
    if not (serve_captures_signals() if signals is None else signals):
        log.warning("uvicorn %s: Server.serve no longer goes through capture_signals, so the gateway cannot keep "
                    "uvicorn's SIGTERM/SIGINT handlers out; a signal may stop HTTP before the runner stops the "
                    "gateway in order (verified with uvicorn %s to %s)", v, *VERIFIED)


class GatewayServer(uvicorn.Server):
    """uvicorn's server without its signal handlers.

    Who owns SIGTERM/SIGINT in the gateway: the shared runner (zmlcore.runtime.runner), as in
    every ZML service. Its handler only sets a flag; the runner then stops the gateway in order
    (gRPC, then HTTP: no new connections, in-flight requests and streams finish within 10 s,
    then the dashboard, the limiter, the KV followers) and closes NATS last. ``Server.serve``
    would otherwise install uvicorn's own handlers while it runs (``capture_signals``, uvicorn
    0.29 on): HTTP stopping on its own, beside the runner, and the signal raised again once it
    has. (The ``install_signal_handlers`` override this replaces had done nothing since uvicorn
    removed that method.)"""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

