"""Who may publish and subscribe where on the bus: one NATS permission set per role.

Pure data, no I/O: :mod:`zml.cli._identities` writes these into the nats-server authorization
file, docs/security.md explains them, and tests/e2e/test_bus_permissions.py proves each one
both ways (what a role needs works, everything else is a permissions violation).

    >>> perms = permissions("client", "UABC...")
    >>> perms["publish"]["allow"]
    ['zml.infer', 'zml.cancel.UABC....>', 'zml.upload.>']

Replies are private: every identity gets its own inbox prefix ``_ZML_INBOX.<public key>``
(:func:`zmlcore.subjects.inbox_prefix`) and may subscribe there only. Nobody may subscribe to
another identity's inbox, to ``_INBOX.>`` or to ``_ZML_INBOX.>``. JetStream (KV buckets, the
saturation queue) is reached through ``$JS.API.*`` subjects: each service gets exactly the API
calls it makes on the streams it uses; clients get none.
"""

from __future__ import annotations

from typing import Any

from zmlcore import subjects

ROLES = ("gateway", "router", "health", "warmup", "batch", "admin", "client", "observer")
#: Roles every deployment runs (one identity each, shared by a role's replicas).
SERVICE_ROLES = ("gateway", "router", "health", "warmup", "batch")

#: A service answering requests may publish to the requester's reply subject, and only while
#: the request is open (nats-server's ``allow_responses``): enough for health's and warmup's
#: request-reply. Routers stream many replies per request and answer queued requests they did
#: not receive themselves, so they are granted the inbox root instead.
_RESPONSES = {"max": 1, "expires": "2m"}


def _stream_read(stream: str) -> list[str]:
    """The JetStream API calls of a KV watcher/reader (nats-py: info, ordered push consumer
    with flow control, direct get)."""
    api = "$JS.API"
    return [
        f"{api}.STREAM.INFO.{stream}",
        f"{api}.STREAM.CREATE.{stream}",  # ensure_kv: whichever service starts first creates it
        f"{api}.STREAM.MSG.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}",
        f"{api}.DIRECT.GET.{stream}.>",
        f"{api}.CONSUMER.CREATE.{stream}",
        f"{api}.CONSUMER.CREATE.{stream}.>",
        f"{api}.CONSUMER.INFO.{stream}.>",
        f"{api}.CONSUMER.DELETE.{stream}.>",
        f"$JS.FC.{stream}.>",
    ]


def kv_read(bucket: str) -> list[str]:
    """Publish subjects needed to open, get from and watch KV ``bucket``."""
    return _stream_read(f"KV_{bucket}")


def kv_watch(bucket: str) -> list[str]:
    """:func:`kv_read` without creating the bucket: for identities outside ZML's services, which
    must not be able to create a bucket with a configuration of their choosing."""
    return [s for s in kv_read(bucket) if not s.startswith("$JS.API.STREAM.CREATE.")]


def kv_write(bucket: str) -> list[str]:
    """... and to put/delete keys in it."""
    return [*kv_read(bucket), f"$KV.{bucket}.>"]


def _queue_stream() -> list[str]:
    """The routers' saturation queue: create the stream, durable pull consumers, fetch, ack."""
    s = subjects.QUEUE_STREAM
    api = "$JS.API"
    return [
        f"{subjects.QUEUE_SUBJECT_PREFIX}.>",
        f"{api}.STREAM.CREATE.{s}", f"{api}.STREAM.INFO.{s}", f"{api}.STREAM.UPDATE.{s}",
        f"{api}.CONSUMER.LIST.{s}", f"{api}.CONSUMER.NAMES.{s}",
        f"{api}.CONSUMER.CREATE.{s}", f"{api}.CONSUMER.CREATE.{s}.>", f"{api}.CONSUMER.DURABLE.CREATE.{s}.>",
        f"{api}.CONSUMER.INFO.{s}.>", f"{api}.CONSUMER.DELETE.{s}.>", f"{api}.CONSUMER.MSG.NEXT.{s}.>",
        f"$JS.ACK.{s}.>",
    ]


def _batch_files() -> list[str]:
    """The Batch API's file store (JetStream object store): put, read, delete objects."""
    stream = f"OBJ_{subjects.BATCH_FILES_BUCKET}"
    return [*_stream_read(stream), f"$O.{subjects.BATCH_FILES_BUCKET}.>", f"$JS.API.STREAM.PURGE.{stream}"]


def _batch_streams() -> list[str]:
    """Open (create) the Batch API's work and results streams."""
    api = "$JS.API"
    return [f"{api}.STREAM.{verb}.{s}" for s in (subjects.BATCH_WORK_STREAM, subjects.BATCH_RESULTS_STREAM)
            for verb in ("INFO", "CREATE")]


def _batch_runner() -> list[str]:
    """A batch runner's JetStream calls: the work queue's durable consumers (fetch, ack,
    in-progress), reading a batch's results back and purging them once written out."""
    api = "$JS.API"
    w, r = subjects.BATCH_WORK_STREAM, subjects.BATCH_RESULTS_STREAM
    return [
        f"{subjects.BATCH_WORK_PREFIX}.>", f"{subjects.BATCH_RESULT_PREFIX}.>",
        f"{api}.CONSUMER.CREATE.{w}", f"{api}.CONSUMER.CREATE.{w}.>", f"{api}.CONSUMER.DURABLE.CREATE.{w}.>",
        f"{api}.CONSUMER.INFO.{w}.>", f"{api}.CONSUMER.MSG.NEXT.{w}.>", f"$JS.ACK.{w}.>",
        *_stream_read(r), f"{api}.STREAM.PURGE.{r}",
    ]


def _grants(role: str, owner: str) -> tuple[list[str], list[str], bool]:
    """(publish allow, subscribe allow, allow_responses) for ``role``."""
    inbox = f"{subjects.inbox_prefix(owner)}.>"
    own_cancel = f"{subjects.CANCEL_PREFIX}.{owner}.>"
    completed = subjects.event(subjects.EVENT_COMPLETED)
    upload = f"{subjects.UPLOAD_PREFIX}.>"  # a body over one message, in parts, to its router
    if role == "client":
        return [subjects.INFER, own_cancel, upload], [inbox], False
    if role == "observer":  # billing, analytics, dashboards: read events, node state and prices; nothing else
        return ([subjects.admin_nodes("list"), *kv_watch(subjects.NODES_BUCKET), *kv_watch(subjects.COSTS_BUCKET)],
                [inbox, f"{subjects.EVENTS_PREFIX}.>"], False)
    if role == "gateway":
        # Requests go to the front-door subject: only there does a router honour the key's
        # label and default policy (zml_router.request.intake.drop_untrusted).
        pub = [subjects.FRONT_DOOR_INFER, own_cancel, upload, subjects.ROUTERS_STATE, subjects.ROUTERS_DECISION,
               *kv_read(subjects.NODES_BUCKET),
               *kv_read(subjects.COSTS_BUCKET), *kv_read(subjects.KEYS_BUCKET), *kv_write(subjects.LIMITS_BUCKET),
               f"$JS.API.CONSUMER.LIST.{subjects.QUEUE_STREAM}",  # the dashboard's saturation-queue depth
               # the Batch API: files, records, new batches for the runners, cancels announced
               *kv_write(subjects.BATCH_INDEX_BUCKET), *_batch_files(), *_batch_streams(),
               subjects.BATCH_WORK_START, subjects.BATCH_EVENTS]
        # completion events, batch progress, the planner's moves and the routers' share reports
        # (flow control: tenants' shares, what waits by band) feed the /dashboard
        return pub, [inbox, completed, subjects.BATCH_EVENTS, subjects.event(subjects.EVENT_PLACEMENT),
                     subjects.FLOW_SHARES], False
    if role == "router":
        pub = [f"{subjects.INBOX_ROOT}.>", subjects.INFLIGHT, subjects.INFLIGHT_SNAPSHOT, subjects.NODE_MARKS,
               completed, subjects.QUEUE_BUSY, *_queue_stream(), *kv_write(subjects.QUEUE_CLAIMS_BUCKET),
               # request ids in flight on every replica; is a claim's holder still running?
               *kv_write(subjects.REQUEST_IDS_BUCKET), subjects.router_state("*"),
               *kv_read(subjects.NODES_BUCKET), *kv_read(subjects.COSTS_BUCKET),
               # client identities' plans (zml_router.replicas.limits), counted with the gateways'
               *kv_read(subjects.KEYS_BUCKET), *kv_write(subjects.LIMITS_BUCKET),
               # cache-aware routing: session bindings and the replicas' shared prefix records
               *kv_write(subjects.SESSIONS_BUCKET), subjects.PREFIX_RECORDS,
               subjects.FLOW_SHARES]
        sub = [inbox, f"{subjects.INFER} {subjects.ROUTER_QUEUE}",  # only inside the queue group
               f"{subjects.FRONT_DOOR_INFER} {subjects.ROUTER_QUEUE}",
               subjects.INFLIGHT, subjects.INFLIGHT_SNAPSHOT, subjects.NODE_MARKS, f"{subjects.CANCEL_PREFIX}.>",
               subjects.ROUTERS_STATE, subjects.ROUTERS_DECISION, subjects.router_state("*"), subjects.QUEUE_BUSY,
               subjects.PREFIX_RECORDS, subjects.FLOW_SHARES, f"{subjects.KV_EVENTS_PREFIX}.>", upload]
        return pub, sub, False
    if role == "health":
        pub = [subjects.event(subjects.EVENT_WARMUP), *kv_write(subjects.NODES_BUCKET),
               *kv_write(subjects.REGISTRY_BUCKET), *kv_read(subjects.COSTS_BUCKET),
               *kv_write(subjects.LEASES_BUCKET),  # --ha: one active replica (zmlcore.runtime.lease)
               f"{subjects.KV_EVENTS_PREFIX}.>"]  # engines' KV-cache events, bridged (zml_health.kvbridge)
        sub = [inbox, f"{subjects.ADMIN_NODES_PREFIX}.*", completed, subjects.event(subjects.EVENT_WARMUP)]
        return pub, sub, True
    if role == "warmup":
        pub = [subjects.event(subjects.EVENT_WARMUP), subjects.event(subjects.EVENT_PLACEMENT),
               *kv_read(subjects.NODES_BUCKET), *kv_read(subjects.REGISTRY_BUCKET), *kv_write(subjects.LEASES_BUCKET)]
        sub = [inbox, completed, subjects.WARMUP_SERVE, subjects.WARMUP_PLAN]
        return pub, sub, True
    if role == "batch":  # batch runners: lines go to the routers like any client's requests
        pub = [subjects.INFER, own_cancel, upload, subjects.BATCH_EVENTS, *kv_write(subjects.BATCH_INDEX_BUCKET),
               *_batch_files(), *_batch_streams(), *_batch_runner(),
               # API keys' plans count their batches' tokens (zmlcore.access)
               *kv_read(subjects.KEYS_BUCKET), *kv_write(subjects.LIMITS_BUCKET)]
        return pub, [inbox, subjects.BATCH_EVENTS], False
    if role == "admin":  # the operator's CLI: zml nodes add/remove/list, zml cost, zml serve, zml keys
        pub = [subjects.INFER, own_cancel, upload, f"{subjects.ADMIN_NODES_PREFIX}.*", subjects.ROUTERS_STATE,
               subjects.ROUTERS_DECISION,
               subjects.WARMUP_SERVE, subjects.WARMUP_PLAN, *kv_read(subjects.NODES_BUCKET),
               *kv_read(subjects.REGISTRY_BUCKET), *kv_write(subjects.COSTS_BUCKET), *kv_write(subjects.KEYS_BUCKET)]
        return pub, [inbox], False
    raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")


def permissions(role: str, owner: str) -> dict[str, Any]:
    """nats-server permissions for an identity of ``role`` whose public nkey is ``owner``.

    Everything not allowed is denied; the explicit denies make the intent readable in the
    generated file and hold even if an allow list is widened by mistake.
    """
    pub, sub, responses = _grants(role, owner)
    out: dict[str, Any] = {
        "publish": {"allow": pub},
        # Only the allow list can be subscribed to; the deny names the attack it stops.
        "subscribe": {"allow": sub, "deny": ["_INBOX.>"]},
    }
    if responses:
        out["allow_responses"] = dict(_RESPONSES)
    return out
