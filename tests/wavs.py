"""WAV files for the transcription tests (a helper module, no tests)."""

from __future__ import annotations

import io
import wave


def wav(seconds: float, rate: int = 16000) -> bytes:
    """``seconds`` of 16-bit mono PCM at ``rate`` Hz, as a WAV file."""
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x01\x00" * int(seconds * rate))
    return buf.getvalue()
