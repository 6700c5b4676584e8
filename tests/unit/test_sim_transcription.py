"""The simulated node's transcription answers (zml_sim.transcription): OpenAI's shapes, pure."""

from __future__ import annotations

import json

import pytest

from wavs import wav
from zml_sim import transcription as tr
from zmlcore.messages.audio import wav_seconds


def test_duration_from_the_wav_header_else_from_the_size() -> None:
    assert wav_seconds(wav(3.0)) == pytest.approx(3.0)
    assert wav_seconds(wav(1.5, rate=8000)) == pytest.approx(1.5)
    assert wav_seconds(b"ID3...mp3 bytes") is None
    assert tr.duration_of(b"\xff" * 32000) == 2.0  # not a WAV: 16 kB per second


def test_same_audio_same_text_other_audio_other_text() -> None:
    a, b = wav(4.0), wav(4.0, rate=8000)
    assert tr.transcribe("whisper", a).text == tr.transcribe("whisper", a).text
    assert tr.transcribe("whisper", a).text != tr.transcribe("whisper", b).text
    t = tr.transcribe("whisper", a)
    assert len(t.words) == 10 and t.words[-1].end == pytest.approx(4.0)
    assert tr.transcribe("whisper", a, task="translate").language == "english"
    assert tr.transcribe("whisper", a, language="fr").language == "fr"
    with pytest.raises(tr.TranscriptionRequestError):
        tr.transcribe("whisper", b"")


def test_formats() -> None:
    t = tr.transcribe("whisper", wav(25.0))
    ctype, body = tr.render(t, "json")
    assert ctype == "application/json" and json.loads(body)["text"] == t.text
    ctype, body = tr.render(t, "text")
    assert ctype.startswith("text/plain") and body == t.text + "\n"
    v = json.loads(tr.render(t, "verbose_json")[1])
    assert v["task"] == "transcribe" and v["duration"] == 25.0 and v["text"] == t.text and "words" not in v
    assert [s["id"] for s in v["segments"]] == [0, 1, 2]  # 10-second segments
    assert all(s["end"] - s["start"] <= 10.0 for s in v["segments"])
    v = json.loads(tr.render(t, "verbose_json", granularities=["word"])[1])
    assert len(v["words"]) == len(t.words) and "segments" not in v
    srt = tr.render(t, "srt")[1]
    assert srt.startswith("1\n00:00:00,000 --> 00:00:") and "\n\n2\n" in srt
    ctype, vtt = tr.render(t, "vtt")
    assert ctype.startswith("text/vtt") and vtt.startswith("WEBVTT\n\n00:00:00.000 --> ")


def test_stream_events_add_up_to_the_text() -> None:
    t = tr.transcribe("whisper", wav(2.0))
    events = [json.loads(e) for e in tr.stream_events(t)]
    assert "".join(e["delta"] for e in events[:-1]) == t.text
    assert events[-1]["type"] == "transcript.text.done" and events[-1]["text"] == t.text
    tr.check_format("text", True)
    with pytest.raises(tr.TranscriptionRequestError):
        tr.check_format("srt", True)
    with pytest.raises(tr.TranscriptionRequestError):
        tr.check_format("mp3", False)
