"""One attempt on a node with the node's answer relayed to the requester (:class:`Relay`: the
HTTP call with the body the node gets, then one message, or start / chunk... / end). The pure
parts (bodies, deadlines, failures, the reply's bytes) are ``zml_router.node.attempt``;
continuing an answer whose node failed part-way (the continuation's body, the splice, what was
sent) is ``zml_router.answer.continuation``; what the requester has been sent across the attempts
of one request is an ``zml_router.answer.record.Answer``, and what it receives goes out through
``zml_router.answer.replies.Replies``.

An attempt that fails raises :class:`~zml_router.node.attempt.AttemptError`; the request flow
(``zml_router.request``) decides what follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from random import getrandbits
from typing import Any

import msgspec
from zmlcore import subjects
from zmlcore.config import ZMLConfig
from zmlcore.messages import InferRequest, NodeState, RoutingInfo, StreamStart
from zmlcore.messages.audio import AudioRequest
from zmlcore.policy import RouteRequest, is_routable
from zmlcore.policy.estimate import MEAN_PROMPT_TOKENS
from zmlcore.reply import routingmeta, streamframe
from zmlcore.reply.bigreply import accepted
from zmlcore.reply.cachedtokens import cached_tokens, engine_speeds
from zmlcore.reply.parts import publish_reply
from zmlcore.reply.sse import SSELineTooLong
from zmlcore.telemetry import tracing
from zmlcore.telemetry.setup import DECISION_ID

from zml_router.answer import assemble, continuation
from zml_router.answer.assemble import Assembler, EngineFailed, MalformedStream
from zml_router.answer.continuation import Splice, engine_error, spliced_usage
from zml_router.answer.record import Answer, answer_for
from zml_router.answer.replies import Replies
from zml_router.incoming import Incoming, QueuedMsg
from zml_router.node.attempt import (
    AttemptError,
    AudioBodies,
    Failure,
    NodeBodies,
    AtDispatch,
    Learned,
    Renamer,
    at_dispatch,
    first_byte_timeout,
    speed_sample,
    pending_window_s,
    reply_usage,
    routing_headers,
    stream_usage,
    with_routing,
)
from zml_router.node.dispatch import (
    NodeClient,
    post,
    post_streamed,
    stream_sse,
)
from zml_router.node import legs
from zml_router.node import lora as node_lora
from zml_router.node.pending import PendingHold
from zml_router.replicas.promptscale import PROMPT_SCALE
from zml_router.node.result import PATHS, AttemptResult, Close, Dispatch, Handoff
from zml_router.outcome import Outcome
from zml_router.replicas.inflight import Sharing
from zml_router.telemetry.decisions import DecisionLog
from zml_router.telemetry import tracing as rtrace
from zml_router.replicas.table import NodeTable
from zml_router.telemetry.metrics import RouterMetrics
from zml_router.timers import Stalled, Wheel

log = logging.getLogger("zml.router")

_encode = msgspec.json.encode
#: Zml-Accept-Stream values that get the node's events relayed as they came.
_RELAYED = (subjects.STREAM_EVENTS, subjects.STREAM_FRAMES)


def _decision_id() -> str:
    """Unique, not secret (it names a decision in logs and traces): no getrandom syscall per attempt."""
    return f"{getrandbits(64):016x}"


#: Relayed chunks kept before they are folded into what was sent (zml_router.answer.continuation): a
#: power of two, checked as a mask of the sequence number.
_FOLD_MASK = 2047
#: How an engine's error event can begin or end (vLLM and SGLang: ``data: {"error": {...}}``;
#: TGI: ``{"error": "...", "error_type": ...}``): only a chunk matching one is read for it
#: (a search of every chunk for ``"error"`` would cost more than the rest of the check), and
#: only a chunk with the byte of one at its place is matched (two byte reads: ~10 ns, where the
#: two tuple matches cost ~80 ns of the ~10 us a relayed chunk costs the router).
_ERROR_HEADS = (b'data: {"error"', b'{"error"')
_ERROR_TAILS = (b"}}\n\n", b"}}")
#: A non-streamed reply asked as a stream: SSE bytes read per byte of the largest reply a
#: requester takes ([nats] max_reply_bytes). A token's event repeats the chunk's envelope (~8x a
#: short token's bytes); the reply put together is checked against the limit itself.
SSE_BYTES_PER_REPLY_BYTE = 8


class Relay:
    def __init__(self, cfg: ZMLConfig, router_id: str, table: NodeTable, sharing: Sharing, timers: Wheel,
                 http: NodeClient, metrics: RouterMetrics, replies: Replies,
                 corrected: Callable[[str, RouteRequest, int, int], None] | None = None) -> None:
        self.cfg = cfg
        #: Told what the engine reported of its prefix cache (the router's index learns it).
        self.corrected = corrected
        self.router_id = router_id
        #: (node, model) -> its learned speeds as attempts use them (Relay.learned)
        self._learned: dict[tuple[str, str], Learned] = {}
        #: node -> prompt tokens sent to it by this router so far (its uncached part as
        #: estimated at dispatch): read at an attempt's dispatch, first token and last, it says
        #: which prompts shared the node with that attempt's prefill and decode (SpeedSample)
        self.fed: dict[str, float] = {}
        self.table = table
        self.sharing = sharing
        self.timers = timers
        self.http = http
        self.metrics = metrics
        self.replies = replies
        #: What ``zml why DECISION_ID`` reads (zml_router.telemetry.decisions).
        self.decisions = DecisionLog(router_id)
        self.api_keys = {n.id: n.api_key for n in cfg.nodes if n.api_key}
        self._move = sharing.move  # bound once: a non-streamed request's PendingHold takes it
        #: Nodes that refused a non-streamed request asked as a stream (400/422: a server that
        #: takes no stream_options) and answered it asked as it came: asked as it came from then on.
        self.whole_only: set[str] = set()

    def answer(self, req: InferRequest | AudioRequest, raw: bytes = b"", model: str = "") -> Answer:
        """The record of one request's answer, kept across its attempts (answer_for, with its
        model's ``stream_from_nodes``)."""
        mc = self.cfg.models.get(model)
        return answer_for(req, raw, mc is None or mc.stream_from_nodes)

    async def prefill(self, req: InferRequest, bodies: NodeBodies, model: str, action: Any, request_id: str,
                      out: Outcome) -> Handoff | AttemptError:
        """A split request's prefill leg on ``action.decision.prefill_node`` (zml_router.node.legs):
        the Handoff for its decode leg, or how it failed. Counted on the prefill node while it
        runs, bounded by the request's deadline and [disaggregation] prefill_timeout_s."""
        node_id = action.decision.prefill_node
        view = self.table.views.get(node_id)
        if view is None:
            return AttemptError(Failure.NETWORK, 0, f"prefill node {node_id} is gone")
        st = view.state
        served = st.served_names.get(model)
        info = RoutingInfo(node_id=node_id, request_id=request_id, router_id=self.router_id, label=out.label,
                           decision_id=_decision_id())
        with rtrace.prefill_leg(node_id, action.decision.node_id) if tracing.ON else contextlib.nullcontext():
            headers = self._headers(info)  # (the prefill span's context goes to the node)
            self.sharing.move(node_id, 1, 1)
            err: AttemptError | None = None
            handoff: Handoff | None = None
            try:
                async with asyncio.timeout(self.cfg.disaggregation.prefill_timeout_s):
                    handoff = await legs.run_prefill(self.http, st.backend, st.endpoint, PATHS[req.kind()],
                                                     bodies(served or model), headers, node_id,
                                                     f"{request_id}-{info.decision_id}", st.kv_bootstrap_port)
            except AttemptError as exc:
                err = exc
            except TimeoutError:
                err = AttemptError(Failure.SLOW, 0, f"no prefill within {self.cfg.disaggregation.prefill_timeout_s:g} "
                                   "s ([disaggregation] prefill_timeout_s)")
            finally:
                if handoff is None or handoff.running is None:
                    self.sharing.move(node_id, -1, -1)
        if handoff is not None and handoff.running is not None:  # SGLang: it runs beside the decode leg
            handoff.running.add_done_callback(lambda t: self._leg_done(node_id, t))
            return handoff
        self.metrics.prefill_leg(node_id, "ok" if err is None else err.failure.value)
        if err is not None:
            if tracing.ON:
                rtrace.prefill_failed(f"{node_id}:{err.failure.value}")
            return err
        assert handoff is not None
        return handoff

    def _leg_done(self, node_id: str, task: asyncio.Future[Any]) -> None:
        """A prefill leg that ran beside its decode leg (SGLang) ended."""
        self.sharing.move(node_id, -1, -1)
        exc = None if task.cancelled() else task.exception()
        self.metrics.prefill_leg(node_id, "cancelled" if task.cancelled() else "ok" if exc is None else
                                 exc.failure.value if isinstance(exc, AttemptError) else "network")

    async def attempt(self, msg: Incoming, req: InferRequest, bodies: NodeBodies | AudioBodies, model: str,
                      action: Dispatch, request_id: str, t0: float, out: Outcome,
                      answer: Answer | None = None) -> AttemptResult:
        """One attempt on the decided node, executed as ``action`` says; how it went (its routing
        metadata, the node's token counts, or how it failed). A continuation attempt
        (``action.continuation``) asks the node for the rest of what ``answer`` has sent
        (zml_router.answer.continuation; never an audio request: its body is no prompt to
        continue); ``action.whole`` asks it as the caller asked, not as a stream to put together.
        ``out`` is read (the label, a failed prefill leg; the decision log keeps it to say later
        what became of the decision), never written: the request's ``route`` writes it."""
        decision = action.decision
        view = self.table.views[decision.node_id]
        st = view.state
        rr = action.rr
        pend = view.effective_pending()
        sp = self.learned(decision.node_id, st, model)
        disp = at_dispatch(sp, view.effective_outstanding(), pend,
                           view.effective_pending_tokens(MEAN_PROMPT_TOKENS) if pend else None,
                           rr.prompt_tokens, decision.cached_tokens or 0, time.monotonic())
        fed = self.fed
        disp.fed = fed[decision.node_id] = fed.get(decision.node_id, 0.0) + disp.uncached
        info = RoutingInfo(
            node_id=decision.node_id, accelerator_type=view.state.accelerator_type, family=decision.family,
            policy=decision.policy, queue_depth_at_dispatch=decision.queue_depth, decision_id=_decision_id(),
            request_id=request_id, attempts=action.attempt, router_id=self.router_id, label=out.label,
            continued_from=action.continued_from,
            cached_tokens_estimated=decision.cached_tokens,
            prefill_failed=out.prefill_failed,
            # what the node's learned speeds predicted (docs/routing.md "Learned speeds")
            # rounded to 0.1 / 0.01 ms without round() (~0.3 us each on this path)
            predicted_ttft_ms=int(disp.predicted_ttft_s * 10_000.0 + 0.5) / 10,
            predicted_tpot_ms=int(sp.gap_s(disp.inflight - 1) * 100_000.0 + 0.5) / 100,
        )
        if out.flow is not None:  # band, share, targets and predictions (zml_router.request.flowgate)
            out.flow.fill(info)
        handoff = action.handoff
        if handoff is not None:
            info.prefill_node = handoff.prefill_node
            info.prefill_ms = round(handoff.prefill_ms, 3) if handoff.running is None else None
        running = handoff.running if handoff is not None else None
        if answer is None:
            answer = self.answer(req)
        before = (answer.started, answer.seq)
        if running is None:
            return self._sampled(await self._attempt(msg, req, bodies, model, action, out, answer, info, view,
                                                     decision, handoff, t0), disp, answer, before, action, t0)
        try:
            result = await self._attempt(msg, req, bodies, model, action, out, answer, info, view, decision,
                                         handoff, t0)
        except BaseException:  # cancelled (the caller went away, the deadline): so is the prefill leg
            running.cancel()
            raise
        if not running.done():
            # the decode leg ended: the prefill leg's reply is not the answer; a moment to finish
            # its side of the transfer, then it is let go
            try:
                await asyncio.wait_for(asyncio.shield(running), 2.0)
            except Exception:
                running.cancel()
        return result  # a split's decode leg: its TTFT is the prefill leg's, no sample of this node

    def _sampled(self, result: AttemptResult, disp: AtDispatch, answer: Answer, before: tuple[bool, int],
                 action: Dispatch, t0: float) -> AttemptResult:
        """An answered attempt whose first token was the answer's: a sample of its node's speeds
        for the health service's learner, and its TTFT against the one predicted."""
        if result.error is not None or answer.ttft is None or before[0] or action.continuation \
                or action.handoff is not None:  # a decode leg's first token came after another node's prefill
            return result
        usage = result.usage or {}
        tokens = int(usage.get("completion_tokens") or 0) or (answer.seq - before[1] if action.stream else 0)
        prompt = int(usage.get("prompt_tokens") or 0)
        if prompt and action.rr is not None:
            PROMPT_SCALE.observe(action.rr.model, action.rr.prompt_tokens, prompt)
        info = result.info
        result.sample = speed_sample(disp, t0 + answer.ttft, time.monotonic(), tokens, prompt or None,
                                     info.cached_tokens if info is not None else None,
                                     engine_speeds(answer.timings) if answer.timings is not None else (0.0, 0.0),
                                     answer.fed, self.fed.get(action.decision.node_id, 0.0),
                                     loaded_adapter=action.decision.adapter_load_s > 0)
        self.metrics.predicted(action.decision.node_id, disp.predicted_ttft_s, result.sample.ttft_s)
        return result

    async def _attempt(self, msg: Incoming, req: InferRequest, bodies: NodeBodies | AudioBodies, model: str,
                       action: Dispatch, out: Outcome, answer: Answer | None, info: RoutingInfo, view: Any,
                       decision: Any, handoff: Handoff | None, t0: float) -> AttemptResult:
        if answer is None:
            answer = self.answer(req)
        if answer.started:
            info.time_to_first_token = answer.ttft  # the answer's first token, not this attempt's
        DECISION_ID.set(info.decision_id)
        self.decisions.remember(info, decision, view.state, model, action.attempt, out)
        served = view.state.served_names.get(model)
        lora = None
        if view.state.lora_count and isinstance(bodies, NodeBodies):  # llama.cpp adapters: by id
            adapter = self.cfg.adapters.get(model)
            served, lora = node_lora.for_node(view.state, model, adapter.base if adapter is not None else None)
        audio = isinstance(req, AudioRequest)
        if answer.assembler is not None and not action.continuation and (
                action.whole or decision.node_id in self.whole_only):
            answer.assembler = None
            answer.ttft = None
        asm = answer.assembler
        if action.continuation and isinstance(bodies, NodeBodies):
            sent = asm.begin_continuation() if asm is not None else answer.sent()
            node_body = continuation.body(bodies.raw, clean=bodies.clean, kind=req.kind(), sent=sent,
                                          backend=view.state.backend, name=served or model,
                                          usage=asm is not None, lora=lora)
            if asm is None:
                answer.splice = Splice(sent, {"node_id": info.node_id, "attempts": action.attempt,
                                              "continued_from": info.continued_from})
        else:
            # llama.cpp's adapters are chat/completion fields; a transcription's form has none
            node_body = bodies(served or model, lora) if isinstance(bodies, NodeBodies) else bodies(served or model)
            if handoff is not None:  # the decode leg: what the prefill leg handed over
                node_body = legs.decode_body(node_body, handoff)
                if handoff.restore:
                    try:
                        await legs.before_decode(self.http, view.state.endpoint, handoff, self._headers(info))
                    except AttemptError as err:
                        self.metrics.failover(decision.node_id, err.failure.value)
                        return AttemptResult(info, err)
            if asm is not None:
                node_body = assemble.as_stream(node_body)
                if asm.touched:  # asked again from scratch: what a failed attempt produced goes
                    answer.assembler = asm = Assembler(asm.kind)
                    answer.ttft = None
            answer.splice = None
        first_byte = self.first_byte_s(decision.node_id, req, action.rr, action.stream or asm is not None)
        load_s = decision.adapter_load_s
        if first_byte is not None and load_s > 0:  # the engine loads the request's adapter first
            first_byte += load_s
        # The engine answers with its own name: the client gets back the name it asked for (an
        # audio answer names no model).
        rename = Renamer(served, req.model) if served and served != req.model and not audio else None
        try:
            stay = self._nowhere_else(decision.node_id, action.rr, action.attempt) if first_byte is not None else None
            if action.stream:
                usage = await self.stream(msg, req, node_body, info, t0, first_byte, rename, action.rr, answer, stay)
            else:
                try:
                    usage = await self.once(msg, req, node_body, info, t0, first_byte, rename, action.rr, answer, stay)
                except AttemptError as err:
                    # Refused as a stream to put together (400/422): the request path may ask it as it came.
                    err.stream_refused = (asm is not None and err.failure is Failure.CLIENT
                                          and err.status in (400, 422) and not action.continuation
                                          and isinstance(bodies, NodeBodies))
                    raise
                if action.whole and decision.node_id not in self.whole_only:
                    # Answered asked as it came: so is every later request to it (a bad request is
                    # refused again, as it should be).
                    self.whole_only.add(decision.node_id)
                    log.warning("node %s refused a non-streamed request asked as a stream and answered it asked "
                                "as it came: its requests are asked as they come from now on", decision.node_id)
        except AttemptError as err:
            self.metrics.failover(decision.node_id, err.failure.value)
            return AttemptResult(info, err)
        return AttemptResult(info, None, usage)

    async def close(self, msg: Incoming, req: InferRequest | AudioRequest, answer: Answer, request_id: str,
                    action: Close, label: str = "", info: RoutingInfo | None = None) -> AttemptResult:
        """End a stream whose requester has the whole answer, only its end lost (its node failed,
        or its router died, after the last token: ``zml_router.request.route.ending``): the chunk
        that ends it unless its finish went out, then the stream's end. ``action.whole``: the
        node's own end, with its attempt's routing metadata (``info``)."""
        if action.whole and info is not None:
            await self.replies.before_last(info.total_tokens or 0)
            await self.replies.publish(msg.reply, _encode(StreamStart(routing=info)),
                                       {subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(answer.seq + 1)})
            return AttemptResult(info)
        node_id, attempts = action.node_id, action.attempts
        sent = answer.sent()
        info = RoutingInfo(node_id=node_id, request_id=request_id, attempts=attempts, router_id=self.router_id,
                           label=label, continued_from=action.continued_from)
        seq = answer.seq
        if not sent.finished:
            log.info("the answer on %s had all its %d tokens, only its end was lost: ended here", node_id,
                     sent.tokens)
            last = continuation.closing_chunk(req.kind(), sent, req.model,
                                              {"node_id": node_id, "attempts": attempts,
                                               "continued_from": info.continued_from, "ended_by": "router"})
            seq += 1
            # in the form the requester reads this stream's chunks in (as Relay.stream sends them)
            accept = (msg.headers or {}).get(subjects.H_ACCEPT_STREAM)
            event = b"data: " + last + b"\n\n"
            if accept == subjects.STREAM_FRAMES:
                await self.replies.publish(msg.reply, streamframe.encode(seq, event), None)
            else:
                data, kind = (event, subjects.STREAM_EVENTS) if accept == subjects.STREAM_EVENTS \
                    else (last, subjects.STREAM_CHUNK)
                await self.replies.publish(msg.reply, data, {subjects.H_STREAM: kind, subjects.H_SEQ: str(seq)})
        answer.seq = seq
        await self.replies.before_last(0)
        await self.replies.publish(msg.reply, _encode(StreamStart(routing=info)),
                                   {subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(seq + 1)})
        return AttemptResult(info)

    def _headers(self, info: RoutingInfo, msg: Incoming | None = None) -> dict[str, str]:
        # An audio request's body is its caller's multipart form, its boundary in the content type.
        ctype = (msg.headers or {}).get(subjects.H_CONTENT_TYPE) if msg is not None else None
        h = {
            "content-type": ctype or "application/json",
            "x-zml-routing": routingmeta.backend_header(info),
            "x-request-id": info.request_id,
        }
        key = self.api_keys.get(info.node_id)
        if key:
            h["authorization"] = f"Bearer {key}"
        self.metrics.dispatching(h, info)  # traceparent of the attempt span, when tracing
        return h

    def first_byte_s(self, node_id: str, req: InferRequest, rr: RouteRequest, stream: bool | None = None) -> float | None:
        """The attempt's first-byte deadline (none for a pinned request: it cannot move):
        ``stream``, the node streams its answer (its first token is due), else the whole reply."""
        view = self.table.views.get(node_id)
        if view is None or req.accelerator_id is not None:
            return None
        rc = self.cfg.router
        expected = self.learned(node_id, view.state, rr.model).expected_s(
            view.outstanding, view.pending, rr.prompt_tokens, rr.max_tokens, req.stream if stream is None else stream)
        return first_byte_timeout(expected, rc.first_byte_floor_s, rc.first_byte_factor)

    def _nowhere_else(self, node_id: str, rr: RouteRequest, attempt: int) -> Callable[[], bool]:
        """Asked at an attempt's first-byte deadline: whether the request has nowhere else to go
        (its last attempt, or no other node may take its model now). Then it waits on for its
        first token, to the request's own deadline: a slow node beats a 502 that says all were.
        Asked only when a deadline comes: the common request pays one closure, no scan of the table."""
        def nowhere() -> bool:
            if attempt >= self.cfg.router.max_attempts:
                return True
            now, stale = time.time(), self.cfg.router.stale_after_s
            return not any(v.node_id != node_id and v.node_id not in rr.exclude
                           and is_routable(v, rr.model, now, stale) is None for v in self.table.views.values())
        return nowhere

    def stall_s(self, node_id: str, model: str) -> float:
        """The attempt's inter-token deadline, from the node's learned speeds (attempt.stall_timeout)."""
        rc = self.cfg.router
        view = self.table.views.get(node_id)
        if view is None:
            return rc.inter_token_timeout_s
        return self.learned(node_id, view.state, model).stall_s(view.effective_outstanding(), rc.inter_token_floor_s,
                                                                rc.inter_token_factor, rc.inter_token_timeout_s)

    def learned(self, node_id: str, st: NodeState, model: str) -> Learned:
        """The node's learned speeds for ``model`` as attempts use them, kept until its state changes."""
        key = (node_id, model)
        sp = self._learned.get(key)
        if sp is None or sp.state is not st:
            if len(self._learned) > 4 * len(self.table.views) + 64:
                self._learned.clear()  # removed nodes, models no longer asked for
            sp = self._learned[key] = Learned(st, model)
        return sp

    def _url(self, info: RoutingInfo, req: InferRequest) -> str:
        return self.table.views[info.node_id].state.endpoint.rstrip("/") + PATHS[req.kind()]

    def _reported(self, info: RoutingInfo, rr: RouteRequest | None, cached: int, prompt: object) -> None:
        """The engine said how many prompt tokens it served from its prefix cache."""
        info.cached_tokens = cached
        prompt_tokens = prompt if isinstance(prompt, int) else 0
        self.metrics.cached(info.node_id, prompt_tokens, info.cached_tokens_estimated, cached)
        if rr is not None and self.corrected is not None:
            self.corrected(info.node_id, rr, cached, prompt_tokens)

    async def once(self, msg: Incoming, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                   first_byte: float | None = None, rename: Renamer | None = None,
                   rr: RouteRequest | None = None, answer: Answer | None = None,
                   stay: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Send the node's reply; returns its token counts (``reply_usage``)."""
        audio = isinstance(req, AudioRequest)
        asm = answer.assembler if answer is not None else None
        if asm is not None:  # asked of the node as a stream: the first token is seen (zml_router.answer.assemble)
            assert answer is not None
            placed = msg.placed if isinstance(msg, QueuedMsg) else None
            raw, counts = await self._assembled(req, body, info, t0, first_byte, rename, answer, asm, placed, stay)
            ctype = "application/json"
        else:
            raw, ctype = await self._whole(req, body, info, first_byte, msg if audio else None,
                                           rr.prompt_tokens if rr is not None and audio else None, stay)
            info.time_to_first_token = time.monotonic() - t0
            counts = None
        usage = reply_usage(raw) if counts is None else counts  # (a reply put together here: known)
        self.metrics.usage_dict(req.kind(), req.model, usage)
        cached = None if audio else cached_tokens(raw)
        if cached is not None:
            self._reported(info, rr, cached, usage.get("prompt_tokens"))
        if rename is not None:
            raw = rename(raw)
        if "total_tokens" in usage:
            info.total_tokens = usage["total_tokens"]
        if info.slo and asm is not None and info.time_to_first_token is not None:
            _slo_outcome(info, usage.get("completion_tokens") or 0, time.monotonic() - t0)
        await self.replies.before_last(info.total_tokens or 0)  # the caller may send again at once
        # Over max_payload: in parts to a requester that collects them (zmlcore.reply.bigreply), else
        # REPLY_TOO_LARGE (raised before anything is sent), never a lost reply.
        nc = self.replies.nc
        if msg.reply and nc is not None:
            if audio:  # the node's bytes as they are: the routing metadata goes in headers only
                await publish_reply(nc, msg.reply, raw, {**routingmeta.nats_headers(info),
                                                         subjects.H_CONTENT_TYPE: ctype}, accepted(msg.headers))
            else:
                await publish_reply(nc, msg.reply, with_routing(raw, info), routing_headers(msg.headers, info),
                                    accepted(msg.headers))
        return usage

    async def _whole(self, req: InferRequest, body: bytes, info: RoutingInfo, first_byte: float | None,
                     msg: Incoming | None = None, prompt_tokens: int | None = None,
                     stay: Callable[[], bool] | None = None) -> tuple[bytes, str]:
        """The node's whole reply and its content type (an audio answer may not be JSON: text,
        SRT, VTT...). ``msg``: an audio request's (its form's content type goes to the node);
        ``prompt_tokens``: its cost, which its bytes do not say."""
        # A non-streamed reply shows no first token: pending ends at the estimated one.
        v = self.table.views[info.node_id]
        hold = PendingHold(self._move, info.node_id,
                           pending_window_s(v.state, v.effective_outstanding(), v.effective_pending(), len(body),
                                            prompt_tokens),
                           self.timers)
        try:
            call = post(self.http, self._url(info, req), body, self._headers(info, msg), self.cfg.nats.max_reply_bytes)
            if first_byte is None:
                return await call
            try:
                with self.timers.deadline(first_byte, stay):  # on the router's timer wheel (zml_router.timers)
                    return await call
            except TimeoutError:  # ours only: the request's own deadline arrives as a cancellation
                raise AttemptError(Failure.SLOW, 0,
                                   f"no reply within the first-byte deadline of {first_byte:.1f} s") from None
        finally:
            hold.close()

    async def _assembled(self, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                         first_byte: float | None, rename: Renamer | None, answer: Answer, asm: Assembler,
                         placed: asyncio.Future[bool] | None = None,
                         stay: Callable[[], bool] | None = None) -> tuple[bytes, dict[str, Any] | None]:
        """A non-streamed request asked of the node as a stream: its first token counted as the
        request's (and as the end of its pending time), the rest gathered and put back together
        as the JSON reply the engine would have sent (zml_router.answer.assemble). A failure after the
        first token carries what the answer holds (``AttemptError.sent``): the flow continues it.
        Returns the reply and its token counts (``reply_usage``'s), or None when the node
        answered whole (they are read from its bytes)."""
        move = self._move  # no I/O and no waiting: no coroutine per count
        node_id = info.node_id
        fed = self.fed
        move(node_id, 1, 1)
        pending = 1
        seen = False  # the first token came
        got: list[bytes] = []

        def first(complete: bool) -> None:
            nonlocal pending, seen
            seen = True
            if answer.ttft is None:
                answer.ttft = time.monotonic() - t0
                answer.fed = fed.get(node_id, 0.0)
            if placed is not None and not placed.done():  # out of the queue: a node has taken it
                placed.set_result(True)
            if not complete:  # the node is still decoding: its pending time ends at the first token
                pending = 0
                move(node_id, 0, -1)
            # (complete: nothing waits before the count below, which ends both at once)

        try:
            try:
                sse = await post_streamed(
                    self.http, self._url(info, req), body, self._headers(info), timers=self.timers,
                    first_byte=first_byte, stall_s=lambda: self.stall_s(node_id, req.model),
                    max_bytes=SSE_BYTES_PER_REPLY_BYTE * self.cfg.nats.max_reply_bytes, first=first,
                    feed=got.append, stay=stay)
            except AttemptError as err:
                if seen and got:  # part of the answer came: it can be continued
                    try:
                        asm.feed(b"".join(got))
                        err.sent = answer.sent()
                    except (MalformedStream, EngineFailed, SSELineTooLong):
                        pass
                raise
            data = got[0] if len(got) == 1 else b"".join(got)
            info.time_to_first_token = answer.ttft
            if not sse:  # the node answered whole (it does not stream): its reply as it is
                return data, None
            try:
                asm.feed(data)
                if not asm.done:
                    cut = AttemptError(Failure.NETWORK, 0, "stream ended without [DONE]")
                    cut.sent = answer.sent()
                    raise cut
                return asm.reply(model=req.model if rename is not None else None), asm.counts()
            except EngineFailed as exc:
                failed = AttemptError(Failure.SERVER, 200, f"the engine failed the request mid-way: {exc}")
                failed.sent = answer.sent()
                raise failed from None
            except (MalformedStream, SSELineTooLong) as exc:
                raise AttemptError(Failure.SERVER, 200, f"stream broken: {exc}") from None
        finally:
            move(node_id, -1, -pending)

    async def stream(self, msg: Incoming, req: InferRequest, body: bytes, info: RoutingInfo, t0: float,
                     first_byte: float | None = None, rename: Renamer | None = None,
                     rr: RouteRequest | None = None, answer: Answer | None = None,
                     stay: Callable[[], bool] | None = None) -> dict[str, Any] | None:
        """Relay the node's stream; returns its last ``usage`` (with include_usage), if any."""
        if answer is None:
            answer = self.answer(req)
        last_usage: dict[str, Any] | None = None
        count, publish, frame = self.sharing.count, self.replies.publish, streamframe.encode
        await count(info.node_id, 1, 1)
        pending = 1
        got = False  # this attempt's first chunk
        seq = answer.seq
        reported: int | None = None
        prompt_seen: object = None
        # Relayed as the node framed it to a requester that writes SSE itself (the gateway);
        # as header-less frames when it asked for them (zmlcore.reply.streamframe).
        accept = (msg.headers or {}).get(subjects.H_ACCEPT_STREAM)
        relay = rename is None and accept in _RELAYED
        frames = relay and accept == subjects.STREAM_FRAMES
        kind = subjects.STREAM_EVENTS if relay else subjects.STREAM_CHUNK
        # What went out, kept for a continuation (read only if this attempt fails).
        transcript = answer.transcript
        transcript.begin(relay)
        keep = transcript.blocks.append
        splice = answer.splice
        # An engine's error event, told by bytes at fixed places before any search: the "e" of
        # a leading {"error" or the "}}" that ends it (in a block of events, or a bare payload).
        err_head, err_tail = (8, -3) if relay else (2, -1)
        # A stall: the sequence number stands still for a whole period (no work per chunk).
        stall_s = self.stall_s(info.node_id, rr.model if rr is not None else req.model)
        watch = self.timers.watch(stall_s, lambda: seq)
        watching = False
        chunks = stream_sse(self.http, self._url(info, req), body, self._headers(info, msg), relay)
        try:
            try:
                wait_first = first_byte
                while True:
                    if wait_first is None:
                        chunk = await anext(chunks, None)
                    else:  # the first token is due within first_byte (on the router's timer wheel)
                        try:
                            with self.timers.deadline(wait_first, stay):
                                chunk = await anext(chunks, None)
                        except TimeoutError:  # ours only: the request's own deadline arrives as a cancellation
                            raise AttemptError(Failure.SLOW, 0, f"no first token within {wait_first:.1f} s") from None
                        wait_first = None
                    if chunk is None:
                        break
                    if not got:
                        got = True
                        pending = 0
                        if isinstance(msg, QueuedMsg) and msg.placed is not None and not msg.placed.done():
                            msg.placed.set_result(True)
                        await count(info.node_id, 0, -1)
                        watch.__enter__()  # the inter-token deadline, from the first token on
                        watching = True
                        if not answer.started:
                            answer.started = True
                            info.time_to_first_token = answer.ttft = time.monotonic() - t0
                            answer.fed = self.fed.get(info.node_id, 0.0)
                            await publish(msg.reply, _encode(StreamStart(routing=info)), {
                                **routing_headers(msg.headers, info), subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
                    if len(chunk) > err_head and (chunk[err_head] == 101 or chunk[err_tail] == 125 == chunk[err_tail - 1]) \
                            and (chunk.startswith(_ERROR_HEADS) or chunk.endswith(_ERROR_TAILS)) \
                            and (failed := engine_error(chunk)) is not None:
                        raise AttemptError(Failure.SERVER, 200, f"the engine failed the request mid-stream: {failed}")
                    usage = stream_usage(chunk)
                    if usage is not None:
                        prompt_seen = usage.get("prompt_tokens")  # the node's own (its prefix cache)
                        if splice is not None:
                            usage = spliced_usage(usage, splice.sent)
                        last_usage = usage
                        info.total_tokens = usage["total_tokens"]
                    if b'"cache' in chunk and (cached := cached_tokens(chunk)) is not None:
                        reported = cached  # the usage chunk, or llama-server's timings on the last chunk
                        if b'_per_second"' in chunk:
                            answer.timings = chunk
                    if rename is not None:
                        chunk = rename(chunk)
                    if splice is not None:  # a continuation: its chunks made part of the one stream
                        chunk = splice.events(chunk) if relay else splice.payload(chunk)
                        if not chunk:
                            continue
                    keep(chunk)
                    seq += 1
                    if not seq & _FOLD_MASK:
                        transcript.fold()  # numbered so that a receiver notices a lost message (zmlcore.reply.streamseq)
                    if frames:
                        await publish(msg.reply, frame(seq, chunk), None)
                    else:
                        await publish(msg.reply, chunk, {subjects.H_STREAM: kind, subjects.H_SEQ: str(seq)})
            except BaseException as exc:
                if watching:
                    watching = False
                    try:
                        watch.__exit__(type(exc), exc, exc.__traceback__)
                    except Stalled:
                        raise AttemptError(Failure.SLOW, 0, f"no token for {stall_s:.2g} s (the node's inter-token "
                                           "deadline: [router] inter_token_*)") from None
                raise
            finally:
                if watching:
                    watch.__exit__(None, None, None)
                await chunks.aclose()  # its connection released now, not when the generator is collected
            if reported is not None:
                self._reported(info, rr, reported, prompt_seen)
            if last_usage is not None:  # once per answer: with continuous usage stats every chunk has one
                self.metrics.usage_dict(req.kind(), req.model, last_usage)
            if not answer.started:  # a stream with no chunk at all
                answer.started = True
                info.time_to_first_token = answer.ttft = time.monotonic() - t0
                await publish(msg.reply, _encode(StreamStart(routing=info)),
                              {**routing_headers(msg.headers, info), subjects.H_STREAM: "start", subjects.H_SEQ: "0"})
            await self.replies.before_last(info.total_tokens or 0)
            await publish(msg.reply, _encode(StreamStart(routing=info)),
                          {subjects.H_STREAM: subjects.STREAM_END, subjects.H_SEQ: str(seq + 1)})
        except AttemptError as err:
            # Before the first token the flow re-dispatches invisibly; after it, it ends the answer
            # if the requester has all of it, continues it on another node where it can
            # (zml_router.answer.continuation), else it cools the node and ends the stream with an error.
            err.mid_stream = answer.started
            if answer.started:  # how the answer ends is the request path's (route.ending)
                err.sent = answer.sent()
                err.usage = last_usage
            raise
        finally:
            answer.seq = seq
            await count(info.node_id, -1, -pending)
        return last_usage


def _slo_outcome(info: RoutingInfo, completion_tokens: int, total_s: float) -> None:
    """A whole reply to a request with latency targets: its measured time per output token and
    whether it met them (flow control, docs/routing.md)."""
    ttft = info.time_to_first_token
    if ttft is None or completion_tokens < 2:
        return
    info.tpot_ms = round((total_s - ttft) / (completion_tokens - 1) * 1000, 2)
    met = ((info.ttft_slo_ms is None or ttft * 1000 <= info.ttft_slo_ms)
           and (info.tpot_slo_ms is None or info.tpot_ms <= info.tpot_slo_ms))
    info.slo = "met" if met else "missed"
