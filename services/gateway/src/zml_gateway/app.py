"""The HTTP gateway as a raw ASGI app (no framework: the per-request path is a handful of
dict lookups, a NATS request and a write).

Routes (the table in :class:`Gateway`): POST /v1/chat/completions, POST /v1/completions
(OpenAI-compatible, streaming or not), POST /v1/embeddings, POST /v1/audio/transcriptions and
/v1/audio/translations (OpenAI's multipart form: zml_gateway.infer.audio), GET /v1/models,
GET /v1/models/{id}, GET /v1/nodes, GET /healthz; any other path is 404, a known path with
the wrong method 405. An inference body is validated here with the router's own rules
(zmlcore.messages.validate), so a bad request is a 400 before it costs a NATS round trip, and
then goes to the front-door subject ``zml.gateway.infer`` (zml_gateway.infer). Every answer
that is not a 200 carries OpenAI's error body (``message``, ``type``, ``code``).

The parts, each given what it uses: :mod:`zml_gateway.infer` (intake, the NATS exchange, one
reply or a stream), :mod:`zml_gateway.listing` (models, nodes, health), and the middleware
around this app (:mod:`zml_gateway.observe`: metrics, tracing, the dashboard).
"""

from __future__ import annotations

import asyncio
import logging

from nats.aio.client import Client as NATS

from zmlcore.access.apikeys import KeyRing
from zmlcore.batch.api import BatchApi
from zmlcore.config import ZMLConfig
from zmlcore.errors import MethodNotAllowedError, NotFoundError, ZMLError
from zmlcore.fleet.costs import CostTable
from zmlcore.messages import NodeState
from zmlcore.messages.validate import clip
from zml_gateway.access import Access
from zml_gateway.asgi import Receive, Scope, Send, send_error, without_body
from zml_gateway.batches import BatchRoutes
from zml_gateway.infer.audio import AudioRoute
from zml_gateway.infer.handler import Inference
from zml_gateway.infer.intake import Intake
from zml_gateway.infer.upstream import Upstream
from zml_gateway.listing import Listing
from zml_gateway.nodetable import NodeTable
from zml_gateway.routes import Routes

log = logging.getLogger("zml.gateway")


class Gateway:
    def __init__(self, cfg: ZMLConfig, nc: NATS, nodes: dict[str, NodeState], costs: CostTable | None = None,
                 access: Access | None = None, batch_api: BatchApi | None = None) -> None:
        self.cfg = cfg
        self.nc = nc
        self.access = access or Access(cfg, KeyRing(cfg.gateway.api_keys), None)
        #: the fleet for /v1/nodes and the dashboard (``nodes`` kept current by the service)
        self.node_table = NodeTable(nc, nodes, costs or CostTable())
        self.intake = Intake(cfg, nc, self.access)
        self.inference = Inference(cfg, self.intake, self.access, Upstream(cfg, nc))
        listing = Listing(cfg, nc, nodes, self.access, self.node_table)

        r = self.routes = Routes()
        r.add("POST", "/v1/chat/completions", self.inference)
        r.add("POST", "/v1/completions", self.inference)
        r.add("POST", "/v1/embeddings", self.inference)
        r.add("POST", "/v1/audio/transcriptions", AudioRoute(self.inference, "transcription"))
        r.add("POST", "/v1/audio/translations", AudioRoute(self.inference, "translation"))
        r.add("GET", "/v1/models", listing.models)
        r.add("GET", "/v1/models/{model:path}", listing.model)
        r.add("GET", "/v1/nodes", listing.node_table)
        r.add("GET", "/v1/decisions/{decision_id}", listing.decision)
        r.add("GET", "/healthz", listing.healthz)
        if batch_api is not None:  # /v1/files and /v1/batches (zml_gateway.batches)
            BatchRoutes(cfg, batch_api, self.access, self.intake).add_to(r)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        try:
            found = self.routes.match(path)
            if found is None:
                raise NotFoundError(f"no route {clip(path, 80)}: see /v1/chat/completions, /v1/completions, /v1/models")
            methods, params = found
            handler = methods.get(method)
            if handler is None:
                handler = methods.get("GET") if method == "HEAD" else None
                if handler is None:
                    raise MethodNotAllowedError(f"{clip(path, 80)} takes {', '.join(methods)}, not {clip(method, 20)}")
                # HEAD is GET without the body (RFC 9110 9.3.2; load balancers probe /healthz so):
                # the same status and headers, content-length included, on HTTP/1.1 and HTTP/2.
                send = without_body(send)
            if params is not None:
                scope["path_params"] = params
            await handler(scope, receive, send)
        except ZMLError as exc:
            await send_error(send, exc, self.routes.allow(path) if exc.http_status == 405 else None)
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug must not answer with a traceback: log it, answer INTERNAL
            log.exception("internal error on %s %s", method, clip(path, 80))
            await send_error(send, ZMLError("internal error in the gateway"))

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
