"""A simulated node's OpenAI API: chat, completions, embeddings, audio, their errors in the
imitated engine's shape, how an answer is generated and written (whole or streamed); the legs
of a disaggregated request are :mod:`zml_sim.disagg`'s."""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any, cast

import msgspec
from aiohttp import web

from zml_sim import embeddings
from zml_sim.disagg import KVLegs
from zml_sim import transcription
from zml_sim.engine import SimEngine
from zml_sim.engine import SimError
from zml_sim.engine import SimRequest
from zml_sim.engine import continued_prompt
from zml_sim.engine import generated_tokens
from zml_sim.kvhandoff import HandoffError, KVHandoff
from zml_sim.faces.base import MAX_MODEL_LEN
from zml_sim.faces.base import json_response
from zml_sim.faces.base import retry_headers
from zml_sim.nodeview import NodeView
from zml_sim.faces.base import Face
from zml_sim.prefixcache import token_ids
from zmlcore.fleet.perfmodel import estimate_tokens


_json = msgspec.json.Encoder()
_decode = msgspec.json.Decoder()
_json_response = json_response


class _BadRequest(Exception):
    pass


class Inference(KVLegs):
    """The inference routes of :class:`~zml_sim.server.SimNode` (a part of it: the node's state
    is its own, declared here for the type checker)."""

    node_id: str
    host: str
    port: int
    engine: SimEngine
    face: Face
    handoff: KVHandoff
    last_traceparent: str
    #: LoRA adapters loaded at run time (vLLM): name -> path
    adapters: dict[str, str]
    adapter_requests: dict[str, int]
    adapter_load_s: float
    lora_resolver_dir: str | None
    _hung: set[asyncio.Future[None]]

    # ----- errors, engine-shaped ---------------------------------------------------------------

    def error(self, status: int, message: str, kind: str,
               headers: dict[str, str] | None = None) -> web.Response:
        """An error body in the imitated engine's shape. ``kind``: bad_request, not_found,
        overloaded, loading, internal."""
        return self.face.error(status, message, kind, headers)

    def _retry_headers(self, default: float | None = None) -> dict[str, str]:
        return retry_headers(cast(NodeView, self), default)

    async def _overload(self) -> web.Response:
        delay = self.engine.faults.overload_delay_s
        if delay:
            await asyncio.sleep(delay)
        return self.face.overload(cast(NodeView, self))

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
        try:
            self.face.check_request(cast(NodeView, self), body)
        except ValueError as exc:
            raise _BadRequest(str(exc)) from None
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

    async def _resolve_adapter(self, model: str | None) -> None:
        """vLLM's lora_filesystem_resolver: a model the node does not serve, found as an adapter
        of one it does in the cache dir (DIR/NAME/adapter_config.json), is loaded (its load time)
        before the request runs on it."""
        d = self.lora_resolver_dir
        eng = self.engine
        if not d or not model or model in eng.models or model in self.adapters or "/" in model:
            return
        path = os.path.join(d, model)
        try:
            with open(os.path.join(path, "adapter_config.json"), "rb") as f:
                conf = json.loads(f.read())
        except (OSError, ValueError):
            return
        if not isinstance(conf, dict) or conf.get("peft_type") != "LORA" \
                or conf.get("base_model_name_or_path") not in eng.models:
            return
        await asyncio.sleep(self.adapter_load_s / eng.time_scale)
        self.adapters.setdefault(model, path)

    def _served(self, model: str | None) -> str | web.StreamResponse:
        """The model a request runs on (like vLLM: the served one when none is named), or the
        answer refusing it: still loading (503 where the imitated engine says so) or unknown."""
        eng = self.engine
        if model is None:
            if not eng.models:
                return self.loading_error() if eng.loading else self.error(404, "No model is loaded", "not_found")
            return next(iter(eng.models))
        adapter = self.face.adapter_of(cast(NodeView, self), model)
        if adapter is not None and eng.models:
            self.adapter_requests[adapter] = self.adapter_requests.get(adapter, 0) + 1
            return next(iter(eng.models))  # a LoRA runs on the base model
        if model in self.adapters and eng.models:
            return next(iter(eng.models))  # SGLang: a bare adapter name runs the base model, no adapter
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
        await self._resolve_adapter(args["model"])
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

