"""Audio requests (OpenAI's ``/v1/audio/transcriptions`` and ``/translations``): a multipart form
read without being rewritten, and what routing needs of it. Pure: no I/O.

The body is passed to the node as the caller sent it (the gateway and the routers only read
it), so the form is located, not parsed into copies: :func:`read_form` finds each part's byte
span with ``bytes.find`` over the whole body (the gateway and the routers hold it whole, up to
``[defaults] max_audio_bytes``), checks the structure strictly (one ``file`` part, at most
:data:`MAX_PARTS` parts, bounded part headers and fields) and reads three fields: ``model``,
``stream`` and ``response_format``. Every bad body is a :class:`BadRequestError` naming what is
wrong, the same one whichever way it came (HTTP through the gateway, raw NATS to a router).
Hand-written rather than python-multipart's push parser because the spans must be exact (a
renamed ``model`` is spliced into the caller's bytes, :func:`with_model`), which a streaming
parser's callbacks do not give; its ``parse_options_header`` reads the part headers.

    form = read_form(body, content_type)        # BadRequestError if malformed
    req = audio_request(form, body, "transcription")
    node_body = with_model(body, form, "whisper-large-v3")   # the engine's own name

:func:`encode_form` writes such a body (the SDK, tests), and :func:`audio_seconds` reads a WAV
file's duration (the router's cost estimate, the simulated node's transcript).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
from python_multipart.multipart import parse_options_header

from zmlcore import subjects
from zmlcore.errors import BadRequestError
from zmlcore.messages.infer import InferRequest, InlinePolicy, Kind
from zmlcore.messages.validate import MAX_MODEL_NAME, clip

__all__ = ["AUDIO_PATHS", "FORMATS", "AudioForm", "AudioRequest", "Task", "audio_request", "audio_seconds",
           "encode_form", "from_message", "policy_header", "read_form", "task_of", "with_model"]

Task = Literal["transcription", "translation"]
#: The node endpoint of each task (as OpenAI's and every OpenAI-compatible engine's).
AUDIO_PATHS: dict[str, str] = {"transcription": "/v1/audio/transcriptions", "translation": "/v1/audio/translations"}
#: OpenAI's ``response_format`` values for audio.
FORMATS = ("json", "text", "srt", "verbose_json", "vtt", "diarized_json")
#: Most parts in one form (OpenAI's fields, repeated ``timestamp_granularities[]``/``include[]``).
MAX_PARTS = 64
#: Largest header block of one part, and largest value of a field that is not the file.
MAX_PART_HEADERS = 8 * 1024
MAX_FIELD_BYTES = 64 * 1024
#: Longest boundary RFC 2046 allows.
MAX_BOUNDARY = 70
#: Whisper's encoder sees 50 frames per second of audio: the "prompt" a node prefills.
AUDIO_TOKENS_PER_S = 50
#: Text tokens per second of speech, generously (speech is ~2.5 words/s): the decode budget.
TEXT_TOKENS_PER_S = 4
#: Bytes per second assumed for audio that is not a WAV file (16 kHz 8-bit mono; 128 kbit/s MP3).
FALLBACK_BYTES_PER_S = 16_000

_TRUE, _FALSE = ("true", "1"), ("false", "0")


@dataclass(frozen=True, slots=True)
class AudioForm:
    """Where the parts of an audio form are in its body, and the fields routing reads."""

    model: str
    #: ``body[start:end]`` is the ``model`` field's value (spliced by :func:`with_model`).
    model_span: tuple[int, int]
    file_span: tuple[int, int]
    filename: str
    response_format: str = "json"
    stream: bool = False
    #: The other fields' names, in order (what was sent; not their values).
    names: tuple[str, ...] = ()


def _boundary(content_type: str) -> bytes:
    ctype, params = parse_options_header(content_type)
    boundary = params.get(b"boundary", b"")
    if ctype != b"multipart/form-data" or not boundary:
        raise BadRequestError(f"expected a multipart/form-data body with a boundary (OpenAI's audio API), got "
                              f"content-type {clip(content_type, 80)}")
    if len(boundary) > MAX_BOUNDARY or any(b < 0x20 or b > 0x7E for b in boundary):
        raise BadRequestError(f"multipart boundary must be 1-{MAX_BOUNDARY} printable ASCII characters")
    return boundary


def read_form(body: bytes, content_type: str) -> AudioForm:
    """Locate the parts of ``body`` (multipart/form-data, ``content_type`` its header) and read
    ``model``, ``stream`` and ``response_format``; BadRequestError for anything malformed."""
    delim = b"--" + _boundary(content_type)
    first = body.find(delim)
    if first < 0 or (first > 0 and body[first - 2:first] != b"\r\n"):
        raise BadRequestError("malformed multipart body: its boundary never starts a line (is the content-type's "
                              "boundary the one the body uses?)", param="file")
    pos = first + len(delim)
    fields: dict[str, tuple[int, int]] = {}
    names: list[str] = []
    file_span: tuple[int, int] | None = None
    filename = ""
    parts = 0
    sep = b"\r\n" + delim
    while True:
        if body.startswith(b"--", pos):
            break  # the close delimiter: what follows is epilogue
        eol = body.find(b"\r\n", pos)
        if eol < 0 or body[pos:eol].strip(b" \t"):
            raise BadRequestError("malformed multipart body: a boundary line has trailing data or no line end")
        parts += 1
        if parts > MAX_PARTS:
            raise BadRequestError(f"more than {MAX_PARTS} form fields")
        head_start = eol + 2
        head_end = body.find(b"\r\n\r\n", head_start, head_start + MAX_PART_HEADERS + 4)
        if head_end < 0:
            if body.startswith(b"\r\n", head_start):  # a part with no headers at all
                raise BadRequestError("malformed multipart body: a part without Content-Disposition")
            raise BadRequestError(f"malformed multipart body: a part's headers are unterminated or over "
                                  f"{MAX_PART_HEADERS} bytes")
        name, part_filename = _disposition(body[head_start:head_end])
        start = head_end + 4
        end = body.find(sep, start)
        if end < 0:
            raise BadRequestError("malformed multipart body: it ends inside a part (no closing boundary)")
        if name == "file":
            if file_span is not None:
                raise BadRequestError("more than one `file` part: one audio file per request", param="file")
            file_span, filename = (start, end), part_filename or "audio"
        else:
            if end - start > MAX_FIELD_BYTES:
                raise BadRequestError(f"form field {clip(name, 40)} is longer than {MAX_FIELD_BYTES} bytes", param=name)
            if name in ("model", "stream", "response_format"):
                if name in fields:
                    raise BadRequestError(f"the form has `{name}` twice", param=name)
                fields[name] = (start, end)
            names.append(name)
        pos = end + len(sep)
    if file_span is None:
        raise BadRequestError("no `file` part: send the audio as the form's `file` field", param="file")
    if file_span[0] == file_span[1]:
        raise BadRequestError("the audio file is empty", param="file")
    model_span = fields.get("model")
    model = _text(body, model_span, "model").strip() if model_span else ""
    if not model:
        raise BadRequestError("`model` is required", param="model")
    if len(model) > MAX_MODEL_NAME or not model.isprintable():
        raise BadRequestError(f"model must be 1-{MAX_MODEL_NAME} printable characters: {clip(model, 60)}",
                              param="model")
    assert model_span is not None
    fmt = _text(body, fields["response_format"], "response_format").strip() if "response_format" in fields else "json"
    if fmt not in FORMATS:
        raise BadRequestError(f"response_format must be one of {', '.join(FORMATS)}, got {clip(fmt, 40)}",
                              param="response_format")
    stream = False
    if "stream" in fields:
        text = _text(body, fields["stream"], "stream").strip().lower()
        if text not in _TRUE + _FALSE:
            raise BadRequestError(f"stream must be true or false, got {clip(text, 20)}", param="stream")
        stream = text in _TRUE
    return AudioForm(model=model, model_span=model_span, file_span=file_span, filename=filename,
                     response_format=fmt, stream=stream, names=tuple(names))


def _disposition(head: bytes) -> tuple[str, str]:
    """(name, filename) of a part's Content-Disposition header."""
    disposition = b""
    for line in head.split(b"\r\n"):
        key, colon, value = line.partition(b":")
        if not colon:
            raise BadRequestError("malformed multipart body: a part header line without a colon")
        if key.strip().lower() == b"content-disposition":
            disposition = value.strip()
    kind, params = parse_options_header(disposition)
    name = params.get(b"name")
    if kind != b"form-data" or name is None:
        raise BadRequestError("malformed multipart body: a part without `Content-Disposition: form-data; name=...`")
    filename = params.get(b"filename", b"")
    return name.decode("utf-8", "replace"), filename.decode("utf-8", "replace")


def _text(body: bytes, span: tuple[int, int], name: str) -> str:
    try:
        return body[span[0]:span[1]].decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequestError(f"form field `{name}` is not UTF-8 text", param=name) from None


def with_model(body: bytes, form: AudioForm, name: str) -> bytes:
    """``body`` with its ``model`` field's value replaced by ``name`` (a node's engine name)."""
    start, end = form.model_span
    return body[:start] + name.encode() + body[end:]


class AudioRequest(InferRequest, kw_only=True):
    """An audio request as routing sees it: the model, whether it streams, and the sizes the
    cost estimate needs. The body itself stays the caller's multipart bytes."""

    #: Where its parts are in the body (the model's name is spliced there for a node that knows
    #: the model by another name).
    form: AudioForm | None = None
    task: Task = "transcription"
    response_format: str = "json"
    #: Seconds of audio (a WAV file's header, else estimated from its size).
    audio_seconds: float = 0.0

    def kind(self) -> Kind:
        return self.task

    def audio_tokens(self) -> int:
        """What the node's encoder runs over (the prompt of the TTFT estimate)."""
        return max(1, round(self.audio_seconds * AUDIO_TOKENS_PER_S))


def audio_request(form: AudioForm, body: bytes, task: Task) -> AudioRequest:
    """The request routing sees, with the output budget set from the audio's length."""
    seconds = audio_seconds(memoryview(body)[form.file_span[0]:form.file_span[1]])
    return AudioRequest(model=form.model, stream=form.stream, task=task, response_format=form.response_format,
                        audio_seconds=seconds, max_tokens=max(16, round(seconds * TEXT_TOKENS_PER_S)), form=form)


def task_of(value: str) -> Task:
    """The task a ``Zml-Audio`` header names (BadRequestError for anything else)."""
    if value == "transcription":
        return "transcription"
    if value == "translation":
        return "translation"
    raise BadRequestError(f"{subjects.H_AUDIO} must be transcription or translation, got {clip(value, 40)}")


_policy = msgspec.json.Decoder(str | InlinePolicy)


def policy_header(value: str) -> str | InlinePolicy:
    """A ``Zml-Policy`` header's policy: a JSON string (a policy's name) or an inline policy
    object; a bare name is taken as it is (what an HTTP client writes in ``x-zml-policy``)."""
    text = value.strip()
    if not text.startswith(("{", '"')):
        if not text or len(text) > MAX_MODEL_NAME or not text.isprintable():
            raise BadRequestError(f"policy must be a name or a JSON policy object, got {clip(text, 60)}")
        return text
    try:
        return _policy.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadRequestError(f"invalid policy: {clip(str(exc), 300)[1:-1]}") from None


def from_message(body: bytes, headers: dict[str, str]) -> AudioRequest:
    """An audio request on ``zml.infer`` / the front door (``Zml-Audio``): its form read and
    checked in full, its routing fields from the headers (the form is never rewritten)."""
    task = task_of(headers.get(subjects.H_AUDIO, ""))
    form = read_form(body, headers.get(subjects.H_CONTENT_TYPE, ""))
    req = audio_request(form, body, task)
    pol = headers.get(subjects.H_POLICY)
    if pol is not None:
        req.policy = policy_header(pol)
    req.accelerator_id = headers.get(subjects.H_ACCELERATOR_ID) or None
    return req


def wav_seconds(audio: bytes | memoryview) -> float | None:
    """Seconds of audio in a RIFF/WAVE file (its ``fmt`` byte rate and ``data`` size), or None."""
    if len(audio) < 12 or bytes(audio[:4]) != b"RIFF" or bytes(audio[8:12]) != b"WAVE":
        return None
    pos, byte_rate = 12, 0
    while pos + 8 <= len(audio):
        chunk, size = bytes(audio[pos:pos + 4]), struct.unpack_from("<I", audio, pos + 4)[0]
        if chunk == b"fmt " and size >= 16 and pos + 20 <= len(audio):
            byte_rate = struct.unpack_from("<I", audio, pos + 16)[0]
        elif chunk == b"data":
            size = min(size, len(audio) - pos - 8)  # a streamed WAV may say 0xFFFFFFFF
            return size / byte_rate if byte_rate else None
        pos += 8 + size + (size & 1)
    return None


def audio_seconds(audio: bytes | memoryview) -> float:
    """The audio's duration: a WAV file's own, else its size at :data:`FALLBACK_BYTES_PER_S`."""
    seconds = wav_seconds(audio)
    return round(seconds if seconds is not None else len(audio) / FALLBACK_BYTES_PER_S, 3)


def encode_form(fields: Sequence[tuple[str, str]], filename: str, content: bytes,
                content_type: str = "application/octet-stream", boundary: str | None = None) -> tuple[bytes, str]:
    """A multipart/form-data body with ``fields`` and the ``file`` part, and its content type."""
    b = boundary or f"zml-{os.urandom(12).hex()}"
    out: list[bytes] = []
    for name, value in fields:
        out.append(f'--{b}\r\nContent-Disposition: form-data; name="{_quote(name)}"\r\n\r\n'.encode() + value.encode()
                   + b"\r\n")
    out.append(f'--{b}\r\nContent-Disposition: form-data; name="file"; filename="{_quote(filename)}"\r\n'
               f"Content-Type: {content_type}\r\n\r\n".encode())
    out.append(content)
    out.append(f"\r\n--{b}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={b}"


def _quote(text: str) -> str:
    """A quoted-string's content as browsers write it (WHATWG: CR, LF and quote escaped)."""
    return text.replace("\r", "%0D").replace("\n", "%0A").replace('"', "%22")

