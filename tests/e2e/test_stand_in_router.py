"""The gateway and the SDK against a stand-in router (issue 8 items 6 and 7).

Item 7: a streamed reply that loses a message on the bus is never silently short. Since issue
20 item 3 the gateway and the SDK's NATS transport have the stream continued from what came
before the loss (``Zml-Resume``, which the stand-in honours as the router does); where it cannot
be continued (the router refuses) it ends with an error event (STREAM_INTERRUPTED).
Item 6: the SDK cancels an attempt that timed out before it retries under a new id.

A stand-in router (the test's own subscriber in the routers' queue group, on a broker of this
module's own) answers streams the way the router does, numbered with Zml-Seq, except that it
skips one message, as a broker restart does to an at-most-once stream. The real router's
numbering is checked in test_router_faults.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import nats
import pytest

import zml
from zmlcore import subjects
from zmlcore.bus.publish import flush
from zmlcore.reply import resume
from conftest import lone_gateway

MODEL = "gap/model"
ROUTING = {"node_id": "n1", "accelerator_type": "nvidia_h100", "family": "H100", "policy": "latency",
           "queue_depth_at_dispatch": 0, "decision_id": "d1"}


def _chunk(text: str) -> bytes:
    return json.dumps({"id": "c", "object": "chat.completion.chunk", "model": MODEL,
                       "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}).encode()


@pytest.fixture(scope="module")
def gateway(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_gateway(own_nats, Path(tmp_path_factory.mktemp("gap")), request_timeout_s=10) as gateway_url:
        yield gateway_url


class Skips(list[int]):
    """The message numbers the stand-in does not send; ``refuse``: it answers a continuation
    (``Zml-Resume``) with the router's error for an answer that may not be continued."""

    refuse = False
    resumes: list[resume.StreamResume]
    #: what the stand-in received: (subject, body, headers)
    seen: list[tuple[str, bytes, dict[str, str]]]


@pytest.fixture()
async def lossy_router(own_nats: str) -> AsyncIterator[Skips]:
    """Answers every stream with start, chunks 1..4 and end, but never sends the messages
    numbered in ``skip`` (a list the test fills). A request sent again with ``Zml-Resume`` is
    continued as the router does: the rest after what the requester has, numbered on."""
    skip = Skips()
    skip.resumes = []
    skip.seen = []
    nc = await nats.connect(own_nats)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        skip.seen.append((msg.subject, msg.data, dict(msg.headers or {})))
        rid = (msg.headers or {}).get(subjects.H_REQUEST_ID, "r")
        end = (json.dumps({"routing": {**ROUTING, "request_id": rid}}).encode(), {subjects.H_STREAM: subjects.STREAM_END})
        value = (msg.headers or {}).get(subjects.H_RESUME)
        if value is not None:
            r = resume.decode(value)
            skip.resumes.append(r)
            if skip.refuse:
                await nc.publish(msg.reply, b'{"error":{"message":"cannot be continued: a seed was given",'
                                 b'"type":"server_error","code":"STREAM_INTERRUPTED"}}',
                                 headers={subjects.H_STREAM: subjects.STREAM_ERROR,
                                          subjects.H_ERROR_CODE: "STREAM_INTERRUPTED"})
                return
            rest = [(_chunk(f"w{i} "), {subjects.H_STREAM: subjects.STREAM_CHUNK}) for i in range(r.tokens + 1, 5)]
            for seq, (data, headers) in enumerate([*rest, end], start=r.seq + 1):
                await nc.publish(msg.reply, data, headers={**headers, subjects.H_SEQ: str(seq)})
            return
        out = [(json.dumps({"routing": {**ROUTING, "request_id": rid}}).encode(),
                {subjects.H_STREAM: "start", subjects.H_NODE_ID: "n1"})]
        out += [(_chunk(f"w{i} "), {subjects.H_STREAM: subjects.STREAM_CHUNK}) for i in range(1, 5)]
        out.append(end)
        for seq, (data, headers) in enumerate(out):
            if seq not in skip:
                await nc.publish(msg.reply, data, headers={**headers, subjects.H_SEQ: str(seq)})

    # The gateway sends on the front-door subject, the SDK on zml.infer: stand in on both.
    subs = [await nc.subscribe(s, queue=subjects.ROUTER_QUEUE, cb=serve)
            for s in (subjects.INFER, subjects.FRONT_DOOR_INFER)]
    await flush(nc)
    try:
        yield skip
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()


async def test_gateway_sends_the_key_chain_the_router_would_compute(gateway: str, lossy_router: Skips) -> None:
    """Issue 19: the gateway keys a long prompt it decoded anyway (``Zml-Prefix-Keys``), so the
    router does not decode it again; the chain is the one the router computes from the raw body
    it gets (escaped non-ASCII text included). A short prompt carries none."""
    from zmlcore.messages import frontdoor
    from zmlcore.policy.prefix import chain_from_header
    from zml_router.request import prepare
    long = [{"role": "system", "content": "Ω système " * 1500}, {"role": "user", "content": "q"}]
    async with httpx.AsyncClient(base_url=gateway, timeout=20) as client:
        for msgs in (long, [{"role": "user", "content": "hi"}]):
            body = json.dumps({"model": MODEL, "messages": msgs, "stream": True}).encode()  # ASCII: \\u escapes
            async with client.stream("POST", "/v1/chat/completions", content=body,
                                     headers={"content-type": "application/json"}) as r:
                assert r.status_code == 200
                [line async for line in r.aiter_lines()]
    (subject, body, headers), (_, _, short) = lossy_router.seen[-2:]
    assert subject == subjects.FRONT_DOOR_INFER and b"\\u03a9" in body  # escaped: the router decodes it
    assert subjects.H_PREFIX_KEYS not in short
    sent = chain_from_header(headers[subjects.H_PREFIX_KEYS], MODEL)
    computed = prepare.prefix_chain(MODEL, frontdoor.decode(body, headers), body)
    assert sent is not None and len(sent) > 8 and sent == computed


async def _sse(gateway: str) -> tuple[int, list[str]]:
    async with httpx.AsyncClient(base_url=gateway, timeout=20) as client:
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line]


async def test_gateway_continues_a_stream_with_a_lost_chunk(gateway: str, lossy_router: Skips) -> None:
    status, lines = await _sse(gateway)  # control: nothing lost, the whole text and [DONE]
    assert status == 200 and lines[-1] == "data: [DONE]" and len(lines) == 5, lines
    lossy_router.append(3)
    status, lines = await _sse(gateway)
    assert status == 200 and lines[-1] == "data: [DONE]", lines
    text = "".join(json.loads(line[6:])["choices"][0]["delta"]["content"] for line in lines[:-1])
    assert text == "w1 w2 w3 w4 ", lines  # w4, which came after the gap, is not relayed twice
    (r,) = lossy_router.resumes
    assert (r.text, r.tokens, r.seq) == ("w1 w2 ", 2, 2)


async def test_gateway_ends_a_stream_with_a_lost_chunk_that_cannot_be_continued(
        gateway: str, lossy_router: Skips) -> None:
    lossy_router.append(3)
    lossy_router.refuse = True
    status, lines = await _sse(gateway)
    assert status == 200
    assert "data: [DONE]" not in lines
    err = json.loads(lines[-1][len("data: "):])["error"]
    assert err["code"] == "STREAM_INTERRUPTED" and "cannot be continued" in err["message"], err
    assert len(lines) == 3  # w1, w2, then the error: w4 is not relayed after the gap


async def test_gateway_answers_502_when_the_start_is_lost(gateway: str, lossy_router: Skips) -> None:
    lossy_router.append(0)
    async with httpx.AsyncClient(base_url=gateway, timeout=20) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True})
    assert r.status_code == 502 and r.json()["error"]["code"] == "STREAM_INTERRUPTED", r.text


async def test_sdk_nats_stream_with_a_lost_chunk_is_continued_or_raises(own_nats: str, lossy_router: Skips) -> None:
    lossy_router.append(2)
    async with zml.AsyncClient(endpoint=own_nats, model=MODEL, max_retries=0) as client:
        async with client.infer_stream(prompt="hi") as stream:
            text = "".join([c.text async for c in stream])
        assert text == "w1 w2 w3 w4 " and lossy_router.resumes[0].seq == 1  # continued after w1
        lossy_router.refuse = True
        got: list[str] = []
        with pytest.raises(zml.StreamInterruptedError):
            async with client.infer_stream(prompt="hi") as stream:
                async for chunk in stream:
                    got.append(chunk.text)
        assert got == ["w1 "]  # what came before the gap, and then an error: never a short "success"
        lossy_router.clear()
        async with client.infer_stream(prompt="hi") as stream:
            text = "".join([c.text async for c in stream])
        assert text == "w1 w2 w3 w4 "



@pytest.fixture()
async def silent_router(own_nats: str) -> AsyncIterator[list[tuple[str, str]]]:
    """Takes every request and never answers; records (what, request id) in arrival order."""
    seen: list[tuple[str, str]] = []
    nc = await nats.connect(own_nats)

    async def on_infer(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(("infer", json.loads(msg.data).get("request_id") or (msg.headers or {}).get(subjects.H_REQUEST_ID, "")))

    async def on_cancel(msg) -> None:  # type: ignore[no-untyped-def]
        seen.append(("cancel", msg.subject.rsplit(".", 1)[-1]))

    subs = [await nc.subscribe(subjects.INFER, queue=subjects.ROUTER_QUEUE, cb=on_infer),
            await nc.subscribe(subjects.FRONT_DOOR_INFER, queue=subjects.ROUTER_QUEUE, cb=on_infer),
            await nc.subscribe(subjects.cancel("*"), cb=on_cancel)]
    await flush(nc)
    try:
        yield seen
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()


def _cancelled_before_retry(seen: list[tuple[str, str]]) -> None:
    ids = [rid for what, rid in seen if what == "infer"]
    assert len(ids) == 2 and ids[0] != ids[1], seen  # retried once, under a new id
    assert seen.index(("cancel", ids[0])) < seen.index(("infer", ids[1])), seen


@pytest.mark.parametrize("endpoint", ["nats", "http"])
async def test_sdk_cancels_a_timed_out_attempt_before_retrying(
        endpoint: str, own_nats: str, gateway: str, silent_router: list[tuple[str, str]]) -> None:
    url = own_nats if endpoint == "nats" else gateway
    async with zml.AsyncClient(endpoint=url, model=MODEL, timeout=1.0, max_retries=1) as client:
        with pytest.raises(zml.TimeoutError):
            await client.infer(prompt="hi")
    await asyncio.sleep(0.5)
    _cancelled_before_retry(silent_router)


async def test_sync_sdk_cancels_a_timed_out_stream_before_retrying(own_nats: str, silent_router: list[tuple[str, str]]) -> None:
    def run() -> None:  # the sync client, in a thread: the recorder lives on this loop
        with zml.Client(endpoint=own_nats, model=MODEL, timeout=1.0, max_retries=1) as client:
            with pytest.raises(zml.TimeoutError):
                with client.infer_stream(prompt="hi") as stream:
                    list(stream)

    await asyncio.to_thread(run)
    await asyncio.sleep(0.5)
    _cancelled_before_retry(silent_router)


@pytest.fixture()
async def header_router(own_nats: str) -> AsyncIterator[list[str | None]]:
    """Answers every request at once; records the Zml-Id-Generated header each one came with."""
    seen: list[str | None] = []
    nc = await nats.connect(own_nats)

    async def serve(msg) -> None:  # type: ignore[no-untyped-def]
        headers = msg.headers or {}
        seen.append(headers.get(subjects.H_ID_GENERATED))
        rid = headers.get(subjects.H_REQUEST_ID, "r")
        body = {"id": "c", "object": "chat.completion", "model": MODEL,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                "zml": {**ROUTING, "request_id": rid}}
        await nc.publish(msg.reply, json.dumps(body).encode(), headers={subjects.H_REQUEST_ID: rid, subjects.H_NODE_ID: "n1"})

    subs = [await nc.subscribe(s, queue=subjects.ROUTER_QUEUE, cb=serve)
            for s in (subjects.INFER, subjects.FRONT_DOOR_INFER)]
    await flush(nc)
    try:
        yield seen
    finally:
        for sub in subs:
            await sub.unsubscribe()
        await nc.close()


@pytest.mark.parametrize("way", ["sdk-nats", "sdk-http", "http"])
@pytest.mark.parametrize("request_id", [None, "mine"], ids=["generated", "client-id"])
async def test_only_a_client_chosen_id_needs_the_shared_duplicate_check(
        way: str, request_id: str | None, own_nats: str, gateway: str, header_router: list[str | None]) -> None:
    """Issue 9: ids made up by the SDK or the gateway reach the router marked Zml-Id-Generated
    (no cross-replica claim, no extra round trip); an id the caller chose does not."""
    extra = {"request_id": request_id} if request_id else {}
    if way == "http":
        async with httpx.AsyncClient(timeout=10) as http:
            r = await http.post(gateway + "/v1/chat/completions",
                                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra})
            assert r.status_code == 200, r.text
    else:
        async with zml.AsyncClient(endpoint=own_nats if way == "sdk-nats" else gateway, model=MODEL,
                                   max_retries=0) as client:
            assert (await client.infer(prompt="hi", **extra)).text == "ok"  # type: ignore[arg-type]
    assert header_router == [None if request_id else "1"]
