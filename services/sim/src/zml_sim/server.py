"""HTTP server of a simulated node: vLLM's OpenAI server by default, or TGI / SGLang / llama.cpp /
a plain OpenAI-compatible server.

Each :class:`SimNode` owns one :class:`~zml_sim.engine.SimEngine` and one aiohttp
``AppRunner``, so a whole fleet runs in one process and one event loop. This module is what the
engines share (the OpenAI API, health, metrics, the /sim admin routes); what differs between
them is the node's *face*, one module per engine under :mod:`zml_sim.faces`.

Example::

    node = SimNode("h100-1", "nvidia_h100", ["llama-3-8b"], time_scale=50, load_time_s=0)
    await node.start()            # port 0: pick a free port
    print(node.url)               # http://127.0.0.1:PORT
    ...
    await node.stop()

Like vLLM, a node *binds* its port at start (so a port clash fails at once) but only *listens*
after its models loaded for the engines that refuse connections while loading (vllm, tgi,
openai); SGLang and llama.cpp listen at once and answer 503 until loaded.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import socket
import time
from dataclasses import asdict, replace
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.config import KVEventsConfig, NodeConfig, zmq_address
from zml_sim import admin
from zml_sim import embeddings
from zml_sim import transcription
from zml_sim.engine import KV_BYTES_PER_TOKEN
from zml_sim.engine import Faults
from zml_sim.engine import SimEngine
from zml_sim.engine import SimError
from zml_sim.engine import SimRequest
from zml_sim.engine import continued_prompt
from zml_sim.engine import generated_tokens
from zml_sim.faces import ENGINES
from zml_sim.kvhandoff import SGLANG_WAIT_S, HandoffError, KVHandoff, loaded_tokens
from zml_sim.faces import FACES
from zml_sim.faces.base import DEFAULT_RETRY_AFTER_S
from zml_sim.faces.base import MAX_MODEL_LEN
from zml_sim.faces.base import json_response
from zml_sim.faces.base import retry_headers
from zml_sim.kvpublish import KVEventPublisher
from zml_sim.metrics import render_metrics
from zml_sim.prefixcache import token_ids
from zmlcore.fleet.perfmodel import SimProfile
from zmlcore.fleet.perfmodel import estimate_tokens

log = logging.getLogger("zml_sim")

#: Engines that do not accept connections until their model is loaded.
LISTEN_AFTER_LOAD = frozenset(n for n, f in FACES.items() if f.listen_after_load)
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
__all__ = ["DEFAULT_MODEL", "DEFAULT_RETRY_AFTER_S", "ENGINES", "LISTEN_AFTER_LOAD", "MAX_MODEL_LEN",
           "SimNode", "SimPortInUseError", "endpoint_port", "start_fleet"]

_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimPortInUseError(OSError):
    """The node's port is taken by another process (or another node)."""

    def __init__(self, node_id: str, host: str, port: int) -> None:
        self.node_id = node_id
        self.host = host
        self.port = port
        super().__init__(errno.EADDRINUSE, f"node {node_id}: port {port} on {host} is already in use")


class _BadRequest(Exception):
    pass


def _bind(node_id: str, host: str, port: int) -> socket.socket:
    """Bind (without listening: connections are refused until the site starts)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SimPortInUseError(node_id, host, port) from exc
        raise
    sock.setblocking(False)
    return sock


_json_response = json_response


@web.middleware
async def _client_gone(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A client that closes its connection before (or while) its answer is written is normal:
    the request ends quietly, as a real engine's would, instead of aiohttp's "Error handling
    request" traceback. ``ClientConnectionResetError`` ("Cannot write to closing transport") is
    a ``ConnectionResetError``."""
    try:
        return await handler(request)
    except ConnectionResetError as exc:
        log.debug("%s %s: the client went away (%s)", request.method, request.path, exc)
        raise asyncio.CancelledError from exc


class SimNode:
    """One simulated accelerator node: engine + HTTP server (see the module docstring)."""

    def __init__(
        self,
        node_id: str,
        accelerator: str,
        models: Iterable[str] = (DEFAULT_MODEL,),
        *,
        engine: str = "vllm",
        time_scale: float = 1.0,
        seed: int = 0,
        max_waiting: int | None = None,
        driver_version: str | None = None,
        faults: Faults | None = None,
        model_sizes: dict[str, float] | None = None,
        prefix_caching: bool = True,
        kv_cache_blocks: int | None = None,
        kv_events: KVEventsConfig | None = None,
        kv_gbps: float | None = None,
        **profile_overrides: float | int | None,
    ) -> None:
        if accelerator not in ACCELERATORS:
            raise ValueError(f"unknown accelerator {accelerator!r} (one of {', '.join(ACCELERATORS)})")
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r} (one of {', '.join(ENGINES)})")
        self.node_id = node_id
        self.last_traceparent = ""
        self.accelerator = accelerator
        self.engine_kind = engine
        #: what is engine-specific about this node's HTTP answers (zml_sim.faces)
        self.face = FACES[engine]
        self.initial_models = list(models)
        self.driver_version = driver_version or ACCELERATORS[accelerator].min_driver
        profile = SimProfile.for_type(accelerator, **profile_overrides)
        self.engine = SimEngine(node_id, profile, time_scale=time_scale, seed=seed,
                                max_waiting=max_waiting, faults=faults, model_sizes=model_sizes,
                                prefix_caching=prefix_caching, kv_cache_blocks=kv_cache_blocks)
        #: vLLM's KV-event sockets (``--kv-events-config``), bound where zml.toml says the node's
        #: engine publishes; None: the node publishes no events.
        self.kv_publisher: KVEventPublisher | None = None
        if kv_events is not None and prefix_caching:
            if engine not in ("vllm", "sglang"):
                raise ValueError(f"node {node_id}: only vllm and sglang publish KV events")
            self.kv_publisher = KVEventPublisher(_bind_address(kv_events.endpoint) or kv_events.endpoint,
                                                 _bind_address(kv_events.replay_endpoint),
                                                 topic=kv_events.topic,
                                                 layout="sglang" if engine == "sglang" else "0.34")
            self.engine.on_kv_events = self.kv_publisher.publish
        #: disaggregated prefill/decode: blocks held for remote decodes, pulls (zml_sim.kvhandoff)
        self.handoff = KVHandoff(node_id, gbps=kv_gbps, block_size=profile.kv_block_size)
        self.host = "127.0.0.1"
        self.port = 0
        self.started_at = time.time()
        self._sock: socket.socket | None = None
        self._runner: web.AppRunner | None = None
        self._serve_task: asyncio.Task[None] | None = None
        self._revive_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._hung: set[asyncio.Future[None]] = set()
        #: vLLM sleep mode: the models offloaded by POST /sleep, reloaded by POST /wake_up.
        self.sleeping: list[str] = []
        #: LoRA adapters loaded at run time (vLLM /v1/load_lora_adapter): name -> path; they run on
        #: the served model and are listed in /v1/models with it as their parent.
        self.adapters: dict[str, str] = {}

    @classmethod
    def from_config(cls, node: NodeConfig, *, time_scale: float | None = None) -> SimNode:
        """A node from a ``[[nodes]]`` entry with a ``[nodes.sim]`` table.

        The imitated engine is ``sim.engine``, or the node's ``backend`` when sim.engine is
        left at its default."""
        sim = node.sim
        if sim is None:
            raise ValueError(f"node {node.id!r} has no [nodes.sim] table")
        engine = sim.engine if sim.engine != "vllm" else node.backend
        return cls(
            node.id, node.accelerator, node.models or [DEFAULT_MODEL], engine=engine,
            time_scale=time_scale or sim.time_scale, seed=sim.seed, max_waiting=sim.max_waiting,
            driver_version=sim.driver_version, speed=sim.speed, prefill_tps=sim.prefill_tps,
            decode_tps=sim.decode_tps, max_concurrency=sim.max_concurrency,
            load_time_s=sim.load_time_s, memory_gib=sim.memory_gib,
            cost_per_hour=node.cost_per_hour, prefix_caching=sim.prefix_caching,
            kv_block_size=sim.kv_block_size, kv_cache_blocks=sim.kv_cache_blocks,
            kv_events=node.kv_events, kv_gbps=node.kv_gbps,
        )

    # ----- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def listening(self) -> bool:
        return self._runner is not None

    async def start(self, host: str = "127.0.0.1", port: int = 0, *, wait: bool = True) -> None:
        """Bind ``host:port`` (0: any free port), start loading the models, and listen.

        With ``wait`` (default) return once the port listens, which for vllm/tgi/openai is
        after loading; otherwise return at once and use :meth:`wait_listening`.
        Raises :class:`SimPortInUseError` if the port is taken."""
        self.host = host
        self._sock = _bind(self.node_id, host, port)
        self.port = self._sock.getsockname()[1]
        if self.kv_publisher is not None:
            await self.kv_publisher.start()
        self.engine.start()
        for model in self.initial_models:
            self.engine.load(model)
        self._serve_task = asyncio.get_running_loop().create_task(self._serve())
        if wait:
            await self.wait_listening()

    async def wait_listening(self) -> None:
        """Until the node listens (re-raises a failure to listen)."""
        if self._serve_task is not None:
            await asyncio.shield(self._serve_task)

    async def _serve(self) -> None:
        if self.face.listen_after_load:
            for model in list(self.engine.loading):
                await self.engine.wait_loaded(model)
        sock, self._sock = self._sock, None
        assert sock is not None
        runner = web.AppRunner(self._make_app(), shutdown_timeout=0.1, handler_cancellation=True,
                               access_log=None)
        await runner.setup()
        site = web.SockSite(runner, sock)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            sock.close()
            if exc.errno == errno.EADDRINUSE:
                raise SimPortInUseError(self.node_id, self.host, self.port) from exc
            raise
        self._runner = runner

    async def _close_server(self) -> None:
        if self._serve_task is not None and not self._serve_task.done():
            self._serve_task.cancel()
            await asyncio.wait([self._serve_task])
        for fut in list(self._hung):
            fut.cancel()
        runner, self._runner = self._runner, None
        if runner is not None:
            # A crash drops connections at once (aiohttp's graceful shutdown would let
            # in-flight handlers finish); aborting a transport cancels its handler.
            if runner.server is not None:
                for conn in runner.server.connections:
                    if conn.transport is not None:
                        conn.transport.abort()
            await runner.cleanup()
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    async def stop(self) -> None:
        """Stop listening, fail in-flight requests and stop the engine."""
        for task in [self._revive_task, *self._tasks]:
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        await self._close_server()
        await self.engine.stop()
        if self.kv_publisher is not None:
            await self.kv_publisher.stop()

    async def crash(self, for_s: float | None = None) -> None:
        """Stop listening at once, dropping connections and in-flight requests.

        With ``for_s`` the node comes back after that many real seconds and reloads the models
        it had (loading time applies)."""
        models = [*self.engine.models, *self.engine.loading] or self.initial_models
        self.engine.faults = replace(self.engine.faults, crash=True, crash_for_s=for_s)
        await self._close_server()
        self.engine.reset("node crashed", clear_stats=True)
        if self.kv_publisher is not None:  # the engine process is gone, and its sockets with it
            await self.kv_publisher.stop()
        if for_s is not None:
            self._revive_task = asyncio.get_running_loop().create_task(self._revive(for_s, models))

    async def _revive(self, delay: float, models: list[str]) -> None:
        await asyncio.sleep(delay)
        await self.restart(models)

    async def restart(self, models: Iterable[str] | None = None) -> None:
        """Come back after a crash: bind the same port again and reload ``models``."""
        self.engine.faults = replace(self.engine.faults, crash=False, crash_for_s=None)
        self._sock = _bind(self.node_id, self.host, self.port)
        if self.kv_publisher is not None:
            await self.kv_publisher.start()  # a new process: numbering starts again at 0
        for model in models if models is not None else self.initial_models:
            self.engine.load(model)
        self._serve_task = asyncio.get_running_loop().create_task(self._serve())

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- app ---------------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        # OpenAI's upload limit for audio files, plus the multipart framing and form fields
        app = web.Application(client_max_size=transcription.MAX_FILE_BYTES + 1024 * 1024,
                              middlewares=[_client_gone])
        r = app.router
        r.add_post("/v1/chat/completions", self._chat)
        r.add_post("/v1/completions", self._completions)
        r.add_post("/v1/embeddings", self._embeddings)
        r.add_post("/v1/audio/transcriptions", self._transcriptions)
        r.add_post("/v1/audio/translations", self._translations)
        r.add_get("/v1/models", self._models)
        r.add_get("/health", self.health)
        r.add_get("/metrics", self._metrics)
        r.add_get("/zml/v1/node", self._node)
        r.add_post("/sim/kv/pull", self._kv_pull)
        admin.add_routes(self, r)
        self.face.add_routes(self, r)
        return app

    # ----- errors, engine-shaped ---------------------------------------------------------------

    def error(self, status: int, message: str, kind: str,
               headers: dict[str, str] | None = None) -> web.Response:
        """An error body in the imitated engine's shape. ``kind``: bad_request, not_found,
        overloaded, loading, internal."""
        return self.face.error(status, message, kind, headers)

    def _retry_headers(self, default: float | None = None) -> dict[str, str]:
        return retry_headers(self, default)

    async def _overload(self) -> web.Response:
        delay = self.engine.faults.overload_delay_s
        if delay:
            await asyncio.sleep(delay)
        return self.face.overload(self)

    def loading_error(self) -> web.Response:
        return self.face.loading_error()

    # ----- inference ---------------------------------------------------------------------------

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.last_traceparent = request.headers.get("traceparent", "")[:100]
        return await self._generate(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        self.last_traceparent = request.headers.get("traceparent", "")[:100]
        return await self._generate(request, chat=False)

    def _parse(self, raw: bytes, chat: bool) -> dict[str, Any]:
        try:
            body = _decode.decode(raw)
        except msgspec.DecodeError as exc:
            raise _BadRequest(f"Invalid JSON in request body: {exc}") from exc
        if not isinstance(body, dict):
            raise _BadRequest("Request body must be a JSON object")
        ids: list[int] | None = None
        text: str | None
        offset = 0
        prefix: str | None = None
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("Field 'messages' is required: a non-empty list of messages")
            parts: list[str] = []
            last = messages[-1]
            if isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str):
                try:
                    if self.face.continues(body):  # the engine's assistant prefill
                        prefix = last["content"]
                        messages = messages[:-1]
                except ValueError as exc:
                    raise _BadRequest(str(exc)) from None
            for msg in messages:
                if not isinstance(msg, dict) or "role" not in msg:
                    raise _BadRequest("Each message must be an object with a 'role'")
                content = msg.get("content")
                if isinstance(content, str):
                    parts.append(content)
                elif isinstance(content, list):
                    for p in content:  # a part's text must be a string (it crashed the sim: 500)
                        text = p.get("text", "") if isinstance(p, dict) else None
                        if not isinstance(text, str):
                            raise _BadRequest("Each content part must be an object whose 'text' is a string")
                        parts.append(text)
            text = "".join(parts)
            if prefix is not None:  # generation goes on where the assistant's text ends
                offset = generated_tokens(prefix)
                text += prefix
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                text = prompt
            elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
                text, ids = None, prompt
            elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
                text = "".join(prompt)
            else:
                raise _BadRequest("Field 'prompt' is required: a string, list of strings or token ids")
            if text is not None:  # the prompt plus the text so far: a completion to continue
                head, offset = continued_prompt(text, self.engine.faults.separator_tokens)
                if offset:
                    prefix = text[len(head):]
        # The prompt's tokens (one per 4 characters, estimate_tokens' count): a chat's messages
        # are joined, so each turn of a conversation extends the previous turn's prompt. Output
        # continued from a prefix counts its tokens as generated (what the engine's tokenizer
        # makes of its own output).
        tokens = token_ids(text) if text is not None else ids
        assert tokens is not None
        if text is None:
            prompt_tokens = len(tokens)
        elif offset:
            prompt_tokens = estimate_tokens(text[:len(text) - len(prefix or "")]) + offset
        else:
            prompt_tokens = estimate_tokens(text)
        max_tokens = body.get("max_completion_tokens") if chat else None
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise _BadRequest("max_tokens must be an integer >= 1")
        requested = prompt_tokens + (max_tokens or 0)
        if prompt_tokens >= MAX_MODEL_LEN or requested > MAX_MODEL_LEN:  # vLLM's check and wording
            raise _BadRequest(
                f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, you requested "
                f"{requested} tokens ({prompt_tokens} in the messages, {max_tokens or 0} in the completion). "
                "Please reduce the length of the messages or completion.")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _BadRequest("Field 'model' must be a string")
        opts = body.get("stream_options")
        kvp = body.get("kv_transfer_params")
        boot = None
        if body.get("bootstrap_room") is not None and body.get("bootstrap_host") is not None:
            boot = (str(body["bootstrap_host"]), body.get("bootstrap_port"), body["bootstrap_room"])
        return {
            "kv_transfer_params": kvp if isinstance(kvp, dict) else None,
            "bootstrap": boot,
            "model": model,
            "prompt_tokens": prompt_tokens,
            "tokens": tokens,
            "max_tokens": max_tokens,
            "stream": bool(body.get("stream", False)),
            "include_usage": isinstance(opts, dict) and bool(opts.get("include_usage")),
            "stream_options": opts is not None,
            "offset": offset,
        }

    def _served(self, model: str | None) -> str | web.StreamResponse:
        """The model a request runs on (like vLLM: the served one when none is named), or the
        answer refusing it: still loading (503 where the imitated engine says so) or unknown."""
        eng = self.engine
        if model is None:
            if not eng.models:
                return self.loading_error() if eng.loading else self.error(404, "No model is loaded", "not_found")
            return next(iter(eng.models))
        if model in self.adapters and eng.models:
            return next(iter(eng.models))  # a LoRA runs on the base model
        if model not in eng.models:
            if model in eng.loading and self.face.loading_answers_503:
                return self.loading_error()
            return self.error(404, f"The model `{model}` does not exist.", "not_found")
        return model

    def _injected_error(self) -> web.StreamResponse | None:
        """The fault plan's error answer for this request, if it draws one."""
        eng = self.engine
        if not eng.sample_error():
            return None
        return self.error(eng.faults.error_status, "Injected fault: internal server error", "internal",
                          self._retry_headers())

    async def _generate(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        eng = self.engine
        try:
            args = self._parse(await request.read(), chat)
        except _BadRequest as exc:
            return self.error(400, str(exc), "bad_request")
        if args["stream_options"] and eng.faults.refuse_stream_options:
            return self.error(400, "Unrecognized request argument supplied: stream_options", "bad_request")
        model = self._served(args["model"])
        if not isinstance(model, str):
            return model
        if eng.overloaded:
            return await self._overload()
        if eng.faults.hang:
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._hung.add(fut)
            try:
                await fut  # until the client goes away or the node stops
            finally:
                self._hung.discard(fut)
            raise asyncio.CancelledError
        if (refused := self._injected_error()) is not None:
            return refused
        handing = self._handoff_leg(args)
        loaded = 0
        if handing is not None and handing[0] == "pull":
            try:
                loaded = await self._pull_kv(model, args["tokens"], handing[1])
            except HandoffError as exc:
                return self.error(400, f"kv_transfer_params: {exc}", "bad_request")
        drop = eng.sample_drop()
        stall = eng.sample_stall()
        req = eng.submit(model, args["prompt_tokens"], args["max_tokens"], tokens=args["tokens"],
                         offset=args["offset"], loaded=loaded)
        hold = handing[1] if handing is not None and handing[0] == "hold" else None
        try:
            if args["stream"]:
                return await self._stream(request, req, chat=chat, drop=drop, stall=stall,
                                          include_usage=args["include_usage"], hold=hold)
            return await self._complete(request, req, chat=chat, drop=drop, stall=stall, hold=hold)
        finally:
            eng.cancel(req)

    # ----- disaggregated prefill/decode (zml_sim.kvhandoff) ------------------------------------

    def _handoff_leg(self, args: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """("hold", how) for a prefill leg whose KV a remote decode will pull, ("pull", from
        where) for a decode leg, None for a whole request."""
        kvp = args["kv_transfer_params"]
        if self.face.name == "vllm" and kvp is not None:
            if kvp.get("do_remote_prefill"):
                return "pull", {"host": kvp.get("remote_host"), "port": kvp.get("remote_port"),
                                "body": {"engine_id": kvp.get("remote_engine_id"),
                                         "block_ids": kvp.get("remote_block_ids")}}
            if kvp.get("do_remote_decode"):
                return "hold", {"vllm": True}
            return None
        boot = args["bootstrap"]
        if self.face.name == "sglang" and boot is not None:
            host, port, room = boot
            if self._is_me(host, port):
                return "hold", {"room": room}
            return "pull", {"host": host, "port": port, "body": {"room": room, "wait_s": SGLANG_WAIT_S}}
        return None

    def _is_me(self, host: str, port: Any) -> bool:
        try:
            return int(port) == self.port and host in (self.host, "localhost", "127.0.0.1", "::1")
        except (TypeError, ValueError):
            return False

    async def _pull_kv(self, model: str, tokens: list[int] | None, where: dict[str, Any]) -> int:
        """Pull a prompt's KV from its prefill node at the link's speed; the tokens it covers."""
        if not where.get("host") or where.get("port") is None:
            raise HandoffError("remote_host and remote_port are required")
        held_model, held = await self.handoff.pull(str(where["host"]), where["port"], where["body"],
                                                   timeout_s=SGLANG_WAIT_S + 5.0)
        if held_model != model:
            raise HandoffError(f"the remote blocks are of model {held_model!r}, not {model!r}")
        n = loaded_tokens(held, tokens, self.engine.profile.kv_block_size)
        cache = self.engine.prefix_cache
        local = 0
        if cache is not None and tokens is not None:
            local = self.engine.cached_prefix(model, tokens)
        delay = self.handoff.transfer_s(max(0, n - local), KV_BYTES_PER_TOKEN)
        if delay > 0:
            await asyncio.sleep(self.engine.real_seconds(delay))
        return n

    def _hold_kv(self, req: SimRequest, hold: dict[str, Any]) -> dict[str, Any]:
        """After a prefill leg: hold its prompt for the decode node; vLLM's reply params."""
        now = time.monotonic()
        tokens = req.tokens or []
        if "room" in hold:
            self.handoff.hold(f"room:{hold['room']}", req.model, tokens, now)
            return {}
        return {"kv_transfer_params": self.handoff.vllm_params(req.model, tokens, self.host, self.port, now)}

    async def _kv_pull(self, request: web.Request) -> web.Response:
        try:
            body = _decode.decode(await request.read() or b"{}")
            if not isinstance(body, dict):
                raise HandoffError("expected a JSON object")
            held = await self.handoff.take(body, time.monotonic())
        except (msgspec.DecodeError, HandoffError) as exc:
            return self.error(404, str(exc), "not_found")
        return _json_response({"model": held.model, "tokens": held.tokens})

    async def _embeddings(self, request: web.Request) -> web.StreamResponse:
        """Deterministic vectors (``zml_sim.embeddings``), scheduled as a prefill."""
        eng = self.engine
        try:
            model, texts, dims, fmt, tokens = embeddings.parse(_decode.decode(await request.read()))
        except msgspec.DecodeError as exc:
            return self.error(400, f"Invalid JSON in request body: {exc}", "bad_request")
        except embeddings.EmbeddingRequestError as exc:
            return self.error(400, str(exc), "bad_request")
        served = self._served(model)
        if not isinstance(served, str):
            return served
        model = served
        if eng.overloaded:
            return await self._overload()
        if (refused := self._injected_error()) is not None:
            return refused
        req = eng.submit(model, tokens, 1)
        try:
            await req.text()
        except SimError as exc:
            return self.error(500, str(exc), "internal")
        finally:
            eng.cancel(req)
        return _json_response(embeddings.response(model, texts, dims, fmt, tokens))

    async def _transcriptions(self, request: web.Request) -> web.StreamResponse:
        return await self._audio(request, "transcribe")

    async def _translations(self, request: web.Request) -> web.StreamResponse:
        return await self._audio(request, "translate")

    async def _audio(self, request: web.Request, task: str) -> web.StreamResponse:
        """OpenAI's audio API on multipart/form-data (``zml_sim.transcription``): the audio
        occupies a slot like a prompt of its encoder frames, the text is decoded word by word."""
        eng = self.engine
        if not request.content_type.startswith("multipart/form-data"):
            return self.error(400, "Expected a multipart/form-data body with a 'file' field", "bad_request")
        try:
            form = await request.post()
        except web.HTTPRequestEntityTooLarge:
            return self.error(413, f"The audio file is larger than {transcription.MAX_FILE_BYTES} bytes",
                              "bad_request")
        except ValueError as exc:
            return self.error(400, f"Malformed multipart body: {exc}", "bad_request")
        upload = form.get("file")
        if not isinstance(upload, web.FileField):
            return self.error(400, "Field 'file' (the audio) is required", "bad_request")
        audio = upload.file.read()
        model = str(form.get("model") or "") or None
        fmt = str(form.get("response_format") or "json")
        stream = str(form.get("stream") or "").lower() in ("true", "1")
        grans = [str(g) for g in form.getall("timestamp_granularities[]", [])]
        try:
            transcription.check_format(fmt, stream)
            text = transcription.transcribe(model or "", audio, task=task,
                                            language=str(form.get("language") or "") or None)
        except transcription.TranscriptionRequestError as exc:
            return self.error(400, str(exc), "bad_request")
        served = self._served(model)
        if not isinstance(served, str):
            return served
        model = served
        if eng.overloaded:
            return await self._overload()
        if (refused := self._injected_error()) is not None:
            return refused
        req = eng.submit(model, transcription.prompt_tokens(text.duration), len(text.words))
        if stream:
            resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
            await resp.prepare(request)
            events = transcription.stream_events(text)
            try:
                decoding = True
                for event in events[:-1]:  # paced by the decode (a step may emit several tokens)
                    if decoding and await req.next_chunk() is None:
                        decoding = False
                    await resp.write(f"data: {event}\n\n".encode())
                while decoding and await req.next_chunk() is not None:
                    pass
                await resp.write(f"data: {events[-1]}\n\ndata: [DONE]\n\n".encode())
            except SimError as exc:
                await resp.write(f"data: {json.dumps({'error': {'message': str(exc)}})}\n\n".encode())
            finally:
                eng.cancel(req)
            await resp.write_eof()
            return resp
        try:
            await req.text()
        except SimError as exc:
            return self.error(500, str(exc), "internal")
        finally:
            eng.cancel(req)
        content_type, body = transcription.render(text, fmt, granularities=grans)
        return web.Response(body=body.encode(), headers={"content-type": content_type})

    def _envelope(self, req: SimRequest, chat: bool, chunk: bool) -> dict[str, Any]:
        prefix = "chatcmpl" if chat else "cmpl"
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": f"{prefix}-{self.node_id}-{req.id}", "object": obj,
                "created": int(time.time()), "model": req.model}

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": req.prompt_tokens, "completion_tokens": req.generated,
                                 "total_tokens": req.prompt_tokens + req.generated}
        return self.face.usage(usage, req)

    def _drop(self, request: web.Request, req: SimRequest) -> None:
        self.engine.cancel(req)
        if request.transport is not None:
            request.transport.abort()
        raise asyncio.CancelledError

    async def _stall(self, req: SimRequest) -> None:
        """Send nothing more, the connection open, until the client goes or the node stops."""
        self.engine.cancel(req)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._hung.add(fut)
        try:
            await fut
        finally:
            self._hung.discard(fut)
        raise asyncio.CancelledError

    async def _complete(self, request: web.Request, req: SimRequest, *, chat: bool,
                        drop: bool, stall: bool = False, hold: dict[str, Any] | None = None) -> web.StreamResponse:
        pieces: list[str] = []
        try:
            while (piece := await req.next_chunk()) is not None:
                pieces.append(piece)
                if (drop or stall) and req.generated >= self.engine.faults.fail_after_tokens:
                    if drop:
                        self._drop(request, req)
                    await self._stall(req)
        except SimError as exc:
            return self.error(500, str(exc), "internal")
        text = "".join(pieces)
        body = self._envelope(req, chat, chunk=False)
        if chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": req.finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": req.finish_reason}
        body["choices"] = [choice]
        body["usage"] = self._usage(req)
        body.update(self.face.reply_extra(req))
        if hold is not None and req.state == "done":
            body.update(self._hold_kv(req, hold))
        return _json_response(body)

    async def _stream(self, request: web.Request, req: SimRequest, *, chat: bool, drop: bool,
                      include_usage: bool, stall: bool = False,
                      hold: dict[str, Any] | None = None) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        head = self._envelope(req, chat, chunk=True)

        def event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
            data = {**head, "choices": choices, **extra}
            if include_usage and "usage" not in data:
                data["usage"] = None
            return b"data: " + _json.encode(data) + b"\n\n"

        async def send(choices: list[dict[str, Any]], **extra: Any) -> None:
            await resp.write(event(choices, **extra))

        first = True
        try:
            while (tokens := await req.next_tokens()) is not None:
                # One event per token, as an engine streams them; a group of steps in one write.
                events = []
                if chat and first:
                    events.append(event([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                          "logprobs": None, "finish_reason": None}]))
                for piece in tokens:
                    if chat:
                        choice: dict[str, Any] = {"index": 0, "delta": {"content": piece},
                                                  "logprobs": None, "finish_reason": None}
                    else:
                        choice = {"index": 0, "text": piece, "logprobs": None, "finish_reason": None}
                    events.append(event([choice]))
                await resp.write(b"".join(events))
                first = False
                if (drop or stall) and req.generated >= self.engine.faults.fail_after_tokens:
                    if drop:
                        self._drop(request, req)
                    await self._stall(req)
        except SimError as exc:
            # Engine failure mid-stream: vLLM sends an error event and ends the stream.
            err = {"error": {"message": str(exc), "type": "InternalServerError", "code": 500}}
            await resp.write(b"data: " + _json.encode(err) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        final = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
        # llama-server puts its timings on the usage chunk when there is one, else on this one.
        extra = {} if include_usage else self.face.reply_extra(req)
        if hold is not None and req.state == "done":  # a streamed prefill leg: params on the last chunk
            extra = {**extra, **self._hold_kv(req, hold)}
        await send([{**final, "logprobs": None, "finish_reason": req.finish_reason}], **extra)
        if include_usage:
            await send([], usage=self._usage(req), **self.face.reply_extra(req))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # ----- discovery and health ----------------------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        created = int(self.started_at)
        owner = self.face.owner
        data = [{"id": m, "object": "model", "created": created, "owned_by": owner, "root": m,
                 "parent": None, "max_model_len": MAX_MODEL_LEN} for m in [*self.engine.models, *self.sleeping]]
        base = next(iter(self.engine.models), None)
        if base is not None:
            data += [{"id": name, "object": "model", "created": created, "owned_by": owner, "root": path,
                      "parent": base, "max_model_len": MAX_MODEL_LEN} for name, path in self.adapters.items()]
        return _json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        if self.engine.sample_probe_loss():  # a lost probe: no answer at all
            if request.transport is not None:
                request.transport.abort()
            raise asyncio.CancelledError
        if not self.engine.models and not self.sleeping and (self.engine.loading or not self.face.idle_router):
            return self.loading_error()
        return self.face.health_ok()

    async def _node(self, request: web.Request) -> web.Response:
        return _json_response(self.probe())

    def probe(self) -> dict[str, Any]:
        """The ``/zml/v1/node`` document (hardware validation)."""
        return {
            "node_id": self.node_id,
            "accelerator_type": self.accelerator,
            "device_count": 1,
            "driver_version": self.driver_version,
            "memory_gib": self.engine.profile.memory_gib,
            "free_memory_gib": round(self.engine.free_memory_gib, 3),
            "engine": self.engine_kind,
            "models": list(self.engine.models),
            "loading_models": list(self.engine.loading),
        }

    # ----- metrics -----------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        text = render_metrics(self)
        return web.Response(body=text.encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    # ----- admin -------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The ``/sim/state`` document."""
        eng = self.engine
        return {
            "node_id": self.node_id,
            "accelerator": self.accelerator,
            "engine": self.engine_kind,
            "url": self.url,
            "listening": self.listening,
            # The W3C trace context of the last inference request (a real engine with
            # OpenTelemetry would continue that trace).
            "last_traceparent": self.last_traceparent,
            "time_scale": eng.time_scale,
            "seed": eng.seed,
            "models": list(eng.models),
            "loading": {m: round(s, 3) for m, s in eng.loading_remaining().items()},
            "queue": {"waiting": len(eng.waiting), "max_waiting": eng.max_waiting},
            "batch": {"running": eng.running, "prefilling": eng.prefilling.id if eng.prefilling else None,
                      "prefill_pending": len(eng.prefill_queue), "decoding": len(eng.decoding),
                      "max_concurrency": eng.profile.max_concurrency},
            "kv_cache_usage": eng.kv_cache_usage,
            "kv_capacity_tokens": eng.kv_capacity_tokens,
            "prefix_cache": self.prefix_cache_state(),
            "free_memory_gib": round(eng.free_memory_gib, 3),
            "faults": eng.faults.to_dict(),
            "profile": asdict(eng.profile),
            "counters": {m: s.to_dict() for m, s in eng.stats.items()},
            "kv_handoff": self.handoff.state(),
        }


    def prefix_cache_state(self) -> dict[str, Any] | None:
        cache = self.engine.prefix_cache
        if cache is None:
            return None
        pub = self.kv_publisher
        return {"block_size": cache.block_size, "capacity_blocks": self.engine.cache_capacity_blocks,
                "cached_blocks": cache.blocks, "queries_tokens": sum(s.prefix_queries for s in self.engine.stats.values()),
                "hits_tokens": sum(s.prefix_hits for s in self.engine.stats.values()),
                "kv_events": None if pub is None else {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
                                                       "next_seq": pub.seq, "dropped": pub.dropped}}


def _bind_address(endpoint: str | None) -> str | None:
    """Where a sim binds the address zml.toml gives for its engine's socket (tcp://host:port or
    ipc://path): the same address (the health service connects to it)."""
    if endpoint is None:
        return None
    addr = zmq_address(endpoint)
    if addr is None:
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT or ipc://PATH")
    return endpoint


# ----- fleet -------------------------------------------------------------------------------------


def endpoint_port(endpoint: str) -> tuple[str | None, int]:
    """(host, port) of a node endpoint URL (port defaults by scheme)."""
    parts = urlsplit(endpoint)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return parts.hostname, port


async def start_fleet(nodes: list[NodeConfig], host: str | None = "127.0.0.1", *,
                      time_scale: float | None = None, faults: Faults | None = None) -> list[SimNode]:
    """Start every node that has a ``[nodes.sim]`` table on its endpoint's port.

    ``host=None`` binds each endpoint's own host. Returns once every node listens; on a
    failure the nodes already started are stopped and the error (e.g. SimPortInUseError) is
    raised. ``faults`` (e.g. from CLI flags) apply to every node."""
    sims = [SimNode.from_config(n, time_scale=time_scale) for n in nodes if n.sim is not None]
    for sim in sims:
        if faults is not None:
            sim.engine.faults = faults
    started: list[SimNode] = []
    seen: dict[int, str] = {}
    try:
        for node, cfg in zip(sims, [n for n in nodes if n.sim is not None]):
            ep_host, port = endpoint_port(cfg.endpoint)
            bind_host = host or ep_host or "127.0.0.1"
            if port in seen:
                raise SimPortInUseError(node.node_id, bind_host, port)
            seen[port] = node.node_id
            await node.start(bind_host, port, wait=False)
            started.append(node)
        await asyncio.gather(*(n.wait_listening() for n in started))
    except BaseException:
        await asyncio.gather(*(n.stop() for n in started), return_exceptions=True)
        raise
    return started
