"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's multipart form, routed like
the other inference requests and passed to the node as the caller sent it.

The gateway reads the form (zmlcore.messages.audio: the same checks a router makes of a raw
NATS audio request) but never rewrites it: ``model``, ``stream`` and ``response_format`` are all
it takes from it. The routing fields an OpenAI body carries as JSON come as HTTP headers here:
``x-zml-policy`` (a policy name, or an inline policy as JSON), ``x-zml-accelerator-id``,
``x-zml-request-id``, ``x-zml-timeout-ms`` (and ``x-session-id`` as everywhere). The body is
bounded by ``[defaults] max_audio_bytes`` (413) and the audio bytes this process holds at once
by ``audio_bytes_in_flight`` (503 QUEUE_FULL); one larger than a NATS message goes to its
router in parts (zmlcore.reply.exchange). Then the way is the JSON requests' (the plan, the
request id's claim, one reply or a relayed stream): zml_gateway.infer.handler.

    routes.add("POST", "/v1/audio/transcriptions", AudioRoute(inference, "transcription"))
"""

from __future__ import annotations

import os

from zmlcore import subjects
from zmlcore.errors import QueueFullError
from zmlcore.runtime.bytebudget import ByteBudget
from zmlcore.messages.audio import Task, audio_request, policy_header, read_form
from zmlcore.messages.validate import check_request_id, request_timeout_s
from zml_gateway.access import Caller
from zml_gateway.asgi import Receive, Scope, Send
from zml_gateway.infer.handler import Inference
from zml_gateway.infer.intake import Checked, caller_headers

__all__ = ["AudioRoute"]

#: HTTP request headers that carry an audio request's routing fields (its form is not rewritten).
_POLICY, _ACCELERATOR, _REQUEST_ID, _TIMEOUT = (b"x-zml-policy", b"x-zml-accelerator-id", b"x-zml-request-id",
                                                b"x-zml-timeout-ms")


class AudioRoute:
    def __init__(self, inference: Inference, task: Task) -> None:
        self.inference = inference
        self.cfg = inference.cfg
        self.task = task
        #: The process's audio bytes in flight, shared by its audio routes.
        self.budget: ByteBudget = inference.audio_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.inference.serve(scope, receive, send, self._admitted)

    async def _admitted(self, scope: Scope, receive: Receive, send: Send, caller: Caller) -> None:
        d = self.cfg.defaults
        headers = dict(scope["headers"])
        length = headers.get(b"content-length", b"")
        # What the body may take before it is read: its announced length, else the most it may be.
        held = min(int(length), d.max_audio_bytes) if length.isdigit() else d.max_audio_bytes
        if not self.budget.take(held):
            raise QueueFullError(f"this gateway holds {self.budget.held} bytes of audio, its limit ([defaults] "
                                 "audio_bytes_in_flight): retry shortly", retry_after=1.0)
        try:
            body = await self.inference.intake.read_body(scope, receive, d.max_audio_bytes,
                                                         " ([defaults] max_audio_bytes)")
            self.budget.give(held - len(body))  # what it took, no more, while it is routed
            held = len(body)
            checked, out = self._check(body, headers, caller)
            # An id the caller's SDK made up (x-zml-id-generated) is unique like ours.
            generated = _REQUEST_ID not in headers or headers.get(b"x-zml-id-generated") == b"1"
            await self.inference.run(checked, lambda: (body, caller_headers(out, generated, scope, caller)),
                                     caller, receive, send)
        finally:
            self.budget.give(held)

    def _check(self, body: bytes, headers: dict[bytes, bytes], caller: Caller) -> tuple[Checked, dict[str, str]]:
        """The form read and checked, the caller's key allowed its model, and the NATS headers
        that carry what the form does not."""
        ctype = headers.get(b"content-type", b"").decode("latin-1")
        req = audio_request(read_form(body, ctype), body, self.task)
        d = self.cfg.defaults
        asked_id = headers.get(_REQUEST_ID)
        request_id = check_request_id(asked_id.decode("latin-1")) if asked_id else os.urandom(8).hex()
        timeout_ms = headers.get(_TIMEOUT)
        timeout = request_timeout_s(None, timeout_ms.decode("latin-1") if timeout_ms is not None else None,
                                    d.request_timeout_s, d.max_request_timeout_s)
        out = {subjects.H_REQUEST_ID: request_id, subjects.H_TIMEOUT_MS: str(int(timeout * 1000)),
               subjects.H_AUDIO: self.task, subjects.H_CONTENT_TYPE: ctype}
        policy = headers.get(_POLICY)
        if policy is not None:
            text = policy.decode("utf-8", "replace")
            req.policy = policy_header(text)  # checked here: a bad one is a 400 before it travels
            out[subjects.H_POLICY] = text
        accelerator = headers.get(_ACCELERATOR)
        if accelerator:
            req.accelerator_id = out[subjects.H_ACCELERATOR_ID] = accelerator.decode("latin-1")
        model = self.cfg.resolve_model(req.model)
        self.inference.access.check_model(caller, req.model, model)
        return Checked(req, request_id, timeout, model), out
