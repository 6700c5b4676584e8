"""A simulated node answers OpenAI's audio API as the `openai` package expects it
(``client.audio.transcriptions.create`` / ``translations.create``, every response format,
streaming), over real HTTP."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import openai
import pytest

from wavs import wav
from zml_sim.server import SimNode

M = "whisper-large-v3"


@pytest.fixture
async def sim() -> AsyncIterator[SimNode]:
    n = SimNode("h100-1", "nvidia_h100", [M], time_scale=50.0, load_time_s=0.0, seed=1)
    await n.start()
    try:
        yield n
    finally:
        await n.stop()


@pytest.fixture
async def client(sim: SimNode) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=sim.url + "/v1", api_key="none", max_retries=0)
    try:
        yield c
    finally:
        await c.close()


async def test_every_response_format(client: openai.AsyncOpenAI) -> None:
    audio = ("speech.wav", wav(12.0), "audio/wav")
    plain = await client.audio.transcriptions.create(model=M, file=audio)
    assert plain.text and len(plain.text.split()) == 30
    verbose = await client.audio.transcriptions.create(model=M, file=audio, response_format="verbose_json",
                                                       timestamp_granularities=["word", "segment"])
    assert verbose.text == plain.text and verbose.duration == pytest.approx(12.0)
    assert verbose.segments and verbose.segments[0].start == 0.0 and len(verbose.segments) == 2
    assert verbose.words and len(verbose.words) == 30
    text = await client.audio.transcriptions.create(model=M, file=audio, response_format="text")
    assert isinstance(text, str) and text.strip() == plain.text
    srt = await client.audio.transcriptions.create(model=M, file=audio, response_format="srt")
    assert isinstance(srt, str) and srt.startswith("1\n00:00:00,000 --> ")
    vtt = await client.audio.transcriptions.create(model=M, file=audio, response_format="vtt")
    assert isinstance(vtt, str) and vtt.startswith("WEBVTT")


async def test_translation_is_english_and_differs(client: openai.AsyncOpenAI) -> None:
    """Over plain HTTP: the openai package marks its translations endpoint deprecated (OpenAI
    retired it), while vLLM and the sims still serve it."""
    import httpx

    audio = ("speech.wav", wav(4.0), "audio/wav")
    same = await client.audio.transcriptions.create(model=M, file=audio)
    async with httpx.AsyncClient(base_url=str(client.base_url)) as h:
        r = await h.post("audio/translations", files={"file": audio}, data={"model": M})
        v = await h.post("audio/translations", files={"file": audio}, data={"model": M, "response_format": "verbose_json"})
    assert r.status_code == 200 and r.json()["text"] and r.json()["text"] != same.text
    assert v.status_code == 200 and v.json()["language"] == "english" and v.json()["task"] == "translate"


async def test_streamed_deltas_add_up_to_the_text(client: openai.AsyncOpenAI) -> None:
    audio = ("speech.wav", wav(6.0), "audio/wav")
    whole = (await client.audio.transcriptions.create(model=M, file=audio)).text
    deltas, done = [], ""
    stream = await client.audio.transcriptions.create(model=M, file=audio, stream=True)
    async for event in stream:
        if event.type == "transcript.text.delta":
            deltas.append(event.delta)
        elif event.type == "transcript.text.done":
            done = event.text
    assert "".join(deltas) == whole == done


async def test_errors_are_openai_shaped(client: openai.AsyncOpenAI, sim: SimNode) -> None:
    with pytest.raises(openai.NotFoundError):
        await client.audio.transcriptions.create(model="nope", file=("a.wav", wav(1.0), "audio/wav"))
    with pytest.raises(openai.BadRequestError):
        await client.audio.transcriptions.create(model=M, file=("a.wav", b"", "audio/wav"))
    with pytest.raises(openai.BadRequestError):
        await client.audio.transcriptions.create(model=M, file=("a.wav", wav(1.0), "audio/wav"),
                                                 response_format="srt", stream=True)
    import httpx

    async with httpx.AsyncClient() as h:  # not multipart: refused, not a 500
        r = await h.post(sim.url + "/v1/audio/transcriptions", json={"model": M})
    assert r.status_code == 400 and json.loads(r.text)["error"]
