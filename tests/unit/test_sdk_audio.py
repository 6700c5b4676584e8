"""The SDK's audio calls, sans-I/O (zml._core.audio): the form built from call arguments and the
routing fields beside it, the headers of both transports, every reply format decoded, and a
streamed transcription's events."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import zml
from wavs import wav
from zml._core import RawReply, build_audio, decode_chunk, decode_transcription
from zmlcore import subjects
from zmlcore.messages.audio import read_form

AUDIO = wav(2.0)


def test_the_form_carries_openais_fields_and_zmls_go_beside_it(tmp_path: Path) -> None:
    (tmp_path / "talk.wav").write_bytes(AUDIO)
    call = build_audio(task="transcription", file=tmp_path / "talk.wav", model="whisper-1", response_format="srt",
                       language="fr", prompt="ZML", temperature=0.2, timestamp_granularities=["word"], stream=True,
                       policy=zml.Policy(name="p", accelerator_chain=["H100"]), accelerator_id="h100-2",
                       defaults={"timeout": 12, "max_tokens": 99, "language": "de"},
                       extra={"request_id": "r-1", "session": "s", "chunking_strategy": "auto", "include": ["logprobs"]})
    assert call.content is not None and call.kind == "transcription" and call.http_path == "/v1/audio/transcriptions"
    form = read_form(call.content, call.content_type)
    assert (form.model, form.response_format, form.stream, form.filename) == ("whisper-1", "srt", True, "talk.wav")
    assert call.content[form.file_span[0]:form.file_span[1]] == AUDIO
    assert set(form.names) == {"model", "response_format", "language", "prompt", "temperature",
                               "timestamp_granularities[]", "stream", "chunking_strategy", "include[]"}
    assert b"max_tokens" not in call.content and b"ZML" in call.content and b'name="language"\r\n\r\nfr' in call.content
    http = call.http_headers()
    assert http["content-type"] == call.content_type and http["x-zml-request-id"] == "r-1"
    assert http["x-zml-timeout-ms"] == "12000" and http["x-zml-accelerator-id"] == "h100-2"
    assert json.loads(http["x-zml-policy"])["accelerator_chain"] == ["H100"] and http["x-session-id"] == "s"
    assert "x-zml-id-generated" not in http  # the caller's own id
    nats = call.nats_headers()
    assert nats[subjects.H_AUDIO] == "transcription" and nats[subjects.H_CONTENT_TYPE] == call.content_type
    assert nats[subjects.H_REQUEST_ID] == "r-1" and nats[subjects.H_ACCELERATOR_ID] == "h100-2"
    assert json.loads(nats[subjects.H_POLICY])["accelerator_chain"] == ["H100"]
    assert call.encode() is call.content and call.est_tokens == 8  # two seconds of speech


def test_a_generated_id_and_a_policy_name() -> None:
    call = build_audio(task="translation", file=("a.mp3", b"ID3..."), model="w", routing="cost")
    assert call.http_headers()["x-zml-id-generated"] == "1" and call.http_headers()["x-zml-policy"] == "cost"
    assert call.http_path == "/v1/audio/translations"
    assert 'filename="a.mp3"' in call.content.decode("latin-1") and "audio/mpeg" in call.content.decode("latin-1")  # type: ignore[union-attr]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"model": None}, "model is required"),
    ({"response_format": "wav"}, "response_format"),
    ({"file": b""}, "empty"),
    ({"file": 42}, "path, bytes or a binary file"),
    ({"file": "/no/such.wav"}, "cannot read"),
])
def test_bad_calls_fail_before_anything_is_sent(kwargs: dict[str, object], says: str) -> None:
    args: dict[str, object] = {"task": "transcription", "file": AUDIO, "model": "w", **kwargs}
    with pytest.raises(zml.BadRequestError, match=says):
        build_audio(**args)  # type: ignore[arg-type]


def _reply(body: bytes, ctype: str, fmt: str, headers: dict[str, str] | None = None) -> zml.TranscriptionResult:
    """Over HTTP (``x-zml-*`` headers), or over NATS when ``headers`` are given (lower-cased ``Zml-*``)."""
    call = build_audio(task="transcription", file=AUDIO, model="w", response_format=fmt)
    h = headers or {"content-type": ctype, "x-zml-node-id": "h100-1", "x-zml-attempts": "2"}
    return decode_transcription(RawReply(200, h, body), call)


def test_every_reply_format_decodes() -> None:
    r = _reply(b'{"text": "hi there", "usage": {"type": "duration", "seconds": 3}}', "application/json", "json")
    assert r.text == "hi there" and r.duration == 3 and r.routing.node_id == "h100-1" and r.routing.attempts == 2
    v = _reply(json.dumps({"task": "transcribe", "language": "english", "duration": 2.5, "text": "a b",
                           "segments": [{"id": 0, "text": "a b"}], "words": [{"word": "a"}, {"word": "b"}],
                           "usage": {"type": "tokens", "input_tokens": 10, "output_tokens": 2, "total_tokens": 12}}
                          ).encode(), "application/json", "verbose_json")
    assert (v.language, v.duration, len(v.segments), len(v.words)) == ("english", 2.5, 1, 2)
    assert (v.usage.prompt_tokens, v.usage.completion_tokens, v.usage.total_tokens) == (10, 2, 12)
    t = _reply(b"hi there\n", "text/plain; charset=utf-8", "text")
    assert t.text == "hi there" and t.raw == "hi there\n"
    s = _reply(b"1\n00:00:00,000 --> 00:00:01,000\nhi\n\n", "text/plain", "srt")
    assert s.text.startswith("1\n00:00:00,000") and s.response_format == "srt"
    n = _reply(b"WEBVTT\n\n", "text/vtt", "vtt", {"zml-content-type": "text/vtt", "zml-node-id": "n2"})
    assert n.content_type == "text/vtt" and n.routing.node_id == "n2"


def test_error_replies_and_broken_ones() -> None:
    call = build_audio(task="transcription", file=AUDIO, model="w")
    err = json.dumps({"error": {"message": "no", "type": "invalid_request_error", "code": "MODEL_NOT_LOADED"}})
    with pytest.raises(zml.ModelNotLoadedError):
        decode_transcription(RawReply(404, {}, err.encode()), call)
    with pytest.raises(zml.UploadIncompleteError):
        decode_transcription(RawReply(502, {}, json.dumps({"error": {"message": "lost", "type": "server_error",
                                                                     "code": "UPLOAD_INCOMPLETE"}}).encode()), call)
    for body in (b"not json", b"[1]", b'{"no_text": 1}'):
        with pytest.raises(zml.BackendError):
            decode_transcription(RawReply(200, {"content-type": "application/json"}, body), call)


def test_streamed_transcription_events() -> None:
    ev = decode_chunk({"type": "transcript.text.delta", "delta": " world"})
    assert ev.kind == "chunk" and ev.chunk is not None and ev.chunk.text == " world"
    done = decode_chunk({"type": "transcript.text.done", "text": "hello world"})
    assert done.chunk is not None and done.chunk.text == "" and done.chunk.finish_reason == "stop"
