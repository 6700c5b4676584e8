"""Every NATS subject, stream, KV bucket and queue group ZML uses, in one place.

No other module writes a subject literal: services and the SDK import these names, and
``docs/nats-api.md`` documents them for systems that publish raw JSON.

    zml.infer                      request-reply: one inference request (JSON InferRequest)
    zml.cancel.<owner>.<request_id> fire-and-forget: cancel one's own in-flight request
    zml.cancel.<request_id>        ... the same for an anonymous owner (open broker, no identity)
    _ZML_INBOX.<owner>.>           one identity's private reply inbox (owner = its public nkey)
    zml.node.inflight              router replicas share dispatch/completion deltas
    zml.node.marks                 router replicas share cooldown/saturation marks (NodeMark)
    zml.node.kvevents.<node_id>    health: a node's engine KV-cache events, bridged (KvEventBatch)
    zml.node.prefix                router replicas share where they sent which prompt (PrefixRecord)
    zml.admin.nodes.<verb>         node registration (add/remove/list)
    zml.events.completed           routers: one event per finished request (warmup, health)
    zml.events.warmup              warmup service: load started / finished / failed
    zml.warmup.serve               request-reply: load a model now (`zml serve`)
    zml.warmup.plan                request-reply: the placement planner's current plan (`zml plan`)
    zml.events.placement           warmup service: a new plan, a move started / done / blocked
    KV bucket zml_registry         nodes added at run time (health service)
    KV bucket zml_nodes            node state written by health, watched by routers
    KV bucket zml_leases           one key per role (health, warmup): which replica is active
    KV bucket zml_queue_claims     routers: create-only dispatch claims on queued requests
    KV bucket zml_request_ids      routers: create-only claims on callers' in-flight request ids
    zml.batch.work.start|shard.<b>|final  the Batch API's work (stream ZML_BATCH_WORK, runners)
    zml.batch.result.<b>.<shard>.<line>   one result per batch line (stream ZML_BATCH_RESULTS)
    zml.batch.events               batch runners: a batch's status or progress changed
    KV bucket zml_batch_index      Batch API: file and batch records, keyed by owner
    Object store zml_batch_files   Batch API: input, output and error files
    KV bucket zml_sessions         routers: session -> node bindings, expiring when idle
    zml.upload.<router_id>.<token> a request body larger than one message, in parts, to its router
"""

from __future__ import annotations

import hashlib
import re

PREFIX = "zml"

#: Inference requests. Routers subscribe in :data:`ROUTER_QUEUE`; each request is answered on
#: its reply subject (one message, or a chunk sequence when ``stream`` is true).
INFER = f"{PREFIX}.infer"
#: The same requests from a front door (the gateway role, the only identity allowed to publish
#: here): the router honours the front-door headers (``Zml-Label``, ``Zml-Default-Policy``) only
#: on this subject; on :data:`INFER` they come from the sender's key record or not at all.
FRONT_DOOR_INFER = f"{PREFIX}.gateway.infer"
#: Queue group shared by every router replica: NATS hands each request to exactly one of them.
ROUTER_QUEUE = "zml-routers"

#: Cancellation: publish anything to ``zml.cancel.<owner>.<request_id>``; the router holding
#: that owner's request aborts the backend call. A request id belongs to its owner: the
#: identity whose inbox the reply goes to (permissions pin each identity to its own inbox and
#: its own cancel subjects), refined by a front door's ``Zml-Owner`` header (the gateway's API
#: key or client address). A cancel from another owner matches nothing.
CANCEL_PREFIX = f"{PREFIX}.cancel"

#: Root of the per-identity reply inboxes: ``_ZML_INBOX.<owner>.<...>``. nats-py's
#: ``inbox_prefix`` connect option puts every reply subject of a connection under it.
INBOX_ROOT = "_ZML_INBOX"
_INBOX_DOT = INBOX_ROOT + "."

#: Router replicas publish in-flight deltas here so that each replica's view of node load
#: includes the others' dispatches.
INFLIGHT = f"{PREFIX}.node.inflight"
#: ... and, every second, a snapshot of their own counts (heals lost deltas, expires dead peers).
INFLIGHT_SNAPSHOT = f"{PREFIX}.node.inflight_snapshot"

#: Router replicas share cooldown and saturation marks here (``NodeMark``): a node one replica
#: saw fail is skipped by all of them.
NODE_MARKS = f"{PREFIX}.node.marks"

#: The health service bridges each node's engine KV-cache events (vLLM/SGLang ZMQ, ordered,
#: gaps replayed) here as ``KvEventBatch`` JSON: ``zml.node.kvevents.<node_id>``; every router
#: subscribes to ``zml.node.kvevents.>`` and applies them to its prefix index.
KV_EVENTS_PREFIX = f"{PREFIX}.node.kvevents"


#: Router replicas share every prompt they dispatch (its key chain and node) and every cache
#: report an engine sent back (``PrefixRecord`` JSON), so that N replicas' prefix indexes agree.
PREFIX_RECORDS = f"{PREFIX}.node.prefix"
#: JetStream KV bucket (memory) of session bindings: key = hash of (owner, session id), value =
#: the node id; the bucket's TTL is the idle time after which a session is forgotten.
SESSIONS_BUCKET = "zml_sessions"


def kv_events(node_id: str) -> str:
    """``zml.node.kvevents.<node_id>``: one node's bridged KV-cache events."""
    return f"{KV_EVENTS_PREFIX}.{node_id}"


#: Run-time node registration and listing (request-reply).
ADMIN_NODES_PREFIX = f"{PREFIX}.admin.nodes"

#: Router events (completions, per-model counts) consumed by the warmup service and tools.
EVENTS_PREFIX = f"{PREFIX}.events"

#: Warmup service: "load this model now" (request-reply, ``ServeRequest`` -> ``ServeReply``).
WARMUP_SERVE = f"{PREFIX}.warmup.serve"
#: Warmup service: the placement planner's plan (request-reply, ``PlanRequest`` -> ``PlanReply``).
WARMUP_PLAN = f"{PREFIX}.warmup.plan"
#: Placement events (``PlacementEvent``): ``event(EVENT_PLACEMENT)``.
EVENT_PLACEMENT = "placement"
#: Router completion events (``RequestCompleted``): ``event(EVENT_COMPLETED)``.
EVENT_COMPLETED = "completed"
#: Warmup progress events (``WarmupEvent``): ``event(EVENT_WARMUP)``.
EVENT_WARMUP = "warmup"

#: JetStream KV bucket holding one entry per node (key = node id, value = NodeState JSON).
NODES_BUCKET = "zml_nodes"
#: JetStream KV bucket of run-time prices (key = node id, value CostEntry JSON): spot-price
#: feeds or `zml cost set` write it; routers and the gateway watch it.
COSTS_BUCKET = "zml_costs"
#: JetStream KV bucket holding registered nodes added at run time (survives health restarts).
REGISTRY_BUCKET = "zml_registry"
#: JetStream KV bucket of leader leases: key = role ("health", "warmup"), value = the active
#: replica's id, renewed with compare-and-set (zmlcore.runtime.lease).
LEASES_BUCKET = "zml_leases"
#: JetStream stream holding requests waiting for capacity (queue_on_saturation).
QUEUE_STREAM = "ZML_QUEUE"
QUEUE_SUBJECT_PREFIX = f"{PREFIX}.queue"
#: JetStream KV bucket of dispatch claims on queued entries (key ``<model key>.<stream seq>``):
#: create-only, so a redelivered entry is never dispatched a second time.
QUEUE_CLAIMS_BUCKET = "zml_queue_claims"
#: JetStream KV bucket (memory) of request ids in flight, so that a caller's duplicate id is
#: refused on every router replica: key = hash of (owner, front-door owner, id), value = the
#: holding router's id, created (create-only) before dispatch and deleted when the request ends;
#: each entry has a TTL, so a dead router's claims go away (zml_router.replicas.ids).
REQUEST_IDS_BUCKET = "zml_request_ids"
#: Routers announce "model X has requests waiting" here (messages.QueueBusy), so new arrivals
#: queue behind them.
QUEUE_BUSY = f"{PREFIX}.queue_busy"
#: Routers publish their per-tenant token counters here (messages.flow.ShareReport) so that
#: every replica orders its saturation queue by the same fair shares (zmlcore.flowctl.shares).
FLOW_SHARES = f"{PREFIX}.flow.shares"
#: Durable pull consumer of a model's saturation queue: ``zmlq-<model key>`` (one per model,
#: shared by every router replica).
QUEUE_CONSUMER_PREFIX = "zmlq"
#: Headers of a queued entry (beside the request's own): its reply inbox, when it expires with
#: QUEUE_FULL (unix seconds), when it was first queued, and a re-queued request's whole timeout.
H_QUEUE_REPLY = "Zml-Reply"
H_QUEUE_DEADLINE = "Zml-Deadline"
H_QUEUE_ENQUEUED = "Zml-Enqueued"
H_QUEUE_TOTAL_MS = "Zml-Total-Timeout-Ms"


def cancel(request_id: str, owner: str = "") -> str:
    """Subject on which ``owner`` cancels its request ``request_id`` ("" = no identity)."""
    return f"{CANCEL_PREFIX}.{owner}.{request_id}" if owner else f"{CANCEL_PREFIX}.{request_id}"


def parse_cancel(subject: str) -> tuple[str, str] | None:
    """``(owner, request_id)`` of a cancel subject; None if it is not one."""
    parts = subject.split(".")
    if len(parts) == 3:
        return "", parts[2]
    if len(parts) == 4:
        return parts[2], parts[3]
    return None


def inbox_prefix(owner: str) -> str:
    """The inbox prefix of identity ``owner`` (its public nkey): ``_ZML_INBOX.<owner>``."""
    return f"{INBOX_ROOT}.{owner}"


def reply_owner(reply: str) -> str:
    """The identity a reply subject belongs to ("" for the default ``_INBOX`` or none)."""
    if reply.startswith(_INBOX_DOT):  # called per request: no string built per call
        return reply.split(".", 2)[1]
    return ""


def admin_nodes(verb: str) -> str:
    """``zml.admin.nodes.add`` / ``.remove`` / ``.list``."""
    return f"{ADMIN_NODES_PREFIX}.{verb}"


#: Every router replica answers its view of the fleet here (scatter-gather: collect replies).
ROUTERS_STATE = f"{PREFIX}.admin.routers.state"


#: "Which decision was this?": every router replica listens; the one that remembers the
#: decision id answers (zmlcore.messages.DecisionRecord), the others stay silent.
ROUTERS_DECISION = f"{PREFIX}.admin.routers.decision"


def router_state(router_id: str) -> str:
    """``zml.admin.router.<id>.state``: a router replica's view of the fleet (request-reply)."""
    return f"{PREFIX}.admin.router.{router_id}.state"


def event(kind: str) -> str:
    """``zml.events.<kind>``, e.g. ``zml.events.completed``."""
    return f"{EVENTS_PREFIX}.{kind}"


def queue_key(model: str) -> str:
    """A model's token in its saturation queue's subject and consumer name: readable, and
    unique thanks to a short hash (``meta-llama_llama-3-8b-instruct-8f4cb099``)."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", model)[:48]
    return f"{clean}-{hashlib.sha1(model.encode()).hexdigest()[:8]}"


def queue(model_key: str) -> str:
    """Subject of the saturation queue for one model (dots in the key are not allowed)."""
    return f"{QUEUE_SUBJECT_PREFIX}.{model_key}"


def queue_consumer(model_key: str) -> str:
    """The durable consumer name of a model's saturation queue."""
    return f"{QUEUE_CONSUMER_PREFIX}-{model_key}"


# --- Message headers (NATS). HTTP equivalents are lower-case ``x-zml-*``. -------------------
H_REQUEST_ID = "Zml-Request-Id"
H_ERROR_CODE = "Zml-Error-Code"
H_RETRY_AFTER = "Zml-Retry-After"  # seconds, on retryable errors that know when to retry
H_STREAM = "Zml-Stream"  # on stream messages: "chunk" | "end" | "error"
H_TIMEOUT_MS = "Zml-Timeout-Ms"
H_POLICY = "Zml-Policy"
H_ACCELERATOR_ID = "Zml-Accelerator-Id"
H_NODE_ID = "Zml-Node-Id"
H_ACCELERATOR_TYPE = "Zml-Accelerator-Type"
H_FAMILY = "Zml-Family"
H_QUEUE_DEPTH = "Zml-Queue-Depth"
H_DECISION_ID = "Zml-Decision-Id"
H_ROUTING = "Zml-Routing"  # the single header sent to backends: compact routing metadata
#: Set by a front door (the gateway) on requests and cancels: whom, within the sending identity,
#: the request id belongs to. It only narrows the sender's own namespace, so it needs no trust.
H_OWNER = "Zml-Owner"
#: "1": the sender generated this request id itself (unique by construction; the gateway and the
#: SDK set it when the caller gave none), so routers skip the cross-replica duplicate check. Only
#: the sender's own namespace is affected, so it needs no trust.
H_ID_GENERATED = "Zml-Id-Generated"
#: Router-internal, on a queued request: the KV revision of its claim on its id (zml_router.replicas.ids).
H_ID_CLAIM = "Zml-Id-Claim"
#: On every message of a streamed reply: 0 on ``start``, then 1, 2, ... on each chunk and on the
#: final ``end``/``error``. A receiver that sees a number skipped lost a message (core NATS is
#: at-most-once) and ends the stream with STREAM_INTERRUPTED instead of returning less text.
H_SEQ = "Zml-Seq"
#: On a request: "send me keepalives every <ms> while you work on it" (zmlcore.reply.keepalive). On
#: a message on the reply subject: it is a keepalive (``alive``, or ``queued`` once the request
#: waits in the saturation queue), not part of the reply.
H_KEEPALIVE = "Zml-Keepalive"
#: On a request sent again because the router holding it went silent (same id, new inbox).
H_RESEND = "Zml-Resend"
#: On a streamed request sent again because the router relaying its stream went silent after
#: content went out: what the requester has of the answer (``zmlcore.messages.StreamResume``, JSON
#: in unpadded base64url: zmlcore.reply.resume), so that the router taking it over continues the
#: answer from there (the text as the assistant's prefix, numbering from the next ``Zml-Seq``)
#: instead of starting it again. It concerns only the sender's own request: no trust needed.
H_RESUME = "Zml-Resume"

STREAM_CHUNK = "chunk"
STREAM_END = "end"
STREAM_ERROR = "error"
#: A requester that relays SSE as it is (the gateway) asks with ``Zml-Accept-Stream: events``;
#: its stream's chunks then come as ``Zml-Stream: events`` messages: one or more whole framed
#: events (``data: <chunk JSON>\n\n`` each), as the node sent them, numbered like chunks.
#: Without the header, one ``chunk`` message per event (docs/nats-api.md).
H_ACCEPT_STREAM = "Zml-Accept-Stream"
STREAM_EVENTS = "events"
#: ``Zml-Accept-Stream: frames``: as ``events``, but each chunk message header-less, its body
#: the sequence number, ``\n`` and the events (zmlcore.reply.streamframe): no header block per chunk.
STREAM_FRAMES = "frames"
#: ``Zml-Accept-Routing: body`` on a request (the gateway): the routing metadata travels once,
#: in the reply body's ``zml`` object (a stream's ``start`` body), without the ``Zml-*`` routing
#: headers. Without it a reply carries both (docs/nats-api.md).
H_ACCEPT_ROUTING = "Zml-Accept-Routing"
ROUTING_IN_BODY = "body"
#: Front door only (dropped on ``zml.infer``: zml_router.request.intake.drop_untrusted). ``Zml-Body: clean``: the
#: gateway validated the body (zmlcore.messages.validate) and moved ZML's own fields out of it into
#: ``Zml-Policy`` (the per-call policy as JSON: a name or an inline policy) and
#: ``Zml-Accelerator-Id`` (zmlcore.messages.frontdoor); the router reads it with one small decode.
H_BODY = "Zml-Body"
BODY_CLEAN = "clean"
H_POLICY = "Zml-Policy"
H_ACCELERATOR_ID = "Zml-Accelerator-Id"
#: Front door only too: the prompt's key chain (zmlcore.policy.prefix.keys.chain_header), computed
#: by the gateway from the messages it decoded to validate them, so that a router does not decode
#: a long prompt a second time only to key it. Absent, malformed or for another model: the router
#: computes the chain itself.
H_PREFIX_KEYS = "Zml-Prefix-Keys"
#: ``Zml-Continue-On-Failure: 0``: the request's ``continue_on_failure: false`` (an answer whose
#: node fails part-way ends with the error instead of being continued on another node). Only
#: narrows what the sender's own request gets: honoured on every request subject.
H_CONTINUE = "Zml-Continue-On-Failure"

# --- API keys and plans (gateway) -------------------------------------------------------------
#: JetStream KV bucket of API keys created at run time (`zml keys create`): key = key id, value
#: ApiKeyRecord JSON holding a SHA-256 of the key, never the key. Gateways watch it.
KEYS_BUCKET = "zml_keys"
#: JetStream KV bucket of plan usage shared by every gateway replica (key = limited id, value
#: LimitState JSON, updated with compare-and-set); entries expire when idle.
LIMITS_BUCKET = "zml_limits"
#: Gateway -> router: the API key's default policy (used when the request names none) and its
#: cost-attribution label (copied into routing metadata and completion events).
H_DEFAULT_POLICY = "Zml-Default-Policy"
H_LABEL = "Zml-Label"
#: A conversation's id (HTTP ``x-session-id``, the SDK's ``session=``; the OpenAI ``user`` field
#: when absent): routers keep its requests on one node while that node stays within its load
#: bound, bindings shared in the KV bucket ``zml_sessions`` (docs/routing.md). Any sender may set
#: it: it only groups that sender's own requests.
H_SESSION = "Zml-Session"
#: Longest session id accepted (longer ones are cut at the front door: it is a grouping key).
MAX_SESSION_ID = 256

#: Replies larger than NATS's max_payload (zmlcore.reply.bigreply). A requester that collects a reply
#: in parts says so on its request with ``Zml-Accept-Parts: <most bytes it collects>`` (the
#: gateway and the SDK always do); such a reply then arrives on its reply subject as several
#: messages, each with ``Zml-Part: k`` (1-based) and ``Zml-Parts: n``, in order. Part 1 carries
#: the usual reply headers. A requester that does not declare it is refused before the node runs
#: when the reply could exceed max_payload (REPLY_TOO_LARGE).
H_ACCEPT_PARTS = "Zml-Accept-Parts"
H_PART = "Zml-Part"
H_PARTS = "Zml-Parts"

#: ``Zml-Priority: batch`` on a request: it may wait, and is admitted only where a node has
#: room beyond what interactive traffic needs (the batch runners send it; docs/batches.md).
#: It can only lower the sender's own request, so it needs no trust.
H_PRIORITY = "Zml-Priority"
PRIORITY_BATCH = "batch"
#: Flow control (zmlcore.flowctl, docs/routing.md "Flow control"). ``Zml-Priority`` also takes
#: ``critical``, ``standard`` and ``sheddable`` (its band); a band above what the caller may claim
#: is lowered (the reply's ``Zml-Priority-Lowered-From`` names the band asked). Per-request latency targets, in ms:
H_TTFT_SLO_MS = "Zml-Ttft-Slo-Ms"
H_TPOT_SLO_MS = "Zml-Tpot-Slo-Ms"
#: Front door only (an API key's flow options, zml keys create --priority/--max-priority/--weight):
#: the band a request of the key gets when it names none, the highest it may claim, its tenant
#: weight in the fair share.
H_PRIORITY_DEFAULT = "Zml-Priority-Default"
H_PRIORITY_MAX = "Zml-Priority-Max"
H_TENANT_WEIGHT = "Zml-Tenant-Weight"
#: Router-only, on a queued request: the tenant its fair share is counted for (the API key id
#: from a front door, else the sender's identity), fixed where it arrived.
H_TENANT = "Zml-Tenant"

#: Audio (OpenAI's /v1/audio/transcriptions and /translations; zmlcore.messages.audio). On a
#: request: ``Zml-Audio: transcription|translation``, its body the caller's multipart form, as it
#: came, and ``Zml-Content-Type`` the form's content type (with its boundary). Such a request's
#: routing fields are headers on both subjects (``Zml-Policy``, ``Zml-Accelerator-Id``,
#: ``Zml-Request-Id``, ``Zml-Timeout-Ms``): the form is never rewritten. On its reply:
#: ``Zml-Content-Type`` is the node's (text, SRT and VTT bodies are not JSON), and the routing
#: metadata travels as ``Zml-*`` headers only.
H_AUDIO = "Zml-Audio"
H_CONTENT_TYPE = "Zml-Content-Type"

#: Requests larger than one NATS message (audio: up to [defaults] max_audio_bytes), uploaded in
#: parts to the router that took them (zmlcore.reply.exchange sends, zml_router.request.uploads collects).
#: The requester publishes the request with an empty body and ``Zml-Upload-Bytes: <body size>``;
#: the router answers on the reply subject with an empty message carrying ``Zml-Upload-To:
#: zml.upload.<router id>.<token>`` (a random token: only the requester learns it, on its private
#: inbox), and the requester publishes the body there in order, ``Zml-Part: k`` / ``Zml-Parts: n``,
#: as a reply in parts comes back (zmlcore.reply.bigreply). A lost part: UPLOAD_INCOMPLETE
#: (retryable).
H_UPLOAD_BYTES = "Zml-Upload-Bytes"
H_UPLOAD_TO = "Zml-Upload-To"
UPLOAD_PREFIX = f"{PREFIX}.upload"


def upload(router_id: str, token: str = "*") -> str:
    """``zml.upload.<router id>.<token>``: where one request's parts go (``*``: a router's all)."""
    return f"{UPLOAD_PREFIX}.{router_id}.{token}"


# --- The Batch API (docs/batches.md): gateway handlers and batch runners ----------------------
#: JetStream KV bucket of file and batch records: ``f.<owner token>.<file id>`` and
#: ``b.<owner token>.<batch id>`` (zmlcore.batch.store), so that one owner's records are one
#: subject filter and another owner's id names a key that does not exist (404).
BATCH_INDEX_BUCKET = "zml_batch_index"
#: JetStream object store of the files themselves (inputs, outputs, errors): name = file id.
BATCH_FILES_BUCKET = "zml_batch_files"
#: Work-queue stream of the runners' work: each message is taken by one runner replica and
#: stays until it acks (a runner killed mid-task leaves it to another after ack_wait).
BATCH_WORK_STREAM = "ZML_BATCH_WORK"
BATCH_WORK_PREFIX = f"{PREFIX}.batch.work"
#: A new batch: validate it and split its input into shards (BatchTask).
BATCH_WORK_START = f"{BATCH_WORK_PREFIX}.start"
#: A batch whose every shard is done: write its output and error files (BatchTask).
BATCH_WORK_FINAL = f"{BATCH_WORK_PREFIX}.final"
BATCH_WORK_SHARDS = f"{BATCH_WORK_PREFIX}.shard.>"
#: Durable pull consumers of the work stream, one per kind of work, shared by every runner.
BATCH_START_CONSUMER = "zml-batch-start"
BATCH_SHARD_CONSUMER = "zml-batch-shards"
BATCH_FINAL_CONSUMER = "zml-batch-final"
#: Stream of line results: one subject per line, at most one message per subject, the first
#: kept (discard-new per subject): a line answered twice still has one result.
BATCH_RESULTS_STREAM = "ZML_BATCH_RESULTS"
BATCH_RESULT_PREFIX = f"{PREFIX}.batch.result"
#: Runners publish a batch's new status or progress here (BatchEvent): dashboards, followers.
BATCH_EVENTS = f"{PREFIX}.batch.events"


def batch_shard(batch_id: str) -> str:
    """Work subject of one batch's shards: ``zml.batch.work.shard.<batch id>``."""
    return f"{BATCH_WORK_PREFIX}.shard.{batch_id}"


def batch_result(batch_id: str, shard: int, line: int) -> str:
    """Subject of one line's result: ``zml.batch.result.<batch id>.<shard>.<line>``."""
    return f"{BATCH_RESULT_PREFIX}.{batch_id}.{shard}.{line}"


def batch_results(batch_id: str, shard: int | None = None) -> str:
    """Filter of a batch's results (or one shard's)."""
    if shard is None:
        return f"{BATCH_RESULT_PREFIX}.{batch_id}.>"
    return f"{BATCH_RESULT_PREFIX}.{batch_id}.{shard}.*"
