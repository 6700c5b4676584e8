"""HTTP server of a simulated node: vLLM's OpenAI server by default, or TGI / SGLang / llama.cpp /
a plain OpenAI-compatible server.

Each :class:`SimNode` owns one :class:`~zml_sim.engine.SimEngine` and one aiohttp
``AppRunner``, so a whole fleet runs in one process and one event loop. This module is the node's
life (bind, listen once loaded, stop, crash, restart) and its app; what the engines share is
beside it, by concern: the OpenAI API (:mod:`zml_sim.inference`), models, health, the node
document and metrics (:mod:`zml_sim.probe`), the /sim admin routes (:mod:`zml_sim.admin`);
what differs between them is the node's *face*, one module per engine under :mod:`zml_sim.faces`.

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
import logging
import math
import socket
import time
from dataclasses import asdict, replace
from typing import Any, Awaitable, Callable, Iterable
from urllib.parse import urlsplit

from aiohttp import web

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.config import KVEventsConfig, NodeConfig, zmq_address
from zml_sim import admin
from zml_sim import transcription
from zml_sim.engine import Faults
from zml_sim.engine import SimEngine
from zml_sim.faces import ENGINES
from zml_sim.inference import Inference
from zml_sim.probe import Probe
from zml_sim.kvhandoff import KVHandoff
from zml_sim.faces import FACES
from zml_sim.faces.base import DEFAULT_RETRY_AFTER_S
from zml_sim.faces.base import MAX_MODEL_LEN
from zml_sim.kvpublish import KVEventPublisher
from zmlcore.fleet.perfmodel import SimProfile

log = logging.getLogger("zml_sim")

#: Engines that do not accept connections until their model is loaded.
LISTEN_AFTER_LOAD = frozenset(n for n, f in FACES.items() if f.listen_after_load)
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
__all__ = ["DEFAULT_MODEL", "DEFAULT_RETRY_AFTER_S", "ENGINES", "LISTEN_AFTER_LOAD", "MAX_MODEL_LEN",
           "SimNode", "SimPortInUseError", "endpoint_port", "start_fleet"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class SimPortInUseError(OSError):
    """The node's port is taken by another process (or another node)."""

    def __init__(self, node_id: str, host: str, port: int) -> None:
        self.node_id = node_id
        self.host = host
        self.port = port
        super().__init__(errno.EADDRINUSE, f"node {node_id}: port {port} on {host} is already in use")


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


class SimNode(Inference, Probe):
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
        true_speed: float | None = None,
        drift: float = 0.0,
        drift_period_s: float = 600.0,
        kv_gbps: float | None = None,
        loras: Iterable[str] = (),
        lora_resolver_dir: str | None = None,
        adapter_load_s: float = 0.5,
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
        if true_speed:  # hidden from ZML: it is told the profile above ([nodes.sim] true_speed)
            profile = replace(profile, prefill_tps=profile.prefill_tps * true_speed,
                              decode_tps=profile.decode_tps * true_speed)
        #: The true profile before drift, and the drift's amplitude and period (real seconds).
        self.true_profile = profile
        self.drift = (drift, drift_period_s)
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
        #: llama.cpp's --lora files (id = index; path and global scale), and per id the requests
        #: that asked for it at a scale > 0 (faces.llamacpp)
        if loras and engine != "llamacpp":
            raise ValueError(f"node {node_id!r}: loras are llama.cpp's --lora files (engine llamacpp)")
        self.loras: list[dict[str, Any]] = [{"id": i, "path": p, "scale": 1.0} for i, p in enumerate(loras)]
        self.lora_requests: dict[int, int] = {}
        if lora_resolver_dir and engine != "vllm":
            raise ValueError(f"node {node_id!r}: lora_resolver_dir is vLLM's LoRA resolver (engine vllm)")
        #: vLLM's lora_filesystem_resolver: where a request's unknown model is looked up as an adapter
        self.lora_resolver_dir = lora_resolver_dir
        #: seconds (simulated) an adapter load takes
        self.adapter_load_s = adapter_load_s
        #: requests that ran on each adapter (vLLM: named it; SGLang: named "base:adapter")
        self.adapter_requests: dict[str, int] = {}

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
            kv_events=node.kv_events, kv_gbps=node.kv_gbps, true_speed=sim.true_speed, drift=sim.drift,
            drift_period_s=sim.drift_period_s, loras=sim.loras, lora_resolver_dir=sim.lora_resolver_dir,
            adapter_load_s=sim.adapter_load_s,
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
        if self.drift[0] > 0:
            self._tasks.add(asyncio.get_running_loop().create_task(self._drift()))
        if wait:
            await self.wait_listening()

    async def _drift(self) -> None:
        """The true speed wanders: sinusoidal over the period, updated every second."""
        amp, period = self.drift
        t0 = time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            f = 1.0 + amp * math.sin(2 * math.pi * (time.monotonic() - t0) / period)
            base = self.true_profile
            prof = self.engine.profile
            self.engine.set_profile(replace(prof, prefill_tps=base.prefill_tps * f, decode_tps=base.decode_tps * f))

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
            "loras": [dict(a) for a in self.loras],
            "lora_requests": {str(i): n for i, n in sorted(self.lora_requests.items())},
            "adapters": dict(self.adapters),
            "adapter_requests": dict(sorted(self.adapter_requests.items())),
        }


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
