"""Audio requests, pure: the multipart form located and checked (zmlcore.messages.audio), the
router's intake and kind checks of an audio request (zml_router.request), the body a node gets
(zml_router.node.attempt.AudioBodies), what it costs in the estimate, and the byte budget."""

from __future__ import annotations

import pytest

from wavs import wav
from zmlcore import subjects
from zmlcore.config import parse_config
from zmlcore.errors import BadRequestError, ConfigError, RequestTooLargeError
from zmlcore.runtime.bytebudget import ByteBudget
from zmlcore.messages import InlinePolicy
from zmlcore.messages.audio import (
    AudioRequest, audio_request, audio_seconds, encode_form, from_message, policy_header, read_form, with_model,
)
from zml_router.request import intake, prepare
from zml_router.node.attempt import AudioBodies
from zml_router.request.cancels import CancelBook
from zml_router.outcome import Outcome
from zml_router.request.uploads import upload_size

AUDIO = wav(2.0)


def _form(*fields: tuple[str, str], audio: bytes = AUDIO, boundary: str | None = "b0undary") -> tuple[bytes, str]:
    return encode_form(list(fields), "a.wav", audio, "audio/wav", boundary=boundary)


def test_the_form_is_located_not_copied_and_three_fields_read() -> None:
    body, ctype = _form(("model", "whisper-1"), ("language", "fr"), ("response_format", "srt"), ("stream", "True"))
    f = read_form(body, ctype)
    assert (f.model, f.response_format, f.stream, f.filename) == ("whisper-1", "srt", True, "a.wav")
    assert body[f.file_span[0]:f.file_span[1]] == AUDIO and body[slice(*f.model_span)] == b"whisper-1"
    assert f.names == ("model", "language", "response_format", "stream")
    defaults = read_form(*_form(("model", "m")))
    assert (defaults.response_format, defaults.stream) == ("json", False)


def test_what_any_client_writes_reads_the_same() -> None:
    """httpx's (the openai package's) and curl's framing: preamble, quoted and RFC 2231 names."""
    body = (b"preamble to ignore\r\n--X\r\ncontent-disposition: form-data; name=\"model\"\r\n\r\nw\r\n"
            b"--X\r\nContent-Disposition: form-data; name=file; filename*=UTF-8''%C3%A9.wav\r\n"
            b"Content-Type: audio/wav\r\n\r\nRIFF....\r\n--X--\r\nepilogue")
    f = read_form(body, 'multipart/form-data; boundary="X"')
    assert f.model == "w" and body[f.file_span[0]:f.file_span[1]] == b"RIFF...."


@pytest.mark.parametrize(("body", "ctype", "says"), [
    (b"x", "application/json", "multipart/form-data"),
    (b"x", "multipart/form-data", "boundary"),
    (b"x", "multipart/form-data; boundary=" + "b" * 71, "boundary must be"),
    (b"--b\r\n", "multipart/form-data; boundary=a", "never starts a line"),
    (b"junk--a\r\n", "multipart/form-data; boundary=a", "never starts a line"),
    (b"--a\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm", "multipart/form-data; boundary=a",
     "ends inside a part"),
    (b"--a junk\r\n", "multipart/form-data; boundary=a", "trailing data"),
    (b"--a\r\nno colon here\r\n\r\nx\r\n--a--", "multipart/form-data; boundary=a", "without a colon"),
    (b"--a\r\nContent-Disposition: attachment; name=\"x\"\r\n\r\nx\r\n--a--", "multipart/form-data; boundary=a",
     "form-data; name="),
    (b"--a\r\n\r\nx\r\n--a--", "multipart/form-data; boundary=a", "without Content-Disposition"),
    (b"--a\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--a--", "multipart/form-data; boundary=a",
     "no `file` part"),
])
def test_malformed_forms_are_bad_requests(body: bytes, ctype: str, says: str) -> None:
    with pytest.raises(BadRequestError) as info:
        read_form(body, ctype)
    assert says in info.value.message, info.value.message


def test_fields_are_bounded_and_checked() -> None:
    for fields, says in (([("model", "m"), ("prompt", "p" * 70_000)], "longer than"),
                         ([("model", " ")], "`model` is required"),
                         ([("model", "m" * 300)], "printable characters"),
                         ([("model", "m"), ("response_format", "wav")], "response_format must be"),
                         ([("model", "m"), ("stream", "yes")], "stream must be"),
                         ([("model", "m"), ("model", "n")], "twice"),
                         ([("model", "m")] + [(f"x{i}", "1") for i in range(64)], "form fields")):
        with pytest.raises(BadRequestError) as info:
            read_form(*_form(*fields))
        assert says in info.value.message, (fields[:2], info.value.message)
    with pytest.raises(BadRequestError, match="empty"):
        read_form(*_form(("model", "m"), audio=b""))


def test_a_renamed_model_is_spliced_and_nothing_else_moves() -> None:
    body, ctype = _form(("model", "whisper-1"), ("language", "en"))
    f = read_form(body, ctype)
    renamed = with_model(body, f, "/models/ggml-large-v3.bin")
    g = read_form(renamed, ctype)
    assert g.model == "/models/ggml-large-v3.bin" and renamed[g.file_span[0]:g.file_span[1]] == AUDIO
    bodies = AudioBodies(body, f)
    assert bodies("whisper-1") is body and bodies("/models/ggml-large-v3.bin") == renamed


def test_the_estimate_comes_from_the_audios_length_not_its_bytes() -> None:
    body, ctype = _form(("model", "w"), audio=wav(60.0))
    req = audio_request(read_form(body, ctype), body, "translation")
    assert req.kind() == "translation" and req.audio_seconds == pytest.approx(60.0)
    assert req.audio_tokens() == 3000 and req.max_tokens == 240
    assert audio_seconds(b"\xff" * 160_000) == 10.0  # not a WAV: 16 kB per second
    cfg = parse_config({"models": {"w": {"audio": True}}})
    _, rr = prepare.prepare(cfg, [], req, body, "w")
    assert rr.prompt_tokens == 3000 and rr.max_tokens == 240  # ~1.9 MB of body would have said ~480k tokens


def test_the_policy_header_takes_a_name_or_an_inline_policy() -> None:
    assert policy_header("cost") == "cost" and policy_header('"cost"') == "cost"
    pol = policy_header('{"accelerator_chain": ["H100"], "latency_target_ms": 300}')
    assert isinstance(pol, InlinePolicy) and pol.accelerator_chain == ["H100"]
    for bad in ('{"no_such_field": 1}', "{", "", "x" * 300):
        with pytest.raises(BadRequestError):
            policy_header(bad)


CFG = parse_config({"models": {"whisper": {"audio": True, "aliases": ["whisper-1"]}, "llama": {},
                               "bge": {"embedding": True}}})


def _msg(headers: dict[str, str], data: bytes, subject: str = subjects.INFER) -> object:
    class M:
        pass
    m = M()
    m.data, m.headers, m.reply, m.subject = data, headers, "_ZML_INBOX.UX.1", subject  # type: ignore[attr-defined]
    return m


def _intake(m: object) -> intake.Intake[object]:
    return intake.intake(m, from_queue=False, cfg=CFG, max_payload=1 << 20, options=lambda _: None,  # type: ignore[arg-type]
                       in_flight={}, cancels=CancelBook(), now=0.0, out=Outcome())


def test_router_intake_reads_an_audio_request_on_either_subject() -> None:
    body, ctype = _form(("model", "whisper-1"), ("stream", "true"))
    for subject in (subjects.INFER, subjects.FRONT_DOOR_INFER):
        headers = {subjects.H_AUDIO: "transcription", subjects.H_CONTENT_TYPE: ctype, subjects.H_POLICY: "cost",
                   subjects.H_ACCELERATOR_ID: "h100-1", subjects.H_LABEL: "team-a", subjects.H_REQUEST_ID: "a1",
                   subjects.H_TIMEOUT_MS: "9000"}
        got = _intake(_msg(headers, body, subject))
        req = got.req
        assert isinstance(req, AudioRequest) and req.stream and req.model == "whisper-1" and got.model == "whisper"
        assert (req.routing or req.policy, req.accelerator_id, got.request_id, got.timeout) == ("cost", "h100-1", "a1", 9.0)
        # the routing fields are headers from anyone (checked as a body's); the label only from a front door
        assert headers.get(subjects.H_LABEL) == ("team-a" if subject == subjects.FRONT_DOOR_INFER else None)
    with pytest.raises(BadRequestError, match="Zml-Audio"):
        _intake(_msg({subjects.H_AUDIO: "dictation", subjects.H_CONTENT_TYPE: ctype}, body))
    with pytest.raises(BadRequestError, match="invalid policy"):
        _intake(_msg({subjects.H_AUDIO: "transcription", subjects.H_CONTENT_TYPE: ctype, subjects.H_POLICY: "{"}, body))


def test_a_model_answers_only_its_kind() -> None:
    body, ctype = _form(("model", "llama"))
    audio_for_llama = from_message(body, {subjects.H_AUDIO: "transcription", subjects.H_CONTENT_TYPE: ctype})
    with pytest.raises(BadRequestError, match="not a speech-to-text model"):
        prepare.check_kind(CFG, "llama", audio_for_llama)
    with pytest.raises(BadRequestError, match="not a speech-to-text model"):
        prepare.check_kind(CFG, "bge", audio_for_llama)
    from zmlcore.messages.validate import decode_request
    chat = decode_request(b'{"model": "whisper", "messages": [{"role": "user", "content": "hi"}]}')
    with pytest.raises(BadRequestError, match="/v1/audio/transcriptions"):
        prepare.check_kind(CFG, "whisper", chat)
    prepare.check_kind(CFG, "whisper", audio_for_llama)  # an audio request for an audio model
    prepare.check_kind(CFG, "unknown", audio_for_llama)  # not configured: the node decides


def test_config_audio_is_not_embedding_and_the_budget_holds_one_request() -> None:
    with pytest.raises(ConfigError, match="audio and embedding"):
        parse_config({"models": {"x": {"audio": True, "embedding": True}}})
    with pytest.raises(ConfigError, match="audio_bytes_in_flight"):
        parse_config({"defaults": {"max_audio_bytes": 100, "audio_bytes_in_flight": 10}})


def test_byte_budget() -> None:
    b = ByteBudget(100)
    assert b.take(60) and not b.take(50) and b.held == 60
    b.give(60)
    assert b.take(100) and b.held == 100
    b.give(1000)
    assert b.held == 0


def test_upload_size_is_checked_before_any_part_is_asked() -> None:
    assert upload_size({}, 10) is None and upload_size({subjects.H_UPLOAD_BYTES: "7"}, 10) == 7
    for bad in ("0", "-1", "1e3", "x", "9" * 20):
        with pytest.raises(BadRequestError):
            upload_size({subjects.H_UPLOAD_BYTES: bad}, 10)
    with pytest.raises(RequestTooLargeError):
        upload_size({subjects.H_UPLOAD_BYTES: "11"}, 10)
