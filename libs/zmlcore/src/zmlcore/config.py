"""zml.toml: one Struct tree, validated at load.

Every field's docstring is the configuration reference (docs/configuration.md is written from
it). :func:`load_config` is the only place that reads files or environment variables; a typo
fails at start-up with a :class:`~zmlcore.errors.ConfigError` naming the file and the key.

Example::

    from zmlcore.config import load_config
    cfg = load_config("zml.toml")
    print([n.id for n in cfg.nodes])
"""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
import types
import typing
from typing import Annotated, Any, Literal

import msgspec

from zmlcore.fleet.accelerators import ACCELERATORS, canonical_family
from zmlcore.errors import ConfigError, PolicyConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the project requires 3.11, tomli is the fallback for older tools
    import tomli as tomllib

NonNeg = Annotated[float, msgspec.Meta(ge=0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
KeepaliveMs = Annotated[int, msgspec.Meta(ge=0, le=60_000)]

Backend = Literal["vllm", "tgi", "sglang", "llamacpp", "openai"]
Strategy = Literal["latency", "cost", "availability", "round_robin", "weighted", "balanced", "chain"]
CostPriority = Literal["cost", "balanced", "latency"]
Priority = Literal["critical", "standard", "sheddable", "batch"]
#: Which legs of a disaggregated request a node takes (docs/disaggregation.md).
Role = Literal["prefill", "decode"]
ROLES: tuple[str, ...] = typing.get_args(Role)

BUILTIN_POLICIES = ("latency", "cost", "availability", "round_robin", "balanced")
BACKENDS: tuple[str, ...] = typing.get_args(Backend)
#: Other names engines go by (after lower-casing and dropping ".", "-", "_" and spaces).
_BACKEND_ALIASES = {"llamaserver": "llamacpp", "textgenerationinference": "tgi"}


def canonical_backend(name: str) -> str | None:
    """The backend a user means by ``name`` ("llama.cpp", "vLLM", "SGLang", "llama-server"),
    or None when it names none of :data:`BACKENDS`.

    >>> canonical_backend("llama.cpp"), canonical_backend("TGI"), canonical_backend("trt")
    ('llamacpp', 'tgi', None)
    """
    key = re.sub(r"[\s._-]", "", name.lower())
    key = _BACKEND_ALIASES.get(key, key)
    return key if key in BACKENDS else None


def enum_choices(root: type, path: str) -> tuple[str, ...]:
    """The values allowed at a msgspec error path (``$.nodes[0].backend``) under the Struct
    ``root`` when that field is a Literal (then any other kind it takes, "an integer"); ()
    otherwise. Error messages list them."""
    tp: Any = root
    for name, _index in re.findall(r"\.(\w+)|\[(\d+|\.\.\.)\]", path.lstrip("$")):
        tp = _unwrap(tp)
        if name:
            if not (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
                return ()
            tp = typing.get_type_hints(tp).get(name)
        else:
            args = typing.get_args(tp)
            tp = args[-1] if args else None
        if tp is None:
            return ()
    values: list[str] = []
    others: list[str] = []
    for member in typing.get_args(tp) if _is_union(tp) else (tp,):
        member = _unwrap(member)
        if typing.get_origin(member) is Literal:
            values += [str(v) for v in typing.get_args(member)]
        elif member is not type(None):
            others.append(_KINDS.get(member, getattr(member, "__name__", str(member))))
    return (*values, *others) if values else ()


_KINDS = {int: "an integer", float: "a number", str: "a string"}


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _unwrap(tp: Any) -> Any:
    """``Annotated[T, ...]`` -> T; ``T | None`` -> T."""
    while True:
        if typing.get_origin(tp) is Annotated:
            tp = typing.get_args(tp)[0]
        elif _is_union(tp) and len(args := [a for a in typing.get_args(tp) if a is not type(None)]) == 1:
            tp = args[0]
        else:
            return tp


def with_choices(root: type, message: str) -> str:
    """msgspec's ``Invalid enum value 'x' - at `$.a.b``` with the values it takes appended."""
    m = _ERROR_PATH.search(message)
    if m is None or not message.startswith("Invalid enum value"):
        return message
    choices = enum_choices(root, m.group(1))
    return f"{message} (one of: {', '.join(choices)})" if choices else message

_Base = {"kw_only": True, "forbid_unknown_fields": True}


class NatsConfig(msgspec.Struct, **_Base):
    url: str = "nats://127.0.0.1:4222"
    """NATS server URL, or several comma-separated (servers of one cluster: a client moves to
    another when its server goes away). Env ZML_NATS_URL."""
    connect_timeout_s: PosFloat = 2.0
    """Seconds to wait for the first connection."""
    replicas: Annotated[int, msgspec.Meta(ge=1, le=5)] = 1
    """JetStream replicas of every KV bucket and stream ZML creates: 1 on a single server, 3 on
    a 3-server cluster (a bucket then survives the loss of one server). Applies when a bucket or
    stream is first created. Env ZML_NATS_REPLICAS."""
    nkey_file: str | None = None
    """This process's NATS identity: a file holding its nkey seed (mode 0600; `zml up` and
    `zml creds issue` write them). Each service needs its own, so it is usually given per
    process by env ZML_NATS_NKEY. None: no identity (an open broker, `zml up --insecure`)."""
    max_reply_bytes: PosInt = 64 * 1024 * 1024
    """Largest non-streamed reply the gateway or the SDK collects over NATS. A reply larger than
    the server's max_payload arrives in parts (zmlcore.reply.bigreply); the requester tells the router
    this limit (``Zml-Accept-Parts``), and a reply over it is answered REPLY_TOO_LARGE instead."""
    tls_ca_file: str | None = None
    """CA certificate(s) that verify the NATS server (env ZML_NATS_TLS_CA). Set (or a tls://
    URL): connect over TLS."""
    tls_cert_file: str | None = None
    """Client certificate for a server that verifies clients (mutual TLS; env ZML_NATS_TLS_CERT)."""
    tls_key_file: str | None = None
    """Private key of tls_cert_file (env ZML_NATS_TLS_KEY)."""
    server_tls_cert_file: str | None = None
    """`zml up`'s embedded nats-server: its certificate. Set: clients must use TLS."""
    server_tls_key_file: str | None = None
    """... and its private key."""
    server_tls_verify_clients: bool = False
    """`zml up`'s nats-server requires a client certificate signed by tls_ca_file (mutual TLS)."""
    server_gomaxprocs: PosInt | Literal["auto"] = "auto"
    """`zml up`'s nats-server: cores its Go code runs on at once (GOMAXPROCS, set in its
    environment only). "auto": one per four cores, at least one (zmlcore.runtime.sizing): on two cores
    one spent less nats-server CPU per request than two (docs/benchmarks.md, "Runtime levers").
    Go's own default is every core: give the core count for that."""


class GatewayConfig(msgspec.Struct, **_Base):
    host: str = "127.0.0.1"
    """Interface the HTTP gateway binds (env ZML_GATEWAY_HOST)."""
    port: Port = 8080
    """HTTP port (env ZML_GATEWAY_PORT)."""
    grpc_port: Port | None = None
    """gRPC port of the ``zml.v1.Zml`` service (docs/grpc.md), on the same host, keys, plans and
    limits as HTTP (its TLS too when tls_cert_file is set). None or 0: no gRPC (env
    ZML_GATEWAY_GRPC_PORT)."""
    api_keys: list[str] = []
    """Accepted bearer keys. Empty: no authentication (self-hosted default). Env ZML_API_KEYS
    (comma-separated) replaces the list."""
    max_body_bytes: PosInt = 8 * 1024 * 1024
    """Largest request body accepted (HTTP and gRPC at the gateway; a request uploaded in parts
    over NATS at its router); above it, 413 REQUEST_TOO_LARGE. A body larger than one NATS
    message (the server's max_payload, 1 MiB by default) goes to its router in parts, as audio
    does (docs/nats-api.md); such a request does not wait in the saturation queue
    (queue_on_saturation): when every node is saturated it is answered QUEUE_FULL at once."""
    requests_per_minute: PosInt | None = None
    """Per-key request limit (per client address when there are no api_keys); over it, 429
    RATE_LIMITED with Retry-After. Every answer carries x-ratelimit-* headers, which the SDK's
    limiter follows. None: no limit (self-hosted default)."""
    request_burst: PosInt | None = None
    """Requests a key may send at once above the steady rate (default: one second's worth, at
    least 1)."""
    max_concurrent: PosInt = 1024
    """Inference requests this gateway replica holds at once; above it, 503 QUEUE_FULL with
    Retry-After (a bound on memory and NATS inboxes, not a fairness limit: plans do that)."""
    max_header_bytes: PosInt = 16 * 1024
    """Largest request line plus headers; above it the connection gets 431 and is closed."""
    max_headers: PosInt = 100
    """Most header lines in one request; above it, 431."""
    header_timeout_s: PosFloat = 10.0
    """Seconds a client has to send a request's headers (slow-loris bound)."""
    body_timeout_s: PosFloat = 30.0
    """Seconds a client has, once its headers arrived, to send the whole request body (the
    slow-loris bound for bodies, HTTP/1.1 and HTTP/2); over it, 408 BAD_REQUEST and the
    connection (HTTP/2: the stream) is closed."""
    stream_buffer: PosInt = 256
    """Chunks of one streamed reply buffered while the HTTP client is slow to read; when full,
    the request is cancelled upstream and the stream ends with an error (a client that stops
    reading cannot make the gateway buffer a whole reply)."""
    router_keepalive_ms: KeepaliveMs = 1000
    """Ask routers for a keepalive every this many ms while they work on a request
    (``Zml-Keepalive``); after 3 silent intervals the router counts as dead and the request is
    sent once more to another router (not yet answered: invisibly; a stream already relayed
    is continued by it from the text relayed, docs/http-api.md "When a router fails
    mid-answer"). 0: no keepalives, a dead router's requests wait out their timeout. Values
    under 100 are raised to 100."""
    no_router_grace_s: Annotated[float, msgspec.Meta(ge=0, le=60)] = 2.0
    """How long a request waits for a router when the broker says none is subscribed ("no
    responders": for ~0.1 s after a broker restart, or while routers restart). Nothing received
    it, so it is sent again after 10, 20, 50, then every 100 ms until a router takes it, within
    this grace and never past the request's own timeout; after it, 503 NO_HEALTHY_NODES with
    Retry-After. Waiting requests count toward max_concurrent; a client that goes away ends its
    wait. 0: answer 503 at once. At most 60."""
    broker_grace_s: Annotated[float, msgspec.Meta(ge=0, le=300)] = 10.0
    """How long a request waits for the broker while the gateway's connection to it is down (a
    broker restarted: a blink of a few seconds), never past the request's own timeout. One
    that arrives meanwhile is held (not buffered: a buffer lost with the connection would lose
    it) and sent once the connection is back; one in flight when it dropped is sent again then
    (the router holding it replaces it; a stream is continued from what was relayed). After
    the grace, 503 CONNECTION_FAILED. 0: answer 503 at once."""
    tls_cert_file: str | None = None
    """Serve HTTPS with this certificate (PEM; env ZML_GATEWAY_TLS_CERT). None: plain HTTP."""
    tls_key_file: str | None = None
    """Private key of tls_cert_file (env ZML_GATEWAY_TLS_KEY)."""
    tls_client_ca_file: str | None = None
    """Require client certificates signed by this CA (mutual TLS). None: any client."""
    http2: bool = True
    """Serve HTTP/2 on the same port as HTTP/1.1: cleartext with prior knowledge (h2c), and
    over TLS when ALPN chooses ``h2``. The header bounds above apply to it as well. False:
    HTTP/1.1 only."""
    http2_max_streams: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 100
    """Concurrent streams one HTTP/2 connection may open (SETTINGS_MAX_CONCURRENT_STREAMS)."""
    trusted_proxies: list[str] = []
    """Addresses (IPs or CIDR networks) of reverse proxies in front of the gateway whose
    X-Forwarded-For / X-Forwarded-Proto are believed: a request from one of them counts as
    coming from the client address it names (what the per-address rate limit and logs see).
    Empty (default): those headers are ignored and the TCP peer is the client, so no client,
    local or not, can choose the address it is limited by."""
    processes: PosInt | Literal["auto"] = "auto"
    """Gateway processes `zml up` runs on the one port (SO_REUSEPORT: the kernel spreads
    connections over them). "auto": sized to the machine's cores (zmlcore.runtime.sizing); `zml up
    --gateways N` overrides. Each process has its own /metrics, dashboard and max_concurrent."""


class RouterConfig(msgspec.Struct, **_Base):
    cooldown_s: NonNeg = 30.0
    """A node that failed (network error, 5xx) is skipped this long; a Retry-After overrides."""
    saturated_s: NonNeg = 2.0
    """A node that answered 'overloaded' (429/503) is skipped this long without Retry-After."""
    stale_after_s: PosFloat = 15.0
    """Node state older than this is not routable."""
    max_attempts: PosInt = 3
    """Nodes tried for one request before giving up."""
    admission_ttft_s: PosFloat = 60.0
    """Admission bound: when even the fastest node's estimated time to first token exceeds
    this, the fleet is saturated for the request (QUEUE_FULL, or the queue when the policy
    has queue_on_saturation) instead of piling more work onto the nodes. The backlog it allows
    is what carries bursts over quiet spells: at bursty 110% load 30 s served 97-98% of
    capacity, 60 s 99% (benches/routing_sim.py); lower it to bound the worst wait instead."""
    connect_timeout_s: PosFloat = 2.0
    """TCP connect timeout towards a node."""
    max_connections: PosInt = 512
    """Connection pool size towards all nodes together."""
    first_byte_floor_s: PosFloat = 5.0
    """Per-attempt first-byte timeout, lower bound: a node that sends nothing (no first
    token when streaming, no reply otherwise) within max(this, first_byte_factor x its
    estimated time) is abandoned, marked slow and cooled down, and the request fails over;
    unless no other node could take it (its last attempt, or none other up): then it is
    waited for, to the request's own timeout."""
    first_byte_factor: NonNeg = 4.0
    """Multiple of the node's estimated time to first token (to the whole reply when not
    streaming) allowed before the first byte; 0 makes first_byte_floor_s a fixed timeout."""
    batch_reserve: Annotated[float, msgspec.Meta(ge=0, le=0.9)] = 0.1
    """Share of each node's sequence slots batch requests (``Zml-Priority: batch``, the batch
    runners' lines) never take, at least one slot: interactive arrivals find them free. Where no
    node has that room a batch request is refused at once (QUEUE_FULL) and its runner waits
    (docs/batches.md). More keeps interactive latency closer to a fleet without batches and
    leaves more capacity idle (benches/batch_sim.py at 50% load: 0.1 cost interactive p99 TTFT
    +6% and used 91% of the spare capacity; 0.25, +2% and 81%; 0, x2.5 and 100%)."""
    inter_token_timeout_s: PosFloat = 10.0
    """After the first token, a node that sends nothing more for its inter-token deadline
    (noticed within one to two such periods) is abandoned as stalled, cooled down, and the answer
    continued on another node (or ended with the error where it cannot be: docs/http-api.md).
    The deadline is max(inter_token_floor_s, inter_token_factor x the node's expected longest
    gap), at most this: a stall is noticed in a few expected gaps of the node's learned speeds
    (docs/routing.md "Learned speeds"), not a fixed 10 s."""
    inter_token_floor_s: PosFloat = 1.0
    """Lower bound of the inter-token deadline (a fast node's hiccup is no stall)."""
    inter_token_factor: NonNeg = 3.0
    """Multiple of the node's expected longest gap between two tokens (one decode step at its
    learned speed and batch, plus a prefill chunk of another request: 2,048 tokens at its
    learned prefill speed) allowed before a stall; 0 makes inter_token_timeout_s fixed."""
    session_idle_s: PosFloat = 600.0
    """A session (``x-session-id``, ``Zml-Session``, the SDK's ``session=``, else the OpenAI
    ``user`` field) is forgotten after this long without a request (its binding to a node
    expires in the KV bucket zml_sessions)."""
    processes: PosInt | Literal["auto"] = "auto"
    """Router replicas `zml up` runs (one queue group). "auto": sized to the machine's cores
    (zmlcore.runtime.sizing); `zml up --routers N` overrides."""


class FlowConfig(msgspec.Struct, **_Base):
    """Flow control for a shared fleet (zmlcore.flowctl, docs/routing.md "Flow control")."""

    default_priority: Priority = "standard"
    """Band of a request that names none and whose API key sets none."""
    max_priority: Priority = "standard"
    """Highest band a caller may claim unless its API key allows more (``zml keys create
    --max-priority``): a claim above it is lowered to it (the reply's ``x-zml-priority-lowered-from`` names the band asked)."""
    ttft_slo_ms: PosFloat | None = None
    """Default time-to-first-token target of every request (a model's [models.*] ttft_slo_ms
    and the request's ``x-zml-ttft-slo-ms`` override it): admission refuses at once with
    SLO_UNATTAINABLE when no node is predicted to meet it. None: no target."""
    tpot_slo_ms: PosFloat | None = None
    """Default time-per-output-token target, as ttft_slo_ms."""
    prefill_token_cost: NonNeg = 1.0
    """Weight of a prompt token in a tenant's fair-share counter."""
    decode_token_cost: NonNeg = 2.0
    """Weight of an output token in a tenant's fair-share counter (VTC's 1:2 by default)."""
    share_half_life_s: PosFloat = 30.0
    """Half-life of the tenants' token counters: how long the queue remembers who was served."""
    share_report_ms: PosInt = 100
    """How often a router publishes its tenants' counters to the other replicas (when they changed)."""
    age_s: NonNeg = 30.0
    """A queued ``sheddable`` request ranks as ``standard`` once it has waited this long; 0: never.
    (A batch line rises only when its completion window is closing: docs/routing.md.)"""
    max_queued: PosInt = 256
    """Queued requests one router holds per model for ordering by band and share; past it the
    lowest-ranked are shed (SHED)."""
    spare_reserve: Annotated[float, msgspec.Meta(ge=0, le=0.9)] = 0.25
    """Share of each node's sequence slots (at least one) that a tenant over its fair share, and
    ``sheddable`` work, leave free with hold_when_full: another tenant's next request finds one at
    once. benches/flow_sim.py (tuning seeds): 0.1 let a flood raise the other tenants' p99 TTFT
    up to +4%, 0.25 none."""
    hold_when_full: bool = False
    """Saturation means "no free sequence slot on any node" instead of "every node over the
    admission bound": requests of a policy with queue_on_saturation then wait in the saturation
    queue, ordered by band and share, for the next free slot, instead of in a node's own FIFO
    queue behind whoever flooded it."""


class HealthConfig(msgspec.Struct, **_Base):
    poll_interval_s: PosFloat = 5.0
    """Seconds between polls of one node."""
    jitter: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.2
    """Each poll interval is randomised by +/- this fraction so a fleet is not polled in lockstep."""
    probe_timeout_s: PosFloat = 2.0
    """Per-probe timeout; a slower probe counts as one failure."""
    down_after: PosInt = 3
    """Consecutive failed probes before a node is marked down."""
    up_after: PosInt = 2
    """Consecutive good probes before a down node is marked up again."""
    startup_grace_s: NonNeg = 300.0
    """A node that has not yet answered is 'loading', not 'down', for this long after start."""
    max_concurrent_probes: PosInt = 64
    """Probes in flight at once."""
    validate_hardware: bool = True
    """Check each node's reported hardware (GET /zml/v1/node) against its declared type and the
    type's minimum driver; a mismatch keeps the node out of routing (status 'invalid')."""
    require_node_probe: bool = False
    """Strict mode: a node without a node probe endpoint is 'invalid' instead of accepted with a
    note."""
    error_window_s: PosFloat = 60.0
    """Window of the recent error rate (router completion events and probe results)."""
    history_len: PosInt = 12
    """Samples of tokens/s history kept per node."""
    generate_probe_every: PosInt = 12
    """SGLang: every Nth poll also calls /health_generate (a one-token generation); the other
    polls use the cheap /ready."""
    kv_heartbeat_s: PosFloat = 5.0
    """A node's state goes to the KV bucket when something readers act on changed (status,
    models, queue, speeds by over 2%...), else often enough that the written state is never
    older than this (capped at a third of router.stale_after_s, so a live node never looks
    stale and a dead health service still makes every node stale)."""
    calibrate: bool = True
    """Send a node one short real request (calibrate_prompt_tokens of a prompt no cache holds,
    calibrate_max_tokens out) when one of its models' speeds is too uncertain to route on: when
    it joins, restarts or loads a model, and when its estimate has aged (docs/routing.md
    "Learned speeds"). Its time to first token and decode rate are folded into the estimate."""
    calibrate_prompt_tokens: Annotated[int, msgspec.Meta(ge=32, le=8192)] = 1024
    """Prompt tokens of a calibration request: long enough that prefill, not the round trip,
    sets its time to first token, and as long as a chat's prompt, since a prefill's per-token
    cost (and a decode's) grows with the context it attends to (a 64-wide llama-server: 16 us a
    token at 142 tokens, 28 at 1,183; a 512-token calibration read it 1.5-2.2x faster than
    the ~1,300-token prompts it was then routed)."""
    calibrate_max_tokens: Annotated[int, msgspec.Meta(ge=8, le=1024)] = 32
    """Tokens a calibration request generates."""
    calibrate_every_s: PosFloat = 60.0
    """At most one calibration request per node and model this often."""


class SimConfig(msgspec.Struct, **_Base):
    """Present on a node: `zml up` / `zml sim --config` run a simulated node at its endpoint.
    Unset numbers come from the accelerator type's profile."""

    engine: Backend = "vllm"
    """Which engine's endpoints, metric names and loading behaviour the sim imitates."""
    speed: PosFloat | None = None
    """Relative speed (H100 = 1.0); scales prefill and decode."""
    prefill_tps: PosFloat | None = None
    """Prefill tokens/s (default 10,000 x speed)."""
    decode_tps: PosFloat | None = None
    """Decode tokens/s per sequence at batch size 1 (default 60 x speed)."""
    max_concurrency: PosInt | None = None
    """Sequences decoded together (continuous batching); more requests wait in a queue."""
    max_waiting: int | None = None
    """Waiting-queue bound; beyond it the sim answers its engine's overload error."""
    load_time_s: NonNeg | None = None
    """Seconds to load a model (MI300X default is 50% longer than H100)."""
    memory_gib: PosFloat | None = None
    """Accelerator memory."""
    true_speed: PosFloat | None = None
    """Hidden: the node really runs this many times faster than the speeds above (or its type's)
    say, e.g. 0.3 or 3. The health service and routers are told only the speeds above and must
    learn the truth, as with a real engine (docs/sim.md "Hidden speeds")."""
    drift: Annotated[float, msgspec.Meta(ge=0, le=0.9)] = 0.0
    """Hidden: the true speed wanders by +/- this share of itself over drift_period_s (a
    throttling GPU, a neighbour on the same host), so estimates must keep up."""
    drift_period_s: PosFloat = 600.0
    """Real seconds of one full cycle of the drift."""
    time_scale: PosFloat = 1.0
    """Run this many times faster than real time (demos, tests)."""
    seed: int = 0
    """Random seed for fault injection, so runs are reproducible."""
    driver_version: str | None = None
    """Driver version the node probe reports (default: the type's minimum)."""
    prefix_caching: bool = True
    """Keep a prefix cache (vLLM's automatic prefix caching): cached prompt tokens skip prefill,
    replies report them, and with [nodes.kv_events] the node publishes vLLM's KV events."""
    kv_block_size: PosInt | None = None
    """Tokens per KV-cache block (default: the accelerator type's, e.g. 16 on H100, 128 on
    Gaudi2)."""
    kv_cache_blocks: PosInt | None = None
    """KV-cache size in blocks (default: the memory left after the weights, as vLLM sizes it).
    Small values make evictions visible in demos and tests."""
    loras: list[str] = []
    """engine = "llamacpp" only: the ``--lora`` files the simulated llama-server was started
    with (ids 0, 1, ... in this order, scale 1.0): ``GET /lora-adapters`` lists them, ``POST
    /lora-adapters`` sets their global scales, a request picks them with ``"lora": [{"id",
    "scale"}]``, as llama-server does (docs/placement.md "Adapters")."""
    lora_resolver_dir: str | None = None
    """engine = "vllm" only: imitates vLLM's ``lora_filesystem_resolver`` plugin
    (``VLLM_LORA_RESOLVER_CACHE_DIR``): a request naming a model the node does not serve, where
    DIR/NAME/adapter_config.json says ``"peft_type": "LORA"`` and a ``base_model_name_or_path``
    the node serves, loads that adapter (``adapter_load_s``) and runs on it."""
    adapter_load_s: NonNeg = 0.5
    """Seconds (simulated) a LoRA adapter load takes: ``/v1/load_lora_adapter``, SGLang's
    ``/load_lora_adapter`` and the resolver's loads."""


class KVEventsConfig(msgspec.Struct, **_Base):
    """Where a node's engine publishes its KV-cache events (vLLM or SGLang started with
    ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
    "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``). The health service subscribes and
    bridges them into NATS, so every router knows exactly which prefixes the node holds."""

    endpoint: str
    """The engine's PUB socket as the health service reaches it, e.g. tcp://10.0.0.5:5557."""
    replay_endpoint: str | None = None
    """The engine's replay (ROUTER) socket, e.g. tcp://10.0.0.5:5558: missed events are asked
    for again after a gap. Without it a gap empties the node's cache state (safe, not exact)."""
    topic: str = ""
    """The engine's ``topic`` (vLLM's default is empty)."""


class NodeConfig(msgspec.Struct, **_Base):
    id: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$")]
    """Unique node id (letters, digits, - and _)."""
    accelerator: str
    """Accelerator type ID from the API reference: nvidia_h100, nvidia_a100, amd_mi300x,
    intel_gaudi2, aws_inferentia2, cpu."""
    endpoint: str
    """Base URL of the serving engine, e.g. http://10.0.0.5:8000 (no /v1)."""
    backend: Backend = "vllm"
    """Serving engine: vllm, tgi, sglang, llamacpp (llama.cpp's llama-server) or openai (any
    OpenAI-compatible server). Spellings such as "llama.cpp" or "vLLM" are read as these."""
    models: list[str] = []
    """Models this node serves (or should serve)."""
    served_names: dict[str, str] = {}
    """The engine's own name for a model, by ZML model name (e.g. the path vLLM was started
    with, or llama.cpp's file name). Requests carry the engine's name; the node's state reports
    ZML's name."""
    family: str | None = None
    """Family used by policy chains; defaults to the accelerator's (H100, MI300X...)."""
    cost_per_hour: NonNeg | None = None
    """Cost per GPU-hour; defaults to the accelerator's list price. Updatable at run time."""
    api_key: str | None = None
    """Bearer key the router sends to this node, if the engine requires one."""
    sim: SimConfig | None = None
    """Simulated node settings (see [nodes.sim])."""
    probe_endpoint: str | None = None
    """Base URL of the node probe (GET /zml/v1/node, served by `zml node-agent` beside the engine,
    or by `zml sim`); default: the engine endpoint."""
    startup_grace_s: NonNeg | None = None
    """Overrides [health] startup_grace_s for this node (slow loaders, large models)."""
    kv_events: KVEventsConfig | None = None
    """The engine's KV-event sockets (see [nodes.kv_events]); vllm and sglang backends only."""
    model_slots: PosInt = 1
    """Models the engine may hold at once, for the placement planner (llama.cpp router mode's
    --models-max; 1 for an engine started with one model). Held models share the node's time."""
    adapter_slots: Annotated[int, msgspec.Meta(ge=0)] = 0
    """LoRA adapters the engine may hold at once (vLLM's --max-loras); 0: the planner puts no
    adapter on it. A llama.cpp node holds the --lora files it was started with and no other
    (health reads them from GET /lora-adapters): this does not apply to it."""
    adapters_on_request: bool = False
    """backend = "vllm" only: the engine loads an adapter a request names that it does not hold,
    a LoRA resolver plugin's job (``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``,
    ``VLLM_PLUGINS=lora_filesystem_resolver``, ``VLLM_LORA_RESOLVER_CACHE_DIR=DIR``: DIR/NAME
    holds the adapter, its adapter_config.json naming the base model). Routers then may send
    an adapter's request to a node serving its base without it (below ``adapter_slots``), its
    estimate costing the adapter's load time (docs/placement.md "Adapters")."""
    roles: list[Role] = msgspec.field(default_factory=lambda: ["prefill", "decode"])
    """Legs of a disaggregated request this node takes: "prefill" (computes a prompt's KV and
    hands it to a decode node), "decode" (generates from KV handed to it, and serves whole
    requests). Both (the default) is today's behaviour plus either leg. A prefill-only node
    never serves a whole request; it needs a kv_group shared with a decode node."""
    kv_group: str | None = None
    """Nodes that can hand KV to each other: one model's engines with a compatible KV connector
    (vLLM's NixlConnector, SGLang's bootstrap, llama-server's slot files on one shared
    directory). None: this node is never one leg of a split request."""
    kv_gbps: PosFloat | None = None
    """Bandwidth of this node's KV transfer link, in Gbit/s; a transfer between two nodes runs
    at the slower end's unless a [[kv_links]] entry names the pair. Required with kv_group."""
    kv_bootstrap_port: Port | None = None
    """SGLang: the port of this prefill node's bootstrap server (its
    --disaggregation-bootstrap-port, 8998 by default in SGLang), which a split request's decode
    leg is told. None: the endpoint's port (where a simulated node serves it)."""

    @property
    def effective_family(self) -> str:
        return self.family or ACCELERATORS[self.accelerator].family

    @property
    def effective_cost(self) -> float:
        if self.cost_per_hour is not None:
            return self.cost_per_hour
        return ACCELERATORS[self.accelerator].cost_per_hour


class PreferenceEntry(msgspec.Struct, **_Base):
    family: str
    priority: int = 1


class PolicyConfig(msgspec.Struct, **_Base):
    """A routing policy: ``[policy.NAME]`` (API reference) or ``[policies.NAME]`` (SDK 0.3)."""

    strategy: Strategy | None = None
    """latency, cost, availability, round_robin, weighted or balanced. Default: chain
    evaluation driven by cost_priority."""
    accelerator_chain: list[str] | None = None
    """Families in preference order, each once (a repeat is refused at load)."""
    accelerator_preference: list[PreferenceEntry] | None = None
    """Families with priorities (1 = first); the walkthrough's spelling of a chain (each family
    once)."""
    latency_target_ms: PosFloat | None = None
    """Target time to first token."""
    cost_priority: CostPriority | None = None
    """cost, balanced or latency."""
    latency_weight: NonNeg | None = None
    """Weighted strategy: weight of normalised estimated TTFT."""
    cost_weight: NonNeg | None = None
    """Weighted strategy: weight of normalised cost."""
    queue_threshold: NonNeg | None = None
    """Nodes with more outstanding requests than this are skipped by cost/weighted."""
    health_threshold: NonNeg | None = None
    """Nodes with a lower health score (0-100) are skipped."""
    queue_on_saturation: bool = False
    """Wait in the JetStream queue instead of failing fast with QUEUE_FULL."""
    max_queue_ms: PosInt | None = None
    """Longest wait in that queue before QUEUE_FULL."""
    continue_on_failure: bool = True
    """When the node serving an answer fails part-way (crash, reset, dropped connection, a
    stall past [router] inter_token_timeout_s), continue the answer on another node of the
    chain from the text already produced (docs/http-api.md, "When a node fails mid-answer").
    False: a stream ends with the error; a non-streamed request starts again elsewhere."""

    def chain(self) -> list[str]:
        """Families in order, whichever spelling was used."""
        if self.accelerator_preference:
            ordered = sorted(self.accelerator_preference, key=lambda e: e.priority)
            return [canonical_family(e.family) for e in ordered]
        return [canonical_family(f) for f in self.accelerator_chain or []]


class ModelConfig(msgspec.Struct, **_Base):
    policy: str | None = None
    """Default policy for this model (a name from [policy.*] / [policies.*] or a built-in)."""
    aliases: list[str] = []
    """Other names clients may use for this model."""
    warm: bool = False
    """The warmup service keeps this model loaded on its nodes."""
    keep_warm_after_s: PosFloat | None = None
    """If set, a node that served no request for this model for this long gets a one-token probe
    request so caches and graphs stay warm."""
    max_model_len: PosInt | None = None
    """The model's context window in tokens (vLLM's ``max_model_len``). It bounds the size of a
    reply when a request gives no ``max_tokens``, for refusing, before the node runs, a raw NATS
    requester that could not receive it (REPLY_TOO_LARGE). None: 32768 is assumed."""
    stream_from_nodes: bool = True
    """Non-streamed chat and completion requests for this model are asked of the nodes as
    streams and the reply put together by the router: the reply's time_to_first_token is the
    first token's (else the whole reply's), the first-byte deadline is a first-token deadline,
    a stall past [router] inter_token_timeout_s is noticed, and an answer whose node fails
    part-way is continued on another node. It costs router CPU per token, ~2 us: +38 us per
    16-token reply at C=64 (+35%, over the +10% the issue allowed) with the peers harness's
    stub as the node (benches/router_cost.py, docs/benchmarks.md); false asks the nodes as the
    caller asked, for a model whose replies are short and many."""
    embedding: bool = False
    """An embedding model: it answers POST /v1/embeddings (an InferRequest with ``input``) and
    chat/completion requests for it are refused with 400, as embeddings requests for a model
    configured without it are. Models not in [models] are not checked (the node decides)."""
    kv_bytes_per_token: PosInt | None = None
    """Bytes of KV cache one prompt token occupies (what a disaggregated request moves per
    token: 2 x layers x KV heads x head size x bytes per value; 131072 for Llama-3-8B in fp16).
    None: [disaggregation] kv_bytes_per_token."""
    audio: bool = False
    """A speech-to-text model (Whisper and the like): it answers POST /v1/audio/transcriptions
    and /v1/audio/translations (OpenAI's multipart form, passed to the node as sent), and chat,
    completion and embeddings requests for it are refused with 400, as audio requests for a model
    configured without it are. Not with embedding."""
    priority: Priority | None = None
    """Band of this model's requests that name none (over [flow] default_priority; an API key's
    default wins over both)."""
    ttft_slo_ms: PosFloat | None = None
    """This model's default time-to-first-token target (over [flow] ttft_slo_ms)."""
    tpot_slo_ms: PosFloat | None = None
    """This model's default time-per-output-token target (over [flow] tpot_slo_ms)."""


class WarmupConfig(msgspec.Struct, **_Base):
    enabled: bool = True
    """Pre-load models in quiet windows (`zml serve` works either way)."""
    sweep_interval_s: PosFloat = 5.0
    """Seconds between warmup decisions."""
    rate_window_s: PosFloat = 60.0
    """Window over which the request rate of a model is measured."""
    quiet_rps: NonNeg = 0.2
    """A model is quiet while its request rate (requests/s over rate_window_s) is below this."""
    quiet_min_s: NonNeg = 120.0
    """...for at least this long."""
    quiet_windows: list[str] = []
    """Fixed quiet windows, "HH:MM-HH:MM" in UTC (may wrap midnight): warm-ups run in them
    whatever the measured rate."""
    max_concurrent_loads: PosInt = 1
    """At most this many nodes load a model at once, so serving capacity is never drained."""
    priority_families: list[str] = msgspec.field(default_factory=lambda: ["MI300X"])
    """Families warmed first (slow cold start); the others follow by their typical load time."""
    load_timeout_s: PosFloat = 900.0
    """A load not finished after this long is abandoned (and may be retried)."""
    use_node_metrics: bool = True
    """Also measure request rate from the nodes' metrics (for routers that publish no events)."""


_MIB = 1024 * 1024
_WINDOW_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^([1-9][0-9]{0,5})([smhd])$")


def window_seconds(text: str) -> int:
    """``"24h"`` -> 86400: a batch's completion window (digits, then s, m, h or d)."""
    m = _DURATION.match(text)
    if not m:
        raise ValueError(f"{text!r}: expected a number and a unit, e.g. \"24h\" (s, m, h or d)")
    return int(m.group(1)) * _WINDOW_UNITS[m.group(2)]


Fraction = Annotated[float, msgspec.Meta(gt=0, le=1)]


class PlannerModelConfig(msgspec.Struct, **_Base):
    memory_gib: PosFloat = 16.0
    """Accelerator memory the model needs on a node (weights and KV for its traffic): it goes
    only where it fits (a node's memory divided by its model_slots)."""
    speed_factor: PosFloat = 1.0
    """The model's speed relative to the one a node's measured speeds come from (0.5: twice as
    slow, a model twice the size), until speeds are measured per model."""
    min_replicas: Annotated[int, msgspec.Meta(ge=0)] = 0
    """Nodes kept serving the model even without demand (0: it may be unloaded everywhere)."""
    ttft_s: PosFloat | None = None
    """SLO: time to first token a request of mean prompt must meet on a node that serves the
    model (a node whose prefill alone misses it never gets the model)."""
    tpot_s: PosFloat | None = None
    """SLO: time per output token (a node serves the model with the largest batch that meets it)."""
    mean_prompt_tokens: PosFloat = 512.0
    """Prompt size planned for until the routers' completions have measured it."""
    mean_output_tokens: PosFloat = 128.0
    """Output size planned for until measured."""


class PlannerConfig(msgspec.Struct, **_Base):
    mode: Literal["off", "advise", "apply"] = "off"
    """off: no planning; advise: plan every interval_s, publish the plan (zml plan, events,
    metrics) and move nothing; apply: also move models, make before break (docs/placement.md)."""
    interval_s: PosFloat = 60.0
    """Seconds between plans."""
    window_s: PosFloat = 600.0
    """Demand (request rate, prompt and output sizes per model and adapter) is measured over
    this window of the routers' completions. In apply mode nothing moves until the service has
    watched one whole window (a model merely not measured yet is not a model without demand)."""
    headroom: Fraction = 0.8
    """Share of a node's saturation throughput planned as SLO capacity (queueing beyond it
    misses TTFT targets)."""
    ttft_miss_share: Annotated[float, msgspec.Meta(ge=0, lt=1)] = 0.01
    """A node's SLO capacity for a model with a TTFT target is also at most the rate at which
    queueing (for a free sequence slot, then behind other prefills) makes this share of its
    requests miss the target (zmlcore.placement.capacity.queueing_rate); 0: headroom alone."""
    forecast_horizon_s: NonNeg = 0.0
    """Plan for the rate expected this far ahead: each model's and adapter's measured rate plus
    its trend (a least-squares slope over the rates measured at each plan of the last
    ``trend_s``) where it rises, so a rising model's new replicas load before its queue builds
    (zmlcore.placement.forecast); never less than the rate now. 0: the rate now."""
    trend_s: PosFloat = 3600.0
    """Seconds of measured rates the trend and the spread are fitted on."""
    forecast_spread: NonNeg = 0.0
    """Also plan for this many times the measured rates' spread around their trend (their
    root-mean-square distance from the fitted line over ``trend_s``): room for a model whose
    rate jumps. 0: none."""
    move_cost_per_h: NonNeg = 0.25
    """$/h a plan must save per load or unload it asks for: a smaller gain moves nothing."""
    drain_timeout_s: PosFloat = 60.0
    """Before unloading a model, routers stop sending it to the node and the node's requests
    finish: at most this long (then it unloads anyway)."""
    time_limit_s: PosFloat = 5.0
    """Solver time limit per plan."""
    models: dict[str, PlannerModelConfig] = {}
    """Per-model planning facts ([planner.models."NAME"]); models not listed use the defaults."""


class AdapterConfig(msgspec.Struct, **_Base):
    base: str
    """The model the adapter runs on."""
    path: str = ""
    """Where the engine finds the adapter: vLLM's lora_path for /v1/load_lora_adapter; for
    llama.cpp, the --lora file it was started with (matched to GET /lora-adapters' path as
    given on its command line, else by file name)."""


class BatchConfig(msgspec.Struct, **_Base):
    """The Batch API (/v1/files, /v1/batches) and its runners (docs/batches.md). Every store
    it uses is bounded by these numbers."""

    enabled: bool = True
    """Serve /v1/files and /v1/batches on the gateway; `zml up` runs the batch runners."""
    processes: PosInt = 1
    """Batch runner replicas `zml up` runs; they share the work (any number may run)."""
    policy: str = ""
    """Policy of a batch's lines when its metadata names none (``metadata.policy``): a name
    from [policy]/[policies] or a built-in. "": the built-in batch policy, the cheapest family
    (cost per unit of capacity) whose estimated time to first token is within
    latency_target_ms."""
    latency_target_ms: PosFloat = 10_000.0
    """The built-in batch policy's relaxed latency target (batch lines wait gladly)."""
    max_file_bytes: PosInt = 200 * _MIB
    """Largest file accepted by POST /v1/files (OpenAI's bound: 200 MB); above it, 413."""
    max_line_bytes: PosInt = _MIB
    """Longest line of an input file (a line is one request: it must also fit in one NATS
    message, so the broker's max_payload bounds it too)."""
    max_lines: PosInt = 50_000
    """Most request lines in one input file (OpenAI's bound: 50,000)."""
    max_files_per_owner: PosInt = 500
    """Files one API key may hold at once (inputs and outputs); above it, 429 QUOTA_EXCEEDED."""
    max_active_batches_per_owner: PosInt = 20
    """Unfinished batches one API key may have at once; above it, 429 QUOTA_EXCEEDED."""
    max_store_bytes: PosInt = 20 * 1024 * _MIB
    """Size bound of the file store (JetStream object store ``zml_batch_files``); a file that
    does not fit is refused with 507 STORAGE_FULL. Applies when the store is first created."""
    max_results_bytes: PosInt = 4 * 1024 * _MIB
    """Size bound of the stream of line results waiting to be written into output files."""
    max_work_bytes: PosInt = 4 * 1024 * _MIB
    """Size bound of the work stream (batches' lines waiting for a runner)."""
    file_ttl_s: PosFloat = 30 * 86400.0
    """Files are deleted this long after they were created (OpenAI keeps batch files 30 days)."""
    completion_windows: list[str] = msgspec.field(default_factory=lambda: ["24h"])
    """Completion windows a batch may ask for ("24h" is OpenAI's only one). A batch still
    running at the end of its window is expired: what finished is kept."""
    shard_lines: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 200
    """Lines of one unit of work: a runner takes a shard at a time; at most this many lines
    are re-checked when a runner dies holding one."""
    max_in_flight: PosInt = 256
    """Lines one runner has in flight at once, at most (the routers' headroom decides how
    many below that)."""
    line_timeout_s: PosFloat = 600.0
    """Timeout of one line's request."""
    takeover_s: Annotated[float, msgspec.Meta(ge=3, le=600)] = 30.0
    """A runner renews the shards it holds several times within this; a runner that dies (or
    loses the broker) leaves its shards to another this long after its last renewal. The lines
    it had recorded are not asked again. Applies when the runners' consumers are first created."""
    max_attempts: PosInt = 5
    """Attempts of a line that fails with a retryable error before it is recorded as failed."""


class MetricsConfig(msgspec.Struct, **_Base):
    """Prometheus metrics (docs/observability.md). The gateway serves them on its own port at
    GET /metrics; the router, health and warmup services get a small port of their own."""

    gateway: bool = True
    """Serve GET /metrics on the gateway's port."""
    host: str = "127.0.0.1"
    """Interface the router/health/warmup metrics ports bind (env ZML_METRICS_HOST)."""
    router_port: Port | None = None
    """Router metrics port (0: any free port, logged at start; None: no metrics port). With
    several replicas on one host give each its own with `--metrics-port` (`zml up` does)."""
    health_port: Port | None = None
    """Health service metrics port (0: any free port; None: none)."""
    warmup_port: Port | None = None
    """Warmup service metrics port (0: any free port; None: none)."""
    batch_port: Port | None = None
    """Batch runner metrics port (0: any free port; None: none)."""


class KVLinkConfig(msgspec.Struct, **_Base):
    """A measured KV transfer link between two nodes of one kv_group (``[[kv_links]]``): it
    overrides the slower end's kv_gbps for that pair, both ways."""

    prefill: str
    """The node that prefills (a node id)."""
    decode: str
    """The node that decodes (a node id)."""
    gbps: PosFloat
    """The pair's KV transfer bandwidth, Gbit/s."""


class DisaggregationConfig(msgspec.Struct, **_Base):
    """Prefill on one node, decode on another (docs/disaggregation.md). Per request, the router
    compares the best whole-request route with every pair of a prefill node and a decode node
    that share a kv_group, from their measured speeds, queues, caches, prices and the link
    between them, and splits only when the split is estimated better by min_gain."""

    enabled: bool = False
    """Consider splitting requests at all (nodes still take the roles they are given)."""
    min_uncached_tokens: PosInt = 512
    """Never split a request with fewer prompt tokens than this uncached on its best decode
    node: a short prompt's prefill costs the decode node less than moving its KV."""
    min_gain: Annotated[float, msgspec.Meta(ge=0, le=0.9)] = 0.1
    """A conversation changes mode (split to whole or back) only when the other mode's estimate
    is better by this share; the first turn splits only when the split is. Hysteresis, so a
    conversation's decisions do not flip on noise."""
    kv_bytes_per_token: PosInt = 131072
    """Bytes of KV per prompt token for models without their own kv_bytes_per_token (Llama-3-8B
    fp16: 32 layers x 8 KV heads x 128 x 2 (K and V) x 2 bytes)."""
    always: bool = False
    """Split every request that has a pair and min_uncached_tokens uncached, whatever the
    estimate says (the homogeneous anchors' way, and a way to try a new pair before its speeds
    are measured). The reply still names both legs, and a failed prefill leg still goes to
    another prefill node, then the request whole on its decode node."""
    prefill_timeout_s: PosFloat = 30.0
    """A prefill leg not answered within this is abandoned (its KV never arrived), as a failed
    leg is: another prefill node for the same decode node, then the request whole there."""


class DefaultsConfig(msgspec.Struct, **_Base):
    policy: str = "balanced"
    """Account-level default policy."""
    request_timeout_s: PosFloat = 30.0
    """Timeout of a request when the caller gives none."""
    max_request_timeout_s: PosFloat = 600.0
    """Largest timeout a caller may ask for (``timeout_ms``, ``Zml-Timeout-Ms``); above it, 400."""
    max_json_depth: PosInt = 32
    """Deepest nesting of lists/objects accepted in a request body; deeper, 400."""
    max_audio_bytes: PosInt = 26 * 1024 * 1024
    """Largest audio request (the whole multipart form: the file and its fields) the gateway
    reads and a router takes over NATS; above it, 413 REQUEST_TOO_LARGE. OpenAI's file limit is
    25 MB. A body larger than one NATS message goes to its router in parts (docs/nats-api.md)."""
    audio_bytes_in_flight: PosInt = 1024 * 1024 * 1024
    """Audio bytes one gateway or router process holds at once (bodies being read, routed or
    sent to a node; in a router, any body that came in parts counts too), a bound on its memory;
    a request that would pass it is refused with 503 QUEUE_FULL and Retry-After. At least
    max_audio_bytes and [gateway] max_body_bytes."""


class ZMLConfig(msgspec.Struct, **_Base):
    nats: NatsConfig = msgspec.field(default_factory=NatsConfig)
    gateway: GatewayConfig = msgspec.field(default_factory=GatewayConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    flow: FlowConfig = msgspec.field(default_factory=FlowConfig)
    health: HealthConfig = msgspec.field(default_factory=HealthConfig)
    warmup: WarmupConfig = msgspec.field(default_factory=WarmupConfig)
    defaults: DefaultsConfig = msgspec.field(default_factory=DefaultsConfig)
    metrics: MetricsConfig = msgspec.field(default_factory=MetricsConfig)
    batch: BatchConfig = msgspec.field(default_factory=BatchConfig)
    planner: PlannerConfig = msgspec.field(default_factory=PlannerConfig)
    disaggregation: DisaggregationConfig = msgspec.field(default_factory=DisaggregationConfig)
    nodes: list[NodeConfig] = []
    kv_links: list[KVLinkConfig] = []
    models: dict[str, ModelConfig] = {}
    #: LoRA adapters by the name clients give as ``model`` ([adapters."NAME"]).
    adapters: dict[str, AdapterConfig] = {}
    policy: dict[str, PolicyConfig] = {}
    policies: dict[str, PolicyConfig] = {}
    #: Where this config came from (not a TOML key).
    source: str = "<defaults>"

    def all_policies(self) -> dict[str, PolicyConfig]:
        """Both spellings merged ([policies.X] wins on a clash, which load forbids anyway)."""
        return {**self.policy, **self.policies}

    def families(self) -> list[str]:
        """Registered families in registration order (the account default chain)."""
        seen: dict[str, None] = {}
        for node in self.nodes:
            seen.setdefault(node.effective_family, None)
        return list(seen)

    def model_names(self) -> set[str]:
        """Every name a client may ask for: the nodes' and [models]' models and the
        [adapters] (served by the nodes that hold them, as vLLM lists them in /v1/models)."""
        names = self.base_model_names()
        names.update(self.adapters)
        return names

    def base_model_names(self) -> set[str]:
        """The nodes' and [models]' models, adapters not included."""
        names = {m for n in self.nodes for m in n.models}
        names.update(self.models)
        return names

    def resolve_model(self, name: str) -> str:
        """Canonical model name for a name or alias (unknown names are returned unchanged)."""
        if name in self.models:
            return name
        for canonical, mc in self.models.items():
            if name in mc.aliases:
                return canonical
        return name


_ERROR_PATH = re.compile(r"at `\$(.*)`")


def _key_of(msg: str) -> tuple[str, str]:
    m = _ERROR_PATH.search(msg)
    if not m:
        return "", msg
    key = m.group(1).lstrip(".")
    return key, (msg[: m.start()].rstrip(" -") + msg[m.end():]).rstrip()


def _spelled(data: dict[str, Any]) -> dict[str, Any]:
    """Engines named as their users spell them ("llama.cpp") become the backend ids."""
    nodes = data.get("nodes")
    if not isinstance(nodes, list):
        return data
    out = []
    for node in nodes:
        if isinstance(node, dict):
            node = dict(node)
            if isinstance(node.get("backend"), str):
                node["backend"] = canonical_backend(node["backend"]) or node["backend"]
            sim = node.get("sim")
            if isinstance(sim, dict) and isinstance(sim.get("engine"), str):
                node["sim"] = {**sim, "engine": canonical_backend(sim["engine"]) or sim["engine"]}
        out.append(node)
    return {**data, "nodes": out}


def validate_policy(name: str, pol: PolicyConfig, families: list[str], where: str) -> None:
    """Raise PolicyConfigError for a policy that could never route."""
    if pol.accelerator_chain and pol.accelerator_preference:
        raise PolicyConfigError(f"{where}: give accelerator_chain or accelerator_preference, not both")
    known = {f.lower() for f in families}
    key = "accelerator_preference" if pol.accelerator_preference else "accelerator_chain"
    seen: dict[str, int] = {}
    for i, fam in enumerate(pol.chain(), 1):
        if fam.lower() not in known:
            raise PolicyConfigError(
                f"{where}.accelerator_chain: family {fam!r} is not registered "
                f"(registered: {', '.join(families) or 'none'})"
            )
        # A repeat is a typo or a misunderstanding (a family is tried once, at its first place):
        # say so at load rather than route as if it were not there.
        first = seen.setdefault(fam.lower(), i)
        if first != i:
            raise PolicyConfigError(
                f"{where}.{key}: family {fam!r} is listed more than once (places {first} and {i} of "
                f"{' -> '.join(pol.chain())}); list each family once"
            )
    if pol.strategy == "weighted" and not (pol.latency_weight or pol.cost_weight):
        raise PolicyConfigError(f"{where}: strategy 'weighted' needs latency_weight or cost_weight > 0")
    if pol.queue_on_saturation and pol.max_queue_ms is None:
        raise PolicyConfigError(f"{where}: queue_on_saturation needs max_queue_ms")


_WINDOW = re.compile(r"^\s*(\d{1,2}):(\d{2})\s*-\s*(\d{1,2}):(\d{2})\s*$")


def parse_window(text: str) -> tuple[int, int]:
    """``"02:00-05:30"`` -> (120, 330): minutes after midnight UTC (end may be before start:
    the window wraps midnight)."""
    m = _WINDOW.match(text)
    if not m:
        raise ValueError(f"{text!r}: expected \"HH:MM-HH:MM\" (UTC)")
    h1, m1, h2, m2 = (int(g) for g in m.groups())
    if h1 > 23 or h2 > 24 or m1 > 59 or m2 > 59 or (h2 == 24 and m2):
        raise ValueError(f"{text!r}: not a time of day")
    start, end = h1 * 60 + m1, h2 * 60 + m2
    if start == end:
        raise ValueError(f"{text!r}: empty window")
    return start, end


def zmq_address(endpoint: str) -> tuple[str, str, int] | None:
    """``(scheme, host, port)`` of a ``tcp://host:port`` endpoint, ``("ipc", path, 0)`` of an
    ``ipc://`` one; None if it is neither."""
    if endpoint.startswith("ipc://") and len(endpoint) > 6:
        return "ipc", endpoint[6:], 0
    m = re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})", endpoint)
    if m is None or not 0 < int(m.group(2)) <= 65535:
        return None
    return "tcp", m.group(1).strip("[]"), int(m.group(2))


def _validate_kv_events(node: NodeConfig, where: str) -> None:
    kv = node.kv_events
    assert kv is not None
    engine = node.sim.engine if node.sim is not None and node.sim.engine != "vllm" else node.backend
    if engine not in ("vllm", "sglang"):
        raise ConfigError(f"{where}: only vllm and sglang publish KV events (this node is {engine})")
    for key, value in (("endpoint", kv.endpoint), ("replay_endpoint", kv.replay_endpoint)):
        if value is None:
            continue
        if zmq_address(value) is None:
            raise ConfigError(f"{where}.{key}: {value!r} is not tcp://HOST:PORT or ipc://PATH "
                              "(the address the health service connects to, not a wildcard bind)")
        if "*" in value:
            raise ConfigError(f"{where}.{key}: {value!r}: give the engine's address, not a wildcard")
    if kv.replay_endpoint is not None and kv.replay_endpoint == kv.endpoint:
        raise ConfigError(f"{where}.replay_endpoint: the same address as endpoint")


def _validate(cfg: ZMLConfig, src: str, whole_fleet: bool = True) -> None:
    if bool(cfg.gateway.tls_cert_file) != bool(cfg.gateway.tls_key_file):
        raise ConfigError(f"{src}: gateway.tls_cert_file and gateway.tls_key_file go together")
    if cfg.gateway.tls_client_ca_file and not cfg.gateway.tls_cert_file:
        raise ConfigError(f"{src}: gateway.tls_client_ca_file needs gateway.tls_cert_file (HTTPS)")
    for i, proxy in enumerate(cfg.gateway.trusted_proxies):
        try:
            ipaddress.ip_network(proxy, strict=False)
        except ValueError:
            raise ConfigError(f"{src}: gateway.trusted_proxies[{i}]: {proxy!r} is not an IP address or "
                              "CIDR network") from None
    if bool(cfg.nats.tls_cert_file) != bool(cfg.nats.tls_key_file):
        raise ConfigError(f"{src}: nats.tls_cert_file and nats.tls_key_file go together")
    seen: set[str] = set()
    for i, node in enumerate(cfg.nodes):
        where = f"{src}: nodes[{i}]"
        if node.id in seen:
            raise ConfigError(f"{where}.id: duplicate node id {node.id!r}")
        seen.add(node.id)
        if node.accelerator not in ACCELERATORS:
            raise ConfigError(
                f"{where}.accelerator: unknown type {node.accelerator!r} "
                f"(one of {', '.join(ACCELERATORS)})"
            )
        if not node.endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.endpoint: {node.endpoint!r} must start with http:// or https://")
        if node.probe_endpoint is not None and not node.probe_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"{where}.probe_endpoint: {node.probe_endpoint!r} must start with http:// or https://")
        if node.kv_events is not None:
            _validate_kv_events(node, f"{where}.kv_events")
    for i, window in enumerate(cfg.warmup.quiet_windows):
        try:
            parse_window(window)
        except ValueError as exc:
            raise ConfigError(f"{src}: warmup.quiet_windows[{i}]: {exc}") from None
    clash = set(cfg.policy) & set(cfg.policies)
    if clash:
        raise ConfigError(f"{src}: policy {sorted(clash)[0]!r} is defined in both [policy] and [policies]")
    families = cfg.families()
    for table, pols in (("policy", cfg.policy), ("policies", cfg.policies)):
        for name, pol in pols.items():
            validate_policy(name, pol, families, f"{src}: {table}.{name}")
    names = set(cfg.all_policies()) | set(BUILTIN_POLICIES)
    for model, mc in cfg.models.items():
        if mc.policy is not None and mc.policy not in names:
            raise ConfigError(f"{src}: models.{model!r}.policy: unknown policy {mc.policy!r}")
    for model, mc in cfg.models.items():
        if mc.audio and mc.embedding:
            raise ConfigError(f"{src}: models.{model!r}: audio and embedding: a model is one or the other")
    if cfg.defaults.audio_bytes_in_flight < cfg.defaults.max_audio_bytes:
        raise ConfigError(f"{src}: defaults.audio_bytes_in_flight ({cfg.defaults.audio_bytes_in_flight}) is below "
                          f"defaults.max_audio_bytes ({cfg.defaults.max_audio_bytes}): no request that size could run")
    if cfg.defaults.audio_bytes_in_flight < cfg.gateway.max_body_bytes:
        raise ConfigError(f"{src}: defaults.audio_bytes_in_flight ({cfg.defaults.audio_bytes_in_flight}) is below "
                          f"gateway.max_body_bytes ({cfg.gateway.max_body_bytes}): a body that size, sent to its router "
                          "in parts, could never run")
    if cfg.defaults.policy not in names:
        raise ConfigError(f"{src}: defaults.policy: unknown policy {cfg.defaults.policy!r}")
    _validate_batch(cfg.batch, names, src)
    _validate_disaggregation(cfg, src, whole_fleet)
    for i, node in enumerate(cfg.nodes):
        if node.adapters_on_request and node.backend != "vllm":
            raise ConfigError(f"{src}: nodes[{i}] ({node.id}).adapters_on_request: vLLM's LoRA resolver plugins "
                              f"load an adapter a request names; a {node.backend} engine has none")
    known = cfg.base_model_names()
    for name, ad in cfg.adapters.items():
        if ad.base not in known:
            raise ConfigError(f"{src}: adapters.{name!r}.base: {ad.base!r} is no model of the fleet's "
                              f"(known: {', '.join(sorted(known)) or 'none'})")
        if name in known:
            raise ConfigError(f"{src}: adapters.{name!r}: a model has that name; an adapter needs its own")


def _validate_disaggregation(cfg: ZMLConfig, src: str, whole_fleet: bool) -> None:
    by_id = {n.id: n for n in cfg.nodes}
    for i, node in enumerate(cfg.nodes):
        where = f"{src}: nodes[{i}]"
        if not node.roles:
            raise ConfigError(f"{where}.roles: give at least one of {', '.join(ROLES)} (both: the default)")
        if len(set(node.roles)) != len(node.roles):
            raise ConfigError(f"{where}.roles: {node.roles}: list each role once")
        if node.kv_group is not None and node.kv_gbps is None:
            raise ConfigError(f"{where}.kv_gbps: a node in kv_group {node.kv_group!r} needs its link's bandwidth "
                              "(Gbit/s)")
        if "decode" not in node.roles and whole_fleet:
            # A prefill-only node serves no whole request: without a decode node to hand its
            # KV to, it would never serve anything.
            peers = [m for m in cfg.nodes if m is not node and m.kv_group is not None
                     and m.kv_group == node.kv_group and "decode" in m.roles and set(m.models) & set(node.models)]
            if node.kv_group is None or not peers:
                raise ConfigError(f"{where}.roles: prefill-only node {node.id!r} has no decode node to hand its KV to "
                                  "(give both a kv_group and a model in common)")
    for i, link in enumerate(cfg.kv_links):
        where = f"{src}: kv_links[{i}]"
        ends = []
        for key, node_id, role in (("prefill", link.prefill, "prefill"), ("decode", link.decode, "decode")):
            end = by_id.get(node_id)
            if end is None:
                raise ConfigError(f"{where}.{key}: unknown node {node_id!r}")
            if role not in end.roles:
                raise ConfigError(f"{where}.{key}: node {node_id!r} does not take {role} legs (roles {end.roles})")
            ends.append(end)
        p, d = ends
        if p is d:
            raise ConfigError(f"{where}: a link from node {p.id!r} to itself")
        if p.kv_group is None or p.kv_group != d.kv_group:
            raise ConfigError(f"{where}: nodes {p.id!r} and {d.id!r} are not in one kv_group "
                              f"({p.kv_group!r}, {d.kv_group!r})")


def _validate_batch(b: BatchConfig, policies: set[str], src: str) -> None:
    if b.policy and b.policy not in policies:
        raise ConfigError(f"{src}: batch.policy: unknown policy {b.policy!r}")
    if not b.completion_windows:
        raise ConfigError(f"{src}: batch.completion_windows: give at least one (\"24h\")")
    for i, window in enumerate(b.completion_windows):
        try:
            window_seconds(window)
        except ValueError as exc:
            raise ConfigError(f"{src}: batch.completion_windows[{i}]: {exc}") from None
    if b.max_line_bytes > b.max_file_bytes:
        raise ConfigError(f"{src}: batch.max_line_bytes ({b.max_line_bytes}) is above batch.max_file_bytes "
                          f"({b.max_file_bytes})")
    if b.max_file_bytes > b.max_store_bytes:
        raise ConfigError(f"{src}: batch.max_file_bytes ({b.max_file_bytes}) is above batch.max_store_bytes "
                          f"({b.max_store_bytes}): no file that size could be stored")


def parse_config(data: dict[str, Any], source: str = "<memory>", *, whole_fleet: bool = True) -> ZMLConfig:
    """Validate an already-parsed TOML document. ``whole_fleet`` False: ``data`` holds only some
    of the fleet's nodes (one registered at run time), so checks across nodes are skipped."""
    try:
        cfg = msgspec.convert({**_spelled(data), "source": source}, ZMLConfig)
    except msgspec.ValidationError as exc:
        key, msg = _key_of(with_choices(ZMLConfig, str(exc)))
        raise ConfigError(f"{source}: {key or '(top level)'}: {msg}") from exc
    _validate(cfg, source, whole_fleet)
    return cfg


_ENV: list[tuple[str, str, str, type]] = [
    ("ZML_NATS_URL", "nats", "url", str),
    ("ZML_NATS_REPLICAS", "nats", "replicas", int),
    ("ZML_GATEWAY_HOST", "gateway", "host", str),
    ("ZML_GATEWAY_PORT", "gateway", "port", int),
    ("ZML_GATEWAY_GRPC_PORT", "gateway", "grpc_port", int),
    ("ZML_METRICS_HOST", "metrics", "host", str),
    ("ZML_NATS_NKEY", "nats", "nkey_file", str),
    ("ZML_NATS_TLS_CA", "nats", "tls_ca_file", str),
    ("ZML_NATS_TLS_CERT", "nats", "tls_cert_file", str),
    ("ZML_NATS_TLS_KEY", "nats", "tls_key_file", str),
    ("ZML_GATEWAY_TLS_CERT", "gateway", "tls_cert_file", str),
    ("ZML_GATEWAY_TLS_KEY", "gateway", "tls_key_file", str),
]


def load_config(path: str | os.PathLike[str] | None = None, *, env: dict[str, str] | None = None) -> ZMLConfig:
    """Load and validate zml.toml; ``None`` means defaults plus environment overrides.

    Environment overrides (applied here and nowhere else): ZML_NATS_URL, ZML_NATS_REPLICAS, ZML_GATEWAY_HOST,
    ZML_GATEWAY_PORT, ZML_GATEWAY_GRPC_PORT, ZML_METRICS_HOST, ZML_API_KEYS (comma-separated), ZML_NATS_NKEY,
    ZML_NATS_TLS_CA/CERT/KEY, ZML_GATEWAY_TLS_CERT/KEY.
    """
    env = dict(os.environ) if env is None else env
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError as exc:
            raise ConfigError(f"{source}: file not found") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML: {exc}") from exc
    for var, section, key, typ in _ENV:
        if env.get(var):
            try:
                value = typ(env[var])
            except ValueError as exc:
                raise ConfigError(f"environment {var}={env[var]!r}: expected {typ.__name__}") from exc
            data.setdefault(section, {})[key] = value
    if env.get("ZML_API_KEYS") is not None and "ZML_API_KEYS" in env:
        keys = [k.strip() for k in env["ZML_API_KEYS"].split(",") if k.strip()]
        data.setdefault("gateway", {})["api_keys"] = keys
    return parse_config(data, source)


def find_config(start: str | os.PathLike[str] | None = None) -> Path | None:
    """zml.toml in ``start`` (default: the working directory) or any parent."""
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        candidate = folder / "zml.toml"
        if candidate.is_file():
            return candidate
    return None


def reference_markdown() -> str:
    """The key reference of docs/configuration.md, built from this module's field docstrings
    (a test keeps the document in step with the code)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(sys.modules[__name__]))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    sections = [
        ("[nats]", "NatsConfig"), ("[gateway]", "GatewayConfig"), ("[router]", "RouterConfig"), ("[flow]", "FlowConfig"),
        ("[health]", "HealthConfig"), ("[warmup]", "WarmupConfig"), ("[defaults]", "DefaultsConfig"),
        ("[metrics]", "MetricsConfig"), ("[batch]", "BatchConfig"), ("[disaggregation]", "DisaggregationConfig"),
        ("[[nodes]]", "NodeConfig"), ("[[kv_links]]", "KVLinkConfig"),
        ("[nodes.sim]", "SimConfig"), ("[nodes.kv_events]", "KVEventsConfig"), ('[models."NAME"]', "ModelConfig"),
        ("[planner]", "PlannerConfig"), ('[planner.models."NAME"]', "PlannerModelConfig"),
        ('[adapters."NAME"]', "AdapterConfig"),
        ("[policy.NAME] / [policies.NAME]", "PolicyConfig"),
    ]
    out: list[str] = []
    for title, cls_name in sections:
        out += [f"### `{title}`", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        body = classes[cls_name].body
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            doc = ""
            nxt = body[i + 1] if i + 1 < len(body) else None
            if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                doc = " ".join(nxt.value.value.split())
            default = ast.unparse(stmt.value) if stmt.value is not None else "required"
            if isinstance(stmt.value, ast.Call):  # msgspec.field(default_factory=lambda: [...])
                for kw in stmt.value.keywords:
                    if kw.arg == "default_factory" and isinstance(kw.value, ast.Lambda):
                        default = ast.unparse(kw.value.body)
            typ = ast.unparse(stmt.annotation).replace("|", "\\|")
            out.append(f"| `{stmt.target.id}` | `{typ}` | `{default}` | {doc} |")
        out.append("")
    return "\n".join(out)
