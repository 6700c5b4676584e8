"""A non-streamed request's reply put together from the node's stream (sans-I/O, unit-tested).

The router asks a node for a non-streamed request *streamed* (``stream: true`` and
``stream_options.include_usage``), so that it sees the first token when the engine produces it:
the request's ``time_to_first_token`` is then the first token's (it was the whole reply's), the
first-byte deadline is a first-token deadline, a stall mid-way is noticed (``[router]
inter_token_timeout_s``) and an answer whose node fails part-way is continued on another node
from what it had produced (``zml_router.answer.continuation``). :class:`Assembler` turns the SSE body
back into the JSON reply the engine would have sent: the chunks' ``id``, ``created``, ``model``
and ``system_fingerprint``; per choice the message (``role``, ``content``, ``reasoning_content``,
``tool_calls`` merged by index, ``function_call``, ``refusal``) or completion ``text``, the
``logprobs`` lists joined, the ``finish_reason`` (and vLLM's ``stop_reason``); ``usage``; and
any other top-level field of the last chunks (llama.cpp's ``timings``). Across a continuation
it keeps one answer: the continuation's role is not repeated and its usage counts the whole
answer (``continuation.spliced_usage``).

The bytes are parsed once, at the end (or when the attempt fails): one ``msgspec`` decode of all
the events as one JSON array into typed Structs, or, for a body over a few KB, its run of
content chunks as one array of strings (:meth:`Assembler._run`). Still, reading every token
costs: ~20 us of router CPU for a 16-token reply (and ~13 us the node client's callbacks for
its chunked body), +35% per request at C=64 on a stub node, hence the per-model switch
``[models."<name>"] stream_from_nodes`` (docs/benchmarks.md).
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmlcore.reply.sse import SSELineSplitter, data_field
from zmlcore.reply.transcript import ChunkChoice, ChunkDelta, Sent

from zml_router.answer.continuation import spliced_usage

_encode = msgspec.json.encode
_decode_any = msgspec.json.Decoder()


class _Chunk(msgspec.Struct):
    id: Any = None
    created: Any = None
    model: Any = None
    system_fingerprint: Any = None
    choices: list[ChunkChoice] | None = None
    usage: Any = None
    error: Any = None


_chunks = msgspec.json.Decoder(list[_Chunk])
_chunk = msgspec.json.Decoder(_Chunk)
_top = msgspec.json.Decoder(dict[str, msgspec.Raw])
_DONE_EVENT = b"\n\ndata: [DONE]\n\n"
_SEP = b"\n\ndata: "
_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")
_strings = msgspec.json.Decoder(list[str])
#: Events read one by one, at most, before the run of content chunks (:meth:`Assembler._run`).
_HEAD_EVENTS = 3
#: A body shorter than this is read chunk by chunk: the run's fixed cost (the events around it
#: decoded apart, the template found) is paid back from ~16 tokens on (a few hundred bytes each).
_RUN_MIN_BYTES = 4096
#: Top-level fields of a chunk that the reply has its own way of carrying.
#: (``str | None`` in an isinstance builds a union object at every call: once per chunk.)
_TEXT_OR_NONE = (str, type(None))
_OWN = frozenset(("id", "object", "created", "model", "choices", "usage", "system_fingerprint", "error", "zml"))


class MalformedStream(ValueError):
    """A chunk of the node's stream is not an OpenAI chunk."""


class EngineFailed(RuntimeError):
    """The engine sent its error event mid-stream (vLLM and SGLang do when a request fails)."""


class _ChoiceState:
    __slots__ = ("index", "role", "content", "reasoning", "reasoning_key", "tools", "function_call", "refusal",
                 "logprobs", "finish_reason", "stop_reason")

    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning_content"
        self.tools: dict[int, dict[str, Any]] = {}
        self.function_call: dict[str, Any] | None = None
        self.refusal: list[str] = []
        self.logprobs: Any = None
        self.finish_reason: Any = None
        self.stop_reason: Any = None


class Assembler:
    """A streamed answer's chunks in (:meth:`feed`), the non-streamed reply out (:meth:`reply`).
    ``kind``: ``chat`` or ``completion``."""

    __slots__ = ("kind", "_raw", "_split", "_choices", "_id", "_created", "_model", "_fingerprint",
                 "_usage", "_tail", "_base", "_blocked", "_finished", "_done")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._raw: list[bytes] = []  # fed, not read yet
        self._split: SSELineSplitter | None = None  # once the body is not plain one-line events
        self._choices: dict[int, _ChoiceState] = {}
        self._id: Any = None
        self._created: Any = None
        self._model: Any = None
        self._fingerprint: Any = None
        self._usage: Any = None
        self._tail: list[bytes] = []  # the last payloads: their other top-level fields go in the reply
        self._base: Sent | None = None  # what the answer held when a continuation began
        self._blocked: str | None = None  # why it cannot be continued
        self._finished = False
        self._done = False  # [DONE] came

    # --- input -------------------------------------------------------------------------------
    @property
    def touched(self) -> bool:
        """Something was fed (an attempt got as far as its first token)."""
        return bool(self._raw or self._choices or self._id is not None or self._split is not None)

    def feed(self, body: bytes) -> None:
        """Bytes of the node's SSE body, as they came (read when the reply or what was sent is
        asked for)."""
        self._raw.append(body)

    @property
    def done(self) -> bool:
        """The stream's ``[DONE]`` came (what was fed is read now)."""
        self._read()
        return self._done

    def begin_continuation(self) -> Sent:
        """A continuation takes over: what the answer holds so far (read now), and the
        continuation's chunks are counted on from there (a partial event of the failed attempt
        is dropped)."""
        sent = self.sent()
        self._base = Sent(text=sent.text, tokens=sent.tokens, chunk_id=sent.chunk_id, created=sent.created)
        self._split = None
        self._done = False
        return sent

    def sent(self) -> Sent:
        """What the answer holds so far (the chunks fed are read now)."""
        self._read()
        st = self._choices.get(0)
        pieces = st.content if st is not None else []
        return Sent(text="".join(pieces), tokens=len(pieces),
                    chunk_id=self._id if isinstance(self._id, str) else None,
                    created=self._created if isinstance(self._created, int) else None,
                    finished=self._finished, usage=self._usage is not None, blocked=self._blocked)

    def _payloads(self, body: bytes) -> bytes | list[bytes]:
        """The body's payloads as one JSON array when it has the plain shape every engine sends
        (one-line ``data:`` events: JSON has no raw line end, so ``\\n\\ndata: `` only parts
        events, and one replace joins them; any other line makes the array invalid JSON, and
        :meth:`_read` comes back for the list), else as a list."""
        if self._split is None and body.startswith(b"data: ") and body.endswith(b"\n\n"):
            if body.endswith(_DONE_EVENT):
                end = len(body) - len(_DONE_EVENT)
            elif body == _DONE_EVENT[2:]:
                self._done = True
                return b"[]"
            else:
                end = len(body) - 2
            inner = body[6:end]
            last = inner.rfind(b"\n\ndata: ")
            if last < 0:
                self._tail = [inner]
            else:
                before = inner.rfind(b"\n\ndata: ", 0, last)
                self._tail = [inner[before + 8 if before >= 0 else 0:last], inner[last + 8:]]
            if end != len(body) - 2:
                self._done = True
            return b"[" + b",".join(inner.split(_SEP)) + b"]"  # (one pass: a replace makes two)
        return self._lines(body)

    def _lines(self, body: bytes) -> list[bytes]:
        """The payloads of any SSE body (a line splitter keeps a partial event for the next)."""
        split = self._split = self._split or SSELineSplitter()
        out: list[bytes] = []
        for line in split.feed(body):
            value = data_field(line)
            if value is None:
                continue
            value = value.strip()
            if value == b"[DONE]":
                self._done = True
                break
            if value:
                out.append(value)
        if out:
            self._tail = out[-2:]
        return out

    def _read(self) -> None:
        if not self._raw:
            return
        body = self._raw[0] if len(self._raw) == 1 else b"".join(self._raw)
        self._raw = []
        run = self._run(body) if self._split is None and len(body) >= _RUN_MIN_BYTES else None
        if run is not None:
            head, pieces, tail = run
            self._apply(head)
            self._choices[0].content.extend(filter(None, pieces))  # (the template made choice 0)
            self._apply(tail)
            return
        got = self._payloads(body)
        chunks: list[_Chunk] = []
        if isinstance(got, bytes):
            try:
                chunks = _chunks.decode(got)
                got = []
            except (msgspec.DecodeError, msgspec.ValidationError):
                self._done = False
                got = self._lines(body)  # not plain one-line events after all: line by line
        for p in got:
            try:
                chunks.append(_chunk.decode(p))
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise MalformedStream(f"not an OpenAI chunk: {p[:120]!r}") from None
        self._apply(chunks)

    def _run(self, body: bytes) -> tuple[list[_Chunk], list[str], list[_Chunk]] | None:
        """A whole body read without a Struct per token: the chunks before the run of content
        chunks (the first of the run included), the rest of the run's strings, the chunks after
        it; or None (then :meth:`_read` reads it chunk by chunk). Engines send a run of content chunks that differ only in their
        ``content`` string: the first such chunk (decoded, within the first few events) is the
        template, its bytes before and after the string (``pre``, ``post``); one ``replace`` of
        ``post + "\n\ndata: " + pre`` by a comma turns the run into one event whose middle is
        the strings as a JSON array. A string cannot hold a raw line end, so the pattern only
        matches between events; the array must decode as strings, one per pattern replaced
        (a chunk of another shape inside the run makes it invalid JSON or the count differ)."""
        if not (body.startswith(b"data: ") and body.endswith(_DONE_EVENT)):
            return None  # (a partial body is what a failed attempt leaves: read it the usual way)
        head: list[_Chunk] = []
        pos = 6
        for _ in range(_HEAD_EVENTS):
            end = body.find(_SEP, pos)
            if end < 0:
                return None
            try:
                c = _chunk.decode(body[pos:end])
            except (msgspec.DecodeError, msgspec.ValidationError):
                return None
            head.append(c)
            if _plain(c):
                break
            pos = end + len(_SEP)
        else:
            return None
        event = body[pos:end]
        at = event.find(b'"content":')
        if at < 0 or event.find(b'"content":', at + 10) >= 0:
            return None
        start = at + 10
        while event[start:start + 1] in (b" ", b"\t", b"\r", b"\n"):
            start += 1
        if not event.startswith(b'"', start):
            return None
        stop = start + 1  # past the string's closing quote
        while True:
            stop = event.find(b'"', stop)
            if stop < 0:
                return None
            back = stop - 1
            while event[back] == 92:  # a quote behind an odd number of backslashes is escaped
                back -= 1
            stop += 1
            if (stop - 2 - back) % 2 == 0:
                break
        pre, post = event[:start], event[stop:]
        parts = body[pos:].split(post + _SEP + pre)  # (one pass: a replace makes two)
        if len(parts) < 2 or not parts[0].startswith(pre):
            return None
        last = parts[-1]
        cut = last.find(b"\n\n")
        if cut < 0 or not last.endswith(post, 0, cut) or not last.startswith(b"data: ", cut + 2):
            return None
        parts[0] = parts[0][len(pre):]
        parts[-1] = last[:cut - len(post)]
        try:
            pieces = _strings.decode(b"[" + b",".join(parts) + b"]")
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        if len(pieces) != len(parts):
            return None
        self._tail = []
        after = self._payloads(last[cut + 2:])
        if not isinstance(after, bytes) or len(self._tail) < 2:
            return None
        try:
            tail = _chunks.decode(after)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return head, pieces[1:], tail  # (the template's own string is read with it)

    def _apply(self, chunks: list[_Chunk]) -> None:
        states = self._choices
        st0 = states.get(0)
        for c in chunks:
            chs = c.choices
            # The common chunk (one choice, one piece of text, nothing else): nothing to merge.
            if st0 is not None and chs is not None and len(chs) == 1 and c.usage is None:
                ch = chs[0]
                if ch.index == 0 and ch.finish_reason is None and ch.logprobs is None and ch.stop_reason is None:
                    d = ch.delta
                    if d is None:
                        if isinstance(ch.text, str):
                            if ch.text:
                                st0.content.append(ch.text)
                            continue
                    elif (d.role is None and d.tool_calls is None and d.reasoning_content is None
                          and d.reasoning is None and d.function_call is None and d.refusal is None
                          and isinstance(d.content, _TEXT_OR_NONE)):
                        if d.content:
                            st0.content.append(d.content)
                        continue
            self._chunk(c)
            st0 = states.get(0)

    def _chunk(self, c: _Chunk) -> None:
        """Any chunk, merged field by field."""
        if c.error is not None and not c.choices:
            err = c.error
            raise EngineFailed(str(err.get("message") if isinstance(err, dict) else err)[:300])
        if self._id is None:
            self._id, self._created = c.id, c.created
        if c.model is not None:
            self._model = c.model
        if c.system_fingerprint is not None:
            self._fingerprint = c.system_fingerprint
        if c.usage is not None:
            self._usage = c.usage
        states = self._choices
        for ch in c.choices or ():
            idx = ch.index if isinstance(ch.index, int) else 0
            st = states.get(idx)
            if st is None:
                st = states[idx] = _ChoiceState(idx)
            if idx:
                self._blocked = self._blocked or "several choices (n > 1)"
            d = ch.delta
            piece = ch.text
            if d is not None:
                piece = d.content
                if d.role is not None and st.role is None:
                    st.role = d.role
                if d.reasoning_content or d.reasoning:
                    if d.reasoning and not d.reasoning_content:
                        st.reasoning_key = "reasoning"
                    st.reasoning.append(d.reasoning_content or d.reasoning)
                    self._blocked = self._blocked or "reasoning deltas"
                if d.tool_calls:
                    _merge_tools(st.tools, d.tool_calls)
                    self._blocked = self._blocked or "tool-call deltas"
                if d.function_call:
                    st.function_call = _merge_function(st.function_call, d.function_call)
                    self._blocked = self._blocked or "tool-call deltas"
                if d.refusal:
                    st.refusal.append(d.refusal)
            if isinstance(piece, str) and piece:
                st.content.append(piece)
            if ch.logprobs is not None:
                st.logprobs = _join_logprobs(st.logprobs, ch.logprobs)
                self._blocked = self._blocked or "logprobs"
            if ch.finish_reason is not None:
                st.finish_reason = ch.finish_reason
                self._finished = True
            if ch.stop_reason is not None:
                st.stop_reason = ch.stop_reason

    # --- output ------------------------------------------------------------------------------
    def reply(self, model: str | None = None, extra: dict[str, Any] | None = None) -> bytes:
        """The JSON reply; ``model``: the name the client asked for (else the engine's);
        ``extra``: top-level fields to add (e.g. ``zml`` is spliced in later by the relay)."""
        self._read()
        chat = self.kind == "chat"
        out: dict[str, Any] = {"id": self._id, "object": "chat.completion" if chat else "text_completion",
                               "created": self._created, "model": model or self._model}
        choices = []
        for idx in sorted(self._choices):
            st = self._choices[idx]
            item: dict[str, Any] = {"index": idx}
            if chat:
                msg: dict[str, Any] = {"role": st.role or "assistant",
                                       "content": "".join(st.content) if st.content or not (st.tools or st.function_call)
                                       else None}
                if st.reasoning:
                    msg[st.reasoning_key] = "".join(st.reasoning)
                if st.tools:
                    msg["tool_calls"] = [_tool_out(st.tools[k]) for k in sorted(st.tools)]
                if st.function_call is not None:
                    msg["function_call"] = {k: "".join(v) if isinstance(v, list) else v
                                            for k, v in st.function_call.items()}
                if st.refusal:
                    msg["refusal"] = "".join(st.refusal)
                item["message"] = msg
            else:
                item["text"] = "".join(st.content)
            item["logprobs"] = st.logprobs
            item["finish_reason"] = st.finish_reason
            if st.stop_reason is not None:
                item["stop_reason"] = st.stop_reason
            choices.append(item)
        out["choices"] = choices
        if self._fingerprint is not None:
            out["system_fingerprint"] = self._fingerprint
        usage = self._usage
        if isinstance(usage, dict) and self._base is not None:
            usage = spliced_usage(usage, self._base)
        if usage is not None:
            out["usage"] = usage
        for payload in self._tail:  # e.g. llama.cpp's timings, on its last chunks
            try:
                top = _top.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            for k, v in top.items():
                if k not in _OWN:
                    out[k] = _decode_any.decode(v)
        if extra:
            out.update(extra)
        return _encode(out)

    def counts(self) -> dict[str, Any]:
        """The reply's prompt, completion and total token counts (what ``attempt.reply_usage``
        reads from a reply's bytes), from the usage read: no scan of the reply."""
        usage = self.usage
        if not isinstance(usage, dict):
            return {}
        return {k: v for k in _COUNTS if type(v := usage.get(k)) is int}

    @property
    def usage(self) -> Any:
        """The answer's usage (None until the usage chunk is read)."""
        self._read()
        if isinstance(self._usage, dict) and self._base is not None:
            return spliced_usage(self._usage, self._base)
        return self._usage


def _plain(c: _Chunk) -> bool:
    """A chat chunk that only adds content to choice 0 (what a run of tokens is made of)."""
    chs = c.choices
    if c.usage is not None or c.error is not None or chs is None or len(chs) != 1:
        return False
    ch = chs[0]
    d = ch.delta
    return (ch.index == 0 and ch.finish_reason is None and ch.logprobs is None and ch.stop_reason is None
            and d is not None and isinstance(d.content, str) and d.role is None and d.tool_calls is None
            and d.reasoning_content is None and d.reasoning is None and d.function_call is None
            and d.refusal is None)


def _merge_tools(tools: dict[int, dict[str, Any]], deltas: Any) -> None:
    for d in deltas if isinstance(deltas, list) else ():
        if not isinstance(d, dict):
            continue
        i = d.get("index", len(tools))
        t = tools.setdefault(i if isinstance(i, int) else len(tools), {"function": {"arguments": []}})
        for k, v in d.items():
            if k == "index":
                continue
            if k == "function" and isinstance(v, dict):
                f = t["function"]
                for fk, fv in v.items():
                    if fk == "arguments" and isinstance(fv, str):
                        f["arguments"].append(fv)
                    elif fv is not None:
                        f[fk] = fv
            elif v is not None:
                t[k] = v


def _tool_out(t: dict[str, Any]) -> dict[str, Any]:
    f = dict(t.get("function") or {})
    f["arguments"] = "".join(f.get("arguments") or [])
    out = {k: v for k, v in t.items() if k != "function"}
    out.setdefault("type", "function")
    out["function"] = f
    return out


def _merge_function(acc: dict[str, Any] | None, delta: Any) -> dict[str, Any]:
    acc = acc or {"arguments": []}
    if isinstance(delta, dict):
        for k, v in delta.items():
            if k == "arguments" and isinstance(v, str):
                acc["arguments"].append(v)
            elif v is not None:
                acc[k] = v
    return acc


def _join_logprobs(acc: Any, lp: Any) -> Any:
    """Logprobs of successive chunks as one: each list field joined (chat ``content`` /
    ``refusal``, completions ``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``)."""
    if not isinstance(lp, dict):
        return acc if acc is not None else lp
    if not isinstance(acc, dict):
        return {k: list(v) if isinstance(v, list) else v for k, v in lp.items()}
    for k, v in lp.items():
        if isinstance(v, list):
            acc.setdefault(k, [])
            if isinstance(acc[k], list):
                acc[k].extend(v)
            else:
                acc[k] = list(v)
        elif k not in acc or acc[k] is None:
            acc[k] = v
    return acc


# --- what the node is asked ------------------------------------------------------------------------
#: Parameters an engine answers only without streaming (vLLM: ``best_of``, beam search, prompt
#: logprobs): a request with one of them is asked of the node as it came.
_WHOLE_ONLY = (b'"best_of"', b'"use_beam_search"', b'"prompt_logprobs"')
_STREAM_KEYS = b',"stream":true,"stream_options":{"include_usage":true}}'


def wanted(raw: bytes) -> bool:
    """Whether a non-streamed chat or completion request is asked of the node as a stream (a
    byte search of the body: a false match, a nested key of that name, only costs the first
    token's time)."""
    a, b, c = _WHOLE_ONLY
    return not (a in raw or b in raw or c in raw)  # (no generator per request)


def as_stream(body: bytes) -> bytes:
    """The node's body asking for a stream with its usage chunk. A body with no ``stream`` key
    (what OpenAI clients send for a plain request) gets the two keys appended without being
    decoded; one that has it is decoded and re-encoded.

    >>> as_stream(b'{"model":"m","prompt":"hi"}')
    b'{"model":"m","prompt":"hi","stream":true,"stream_options":{"include_usage":true}}'
    >>> as_stream(b'{"model":"m","stream":false,"stream_options":{"x":1}}')
    b'{"model":"m","stream":true,"stream_options":{"x":1,"include_usage":true}}'
    """
    if b'"stream' not in body:
        end = body.rstrip()
        if end.endswith(b"}"):
            inner = end[1:-1].strip()
            return end[:-1] + (_STREAM_KEYS if inner else _STREAM_KEYS[1:])
    data = _decode_any.decode(body)
    data["stream"] = True
    opts = data.get("stream_options")
    data["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
    return _encode(data)
