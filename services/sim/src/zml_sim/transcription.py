"""``POST /v1/audio/transcriptions`` and ``/v1/audio/translations`` of a simulated node: OpenAI's
response shapes, with deterministic text.

A simulated node hears nothing: the text is words drawn from a fixed vocabulary, seeded by a
hash of (model, task, audio bytes), so the same file transcribes the same way on every node and
run (what a test can check) and different files differ. The audio's duration is read from a WAV
header when the file is one (RIFF/WAVE, its data chunk and byte rate), else estimated from its
size at 16 kB/s (zmlcore.messages.audio.audio_seconds: the routers' estimate too); the text has about 2.5
words per second of audio and is cut into segments of at most 10 s, as Whisper's are.

Formats (``response_format``): ``json`` (``{"text", "usage"}``), ``text``, ``verbose_json``
(``task``, ``language``, ``duration``, ``text``, ``segments``, and ``words`` when
``timestamp_granularities[]`` asks for them), ``srt`` and ``vtt``. A streamed request gets
OpenAI's ``transcript.text.delta`` events and one ``transcript.text.done``. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from typing import Any

from zmlcore.messages.audio import AUDIO_TOKENS_PER_S, audio_seconds

FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
#: OpenAI's upload limit for audio files.
MAX_FILE_BYTES = 25 * 1024 * 1024
WORDS_PER_S = 2.5
SEGMENT_S = 10.0
_VOCAB = ("the", "model", "routes", "each", "request", "to", "a", "node", "that", "holds", "its", "prefix",
          "cache", "and", "answers", "in", "time", "while", "fleet", "of", "accelerators", "serves", "many",
          "users", "with", "low", "latency", "cost", "policy", "warm", "quiet", "speech", "audio", "clear")


class TranscriptionRequestError(ValueError):
    pass


@dataclass(frozen=True)
class Word:
    word: str
    start: float
    end: float


@dataclass(frozen=True)
class Transcript:
    task: str  # "transcribe" | "translate"
    language: str
    duration: float
    words: list[Word]

    @property
    def text(self) -> str:
        return " ".join(w.word for w in self.words)

    def segments(self) -> list[list[Word]]:
        out: list[list[Word]] = []
        for w in self.words:
            if not out or w.end - out[-1][0].start > SEGMENT_S:
                out.append([])
            out[-1].append(w)
        return out


def duration_of(audio: bytes) -> float:
    """The audio's seconds as the routers estimate them (zmlcore.messages.audio.audio_seconds)."""
    return audio_seconds(audio)


def transcribe(model: str, audio: bytes, *, task: str = "transcribe", language: str | None = None) -> Transcript:
    """The deterministic transcript of ``audio``: what a node answers."""
    if not audio:
        raise TranscriptionRequestError("The audio file is empty")
    duration = duration_of(audio)
    seed = hashlib.sha256(model.encode() + b"\0" + task.encode() + b"\0" + audio).digest()
    rng = random.Random(int.from_bytes(seed[:8], "big"))
    n = max(1, round(duration * WORDS_PER_S))
    step = duration / n if duration > 0 else 0.0
    words = [Word(rng.choice(_VOCAB), round(i * step, 2), round((i + 1) * step, 2)) for i in range(n)]
    # translations are into English; a transcription says the language it was asked for
    return Transcript(task, "english" if task == "translate" else (language or "english"), duration, words)


def _stamp(t: float, sep: str) -> str:
    ms = round(t * 1000)
    h, rest = divmod(ms, 3_600_000)
    m, rest = divmod(rest, 60_000)
    s, ms = divmod(rest, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def render(t: Transcript, fmt: str, *, granularities: list[str] | None = None) -> tuple[str, str]:
    """(content type, body) of ``t`` in ``fmt``."""
    if fmt == "text":
        return "text/plain; charset=utf-8", t.text + "\n"
    if fmt in ("srt", "vtt"):
        sep = "," if fmt == "srt" else "."
        cues = []
        for i, seg in enumerate(t.segments(), 1):
            span = f"{_stamp(seg[0].start, sep)} --> {_stamp(seg[-1].end, sep)}"
            text = " ".join(w.word for w in seg)
            cues.append(f"{i}\n{span}\n{text}\n" if fmt == "srt" else f"{span}\n{text}\n")
        joined = "\n".join(cues)
        return ("text/plain; charset=utf-8", joined + "\n") if fmt == "srt" else \
            ("text/vtt; charset=utf-8", "WEBVTT\n\n" + joined + "\n")
    if fmt == "json":
        return "application/json", json.dumps({"text": t.text, "usage": {"type": "duration",
                                                                         "seconds": max(1, round(t.duration))}})
    body: dict[str, Any] = {"task": t.task, "language": t.language, "duration": t.duration, "text": t.text}
    grans = granularities or ["segment"]
    if "segment" in grans:
        body["segments"] = [{
            "id": i, "seek": int(seg[0].start * 100), "start": seg[0].start, "end": seg[-1].end,
            "text": " " + " ".join(w.word for w in seg), "tokens": [50364 + j for j in range(len(seg))],
            "temperature": 0.0, "avg_logprob": -0.25, "compression_ratio": 1.2, "no_speech_prob": 0.01,
        } for i, seg in enumerate(t.segments())]
    if "word" in grans:
        body["words"] = [{"word": w.word, "start": w.start, "end": w.end} for w in t.words]
    body["usage"] = {"type": "duration", "seconds": max(1, round(t.duration))}
    return "application/json", json.dumps(body)


def stream_events(t: Transcript) -> list[str]:
    """OpenAI's streamed transcription: one delta event per word, then the whole text."""
    out = []
    for i, w in enumerate(t.words):
        delta = w.word if i == 0 else " " + w.word
        out.append(json.dumps({"type": "transcript.text.delta", "delta": delta}))
    out.append(json.dumps({"type": "transcript.text.done", "text": t.text,
                           "usage": {"type": "duration", "seconds": max(1, round(t.duration))}}))
    return out


def check_format(fmt: str, stream: bool) -> None:
    if fmt not in FORMATS:
        raise TranscriptionRequestError(f"response_format {fmt!r}: one of {', '.join(FORMATS)}")
    if stream and fmt not in ("json", "text"):
        raise TranscriptionRequestError("stream=true is supported with response_format json or text only")


def prompt_tokens(duration: float) -> int:
    """What the node's encoder runs over, for the engine's scheduling."""
    return max(1, round(duration * AUDIO_TOKENS_PER_S))
