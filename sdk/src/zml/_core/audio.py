"""Audio calls, sans-I/O: ``transcribe()`` / ``translate()`` arguments -> OpenAI's multipart form
(zmlcore.messages.audio.encode_form) and an :class:`InferCall` carrying it, and a reply -> a
:class:`~zml.TranscriptionResult` in whichever format was asked for.

The form is built once (the file read into memory: a retry sends the same bytes, and over NATS
a body larger than one message is uploaded in parts), and never carries ZML's routing fields:
they go as headers (``x-zml-*`` over HTTP, ``Zml-*`` over NATS).
"""

from __future__ import annotations

import mimetypes
import os
from collections.abc import Mapping, Sequence
from typing import IO, Any

import msgspec

from zml._core.reply import RawReply, decode_error, int_or, metadata_for, routing_from_headers
from zml._core.request import InferCall, Kind, _policy_to_wire, grace_s, new_request_id
from zml._errors import BackendError, BadRequestError
from zml._models import Policy, Routing, TranscriptionResult, Usage
from zmlcore import subjects
from zmlcore.messages.audio import FORMATS, TEXT_TOKENS_PER_S, audio_seconds, encode_form

__all__ = ["AUDIO_DEFAULTS", "AudioFile", "build_audio", "decode_transcription", "read_audio"]

#: A path, the audio's bytes, a binary file, or (filename, bytes).
AudioFile = str | os.PathLike[str] | bytes | IO[bytes] | tuple[str, bytes]
#: Of ``default_request_kwargs``, what applies to audio calls (not max_tokens, temperature...).
AUDIO_DEFAULTS = ("policy", "routing", "accelerator_id", "timeout", "timeout_ms", "language")
#: Call arguments that are ZML's (headers), not form fields.
_ZML_KEYS = ("policy", "routing", "accelerator_id", "request_id", "timeout", "timeout_ms", "session")


def read_audio(file: AudioFile) -> tuple[str, bytes]:
    """(filename, bytes) of ``file``; BadRequestError when it cannot be read."""
    if isinstance(file, tuple):
        name, content = file
        return str(name), bytes(content)
    if isinstance(file, (bytes, bytearray, memoryview)):
        return "audio", bytes(file)
    if isinstance(file, (str, os.PathLike)):
        try:
            with open(file, "rb") as fh:
                return os.path.basename(os.fspath(file)), fh.read()
        except OSError as exc:
            raise BadRequestError(f"cannot read the audio file {os.fspath(file)!r}: {exc.strerror or exc}") from exc
    read = getattr(file, "read", None)
    if not callable(read):
        raise BadRequestError(f"file must be a path, bytes or a binary file, not {type(file).__name__}")
    content = read()
    if not isinstance(content, (bytes, bytearray)):
        raise BadRequestError("file must be opened in binary mode ('rb')")
    return os.path.basename(str(getattr(file, "name", "audio"))), bytes(content)


def _field_values(name: str, value: Any) -> list[tuple[str, str]]:
    """A form field (lists repeat as ``name[]``, as OpenAI's clients send them)."""
    if isinstance(value, bool):
        return [(name, "true" if value else "false")]
    if isinstance(value, (list, tuple)):
        key = name if name.endswith("[]") else f"{name}[]"
        return [(key, str(v)) for v in value]
    if isinstance(value, Mapping):
        return [(name, msgspec.json.encode(dict(value)).decode())]
    return [(name, str(value))]


def build_audio(
    *,
    task: Kind,
    file: AudioFile,
    model: str | None,
    response_format: str | None = None,
    language: str | None = None,
    prompt: str | None = None,
    temperature: float | None = None,
    timestamp_granularities: Sequence[str] | None = None,
    stream: bool = False,
    routing: str | None = None,
    policy: str | Policy | Mapping[str, Any] | None = None,
    accelerator_id: str | None = None,
    defaults: Mapping[str, Any] | None = None,
    extra: Mapping[str, Any] | None = None,
    client_timeout_s: float = 30.0,
) -> InferCall:
    """The call of one transcription (``task="transcription"``) or translation: the form
    (``file``, ``model``, the OpenAI fields given, ``extra``'s other OpenAI fields) and ZML's
    routing fields (``routing``/``policy``, ``accelerator_id``, and ``extra``'s ``timeout``,
    ``request_id``, ``session``) beside it."""
    merged: dict[str, Any] = {k: v for k, v in (defaults or {}).items() if k in AUDIO_DEFAULTS}
    merged.update(extra or {})
    explicit = {"model": model, "response_format": response_format, "language": language, "prompt": prompt,
                "temperature": temperature, "routing": routing, "policy": policy, "accelerator_id": accelerator_id,
                "timestamp_granularities": list(timestamp_granularities) if timestamp_granularities else None}
    merged.update({k: v for k, v in explicit.items() if v is not None})
    if not merged.get("model"):
        raise BadRequestError("model is required (pass model=... or set it on the client)")
    fmt = str(merged.get("response_format") or "json")
    if fmt not in FORMATS:
        raise BadRequestError(f"response_format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    zml = {k: merged.pop(k) for k in _ZML_KEYS if k in merged}
    timeout = zml.pop("timeout", None)
    timeout_s = float(timeout) if timeout is not None else client_timeout_s
    asked_id = zml.pop("request_id", None)
    request_id = str(asked_id or new_request_id())
    session = zml.pop("session", None)
    filename, content = read_audio(file)
    if not content:
        raise BadRequestError("the audio file is empty")
    model_name = str(merged.pop("model"))
    fields: list[tuple[str, str]] = [("model", model_name)]
    if stream:
        merged["stream"] = True
    for name, value in merged.items():
        if value is not None:
            fields += _field_values(name, value)
    ctype = mimetypes.guess_type(filename)[0] or "application/octet-stream"
    body, form_type = encode_form(fields, filename, content, ctype)
    _policy_to_wire(zml)
    zml["model"], zml["request_id"] = model_name, request_id
    zml.setdefault("timeout_ms", max(1, int(timeout_s * 1000)))
    server_timeout_s = zml["timeout_ms"] / 1000.0
    est = max(1, round(audio_seconds(content) * TEXT_TOKENS_PER_S))  # the rate limiter's guess
    return InferCall(body=zml, kind=task, request_id=request_id, id_generated=not asked_id,
                     timeout_s=server_timeout_s + grace_s(server_timeout_s), response_format=fmt, est_tokens=est,
                     stream=stream, session=session, content=body, content_type=form_type)


def _usage(d: Any) -> tuple[Usage, float | None]:
    """OpenAI's audio ``usage``: tokens (``type: tokens``) or seconds (``type: duration``)."""
    if not isinstance(d, Mapping):
        return Usage(), None
    if d.get("type") == "duration":
        seconds = d.get("seconds")
        return Usage(), float(seconds) if isinstance(seconds, (int, float)) else None
    p, c = int_or(d.get("input_tokens")), int_or(d.get("output_tokens"))
    return Usage(prompt_tokens=p, completion_tokens=c, total_tokens=int_or(d.get("total_tokens"), p + c)), None


def decode_transcription(raw: RawReply, call: InferCall) -> TranscriptionResult:
    """The result of an audio reply in any format; raises the ZMLError of an error reply."""
    if raw.status >= 400:
        raise decode_error(raw)
    ctype = raw.headers.get(subjects.H_CONTENT_TYPE.lower()) or raw.headers.get("content-type", "")
    routing = routing_from_headers(raw.headers) or Routing()
    fmt = str(call.response_format or "json")
    model = str(call.body.get("model", ""))
    if fmt in ("json", "verbose_json", "diarized_json") or ctype.startswith("application/json"):
        try:
            data = msgspec.json.decode(raw.body)
        except msgspec.DecodeError as exc:
            raise BackendError(f"reply is not JSON: {raw.body[:200]!r}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("text"), str):
            raise BackendError(f"reply has no text: {raw.body[:200]!r}")
        usage, seconds = _usage(data.get("usage"))
        duration = data.get("duration")
        segments, words = data.get("segments"), data.get("words")
        return TranscriptionResult(
            text=data["text"], routing=routing, metadata=metadata_for(routing, usage, None), response_format=fmt,
            usage=usage, language=data.get("language") if isinstance(data.get("language"), str) else None,
            duration=float(duration) if isinstance(duration, (int, float)) else seconds,
            segments=[s for s in segments if isinstance(s, dict)] if isinstance(segments, list) else [],
            words=[w for w in words if isinstance(w, dict)] if isinstance(words, list) else [],
            content_type=ctype, model=model, raw=data)
    text = raw.body.decode("utf-8", "replace")
    return TranscriptionResult(text=text.rstrip("\n") if fmt == "text" else text, routing=routing,
                               metadata=metadata_for(routing, Usage(), None), response_format=fmt,
                               content_type=ctype, model=model, raw=text)
