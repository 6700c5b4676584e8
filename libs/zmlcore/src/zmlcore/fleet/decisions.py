"""Look a routing decision up by its id, and say it in words: what ``zml why ID`` prints and
``GET /v1/decisions/{id}`` answers. Every router replica listens on
``zml.admin.routers.decision`` and only the one that made the decision answers
(zml_router.telemetry.decisions); silence means none remembers it.

    record = await lookup_decision(nc, "3f9c0a12d4e5b6a7")
    print("\\n".join(explain(record, time.time())))
"""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from zmlcore import subjects
from zmlcore.errors import BadRequestError, ConnectionError, NotFoundError
from zmlcore.messages import DecisionQuery, DecisionRecord, decision_record_decoder

#: How long the replicas get to find it (a dict lookup each; the rest is the round trip).
ASK_S = 2.0


async def lookup_decision(nc: NATS, decision_id: str, *, timeout: float = ASK_S) -> DecisionRecord:
    """The replica's record of ``decision_id``; NotFoundError when no replica remembers it."""
    decision_id = decision_id.strip()
    if not decision_id or len(decision_id) > 64 or not decision_id.isalnum():
        raise BadRequestError(f"{decision_id[:64]!r} is not a decision id (hex, as in x-zml-decision-id)")
    query = msgspec.json.encode(DecisionQuery(decision_id=decision_id))
    try:
        msg = await nc.request(subjects.ROUTERS_DECISION, query, timeout=timeout)
    except NoRespondersError:
        raise ConnectionError("no router is running to ask about decisions") from None
    except NatsTimeoutError:
        raise NotFoundError(
            f"no router remembers decision {decision_id}: each keeps its last few thousand decisions, "
            "and one that restarted keeps none of before") from None
    return decision_record_decoder.decode(msg.data)


def _age(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def explain(r: DecisionRecord, now: float | None = None) -> list[str]:
    """The record as lines a person reads: what was chosen, what the router believed, what happened."""
    now = time.time() if now is None else now
    stamp = time.strftime("%H:%M:%S", time.localtime(r.at))
    lines = [
        f"decision {r.decision_id} by router {r.router_id} at {stamp} ({_age(max(0.0, now - r.at))} ago)",
        f"request  {r.request_id or '-'}  model {r.model}  policy {r.policy}  attempt {r.attempt}",
        f"node     {r.node_id} ({r.accelerator_type}, {r.family}), {r.queue_depth} in flight when chosen",
    ]
    if r.prefill_tps or r.decode_tps:
        source = r.speeds_source or "unknown source"
        if r.speeds_at:
            source += f", {_age(max(0.0, r.at - r.speeds_at))} old when read"
        if r.speeds_confidence:
            source += f", confidence {r.speeds_confidence:.2f}"
        lines.append(f"believed {r.prefill_tps:,.0f} prompt tokens/s, {r.decode_tps:,.1f} output tokens/s ({source})")
    belief = f"estimated TTFT {r.estimated_ttft_s:.3f} s"
    if r.cached_tokens_estimated:
        belief += f", {r.cached_tokens_estimated} prompt tokens believed cached there"
    if r.session:
        belief += f", session {r.session}"
    lines.append(f"         {belief}")
    if r.evaluated:
        parts = []
        for e in r.evaluated:
            part = f"{e.family}: {e.nodes_checked} node{'s' if e.nodes_checked != 1 else ''}"
            if e.rejected_reason:
                part += f" (not taken: {e.rejected_reason})"
            parts.append(part)
        lines.append(f"evaluated {'; '.join(parts)}")
    outcome = r.outcome
    if r.outcome == "failed":
        outcome += f" ({r.error_code})"
    elif r.outcome == "moved":
        outcome += " (a later attempt of the request went to another node)"
    if r.time_to_first_token is not None:
        outcome += f", TTFT {r.time_to_first_token:.3f} s (estimated {r.estimated_ttft_s:.3f} s)"
    lines.append(f"outcome  {outcome}")
    return lines
