"""Other systems publish raw JSON to `zml.infer` with nats-py (docs/nats-api.md)."""

from __future__ import annotations

import json

import nats
import pytest

from conftest import MODEL, Stack
from zmlcore import subjects
from zmlcore.bus.publish import flush


async def test_raw_json_request_reply(zml_stack: Stack) -> None:
    nc = await nats.connect(zml_stack.nats_url)
    try:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        msg = await nc.request(subjects.INFER, json.dumps(payload).encode(), timeout=10)
        assert not (msg.headers or {}).get(subjects.H_ERROR_CODE)
        body = json.loads(msg.data)
        assert body["choices"][0]["message"]["content"]
        assert body["zml"]["node_id"] == msg.headers[subjects.H_NODE_ID]
        assert msg.headers[subjects.H_DECISION_ID] == body["zml"]["decision_id"]
    finally:
        await nc.close()



async def test_routing_metadata_travels_once_when_asked(zml_stack: Stack) -> None:
    """Zml-Accept-Routing: body (what the gateway sends): no Zml-* routing headers, the same
    metadata in the body's zml object and in a stream's start body."""
    nc = await nats.connect(zml_stack.nats_url)
    try:
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
        ask = {subjects.H_ACCEPT_ROUTING: subjects.ROUTING_IN_BODY}
        msg = await nc.request(subjects.INFER, json.dumps(payload).encode(), timeout=10, headers=ask)
        assert subjects.H_NODE_ID not in (msg.headers or {}) and subjects.H_DECISION_ID not in (msg.headers or {})
        assert json.loads(msg.data)["zml"]["node_id"]
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        await nc.publish(subjects.INFER, json.dumps({**payload, "stream": True}).encode(), reply=inbox, headers=ask)
        start = await sub.next_msg(timeout=10)
        while not start.data:  # keepalives, if any
            start = await sub.next_msg(timeout=10)
        assert start.headers[subjects.H_STREAM] == "start" and subjects.H_NODE_ID not in start.headers
        assert json.loads(start.data)["routing"]["node_id"]
    finally:
        await nc.close()

@pytest.mark.parametrize(
    ("payload", "code"),
    [
        (b"not json at all", "BAD_REQUEST"),
        (b'{"model": "x"}', "BAD_REQUEST"),
        (b'{"model": "unknown-model", "prompt": "hi"}', "MODEL_NOT_LOADED"),
    ],
)
async def test_raw_errors_carry_a_code_header_and_body(zml_stack: Stack, payload: bytes, code: str) -> None:
    nc = await nats.connect(zml_stack.nats_url)
    try:
        msg = await nc.request(subjects.INFER, payload, timeout=10)
        assert msg.headers[subjects.H_ERROR_CODE] == code
        assert json.loads(msg.data)["error"]["code"] == code
        ok = await nc.request(subjects.INFER, json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 1}).encode(), timeout=10)
        assert subjects.H_ERROR_CODE not in (ok.headers or {})
    finally:
        await nc.close()


async def test_raw_streaming_sequence(zml_stack: Stack) -> None:
    nc = await nats.connect(zml_stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        await nc.publish(subjects.INFER, json.dumps(payload).encode(), reply=inbox)
        kinds, texts = [], []
        while True:
            msg = await sub.next_msg(timeout=10)
            kind = msg.headers[subjects.H_STREAM]
            kinds.append(kind)
            if kind == "chunk":
                chunk = json.loads(msg.data)
                texts.append(chunk["choices"][0]["delta"].get("content") or "")
            if kind in ("end", "error"):
                break
        assert kinds[0] == "start" and kinds[-1] == "end"
        assert kinds.count("chunk") >= 2
        assert "".join(texts).strip()
    finally:
        await nc.close()


async def test_routers_publish_one_completion_event_per_request(zml_stack: Stack) -> None:
    nc = await nats.connect(zml_stack.nats_url)
    try:
        sub = await nc.subscribe(subjects.event(subjects.EVENT_COMPLETED))
        await flush(nc)
        ok = {"model": "llama-3-8b", "prompt": "x", "max_tokens": 1, "request_id": "ev-ok"}
        bad = {"model": "nobody-serves-this", "prompt": "x", "request_id": "ev-bad"}
        for body in (ok, bad):
            await nc.request(subjects.INFER, json.dumps(body).encode(), timeout=10)
        events = {}
        while len(events) < 2:
            ev = json.loads((await sub.next_msg(timeout=5)).data)
            if ev.get("request_id") in ("ev-ok", "ev-bad"):
                events[ev["request_id"]] = ev
        assert events["ev-ok"].get("ok", True) is True and events["ev-ok"]["model"] == MODEL  # alias resolved
        assert events["ev-ok"]["node_id"] in zml_stack.node_ids and events["ev-ok"]["ttft_s"] > 0
        assert events["ev-bad"].get("ok", True) is False and events["ev-bad"]["error_code"] == "MODEL_NOT_LOADED"
    finally:
        await nc.close()


async def test_raw_streaming_frames(zml_stack: Stack) -> None:
    """``Zml-Accept-Stream: frames``: chunk messages without headers, each ``<seq>\\n`` and whole
    SSE events (zmlcore.reply.streamframe); start and end keep their headers; the text is the same."""
    from zmlcore.reply import streamframe
    from zmlcore.reply.sse import event_payloads

    nc = await nats.connect(zml_stack.nats_url)
    try:
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
        await nc.publish(subjects.INFER, json.dumps(payload).encode(), reply=inbox,
                         headers={subjects.H_ACCEPT_STREAM: subjects.STREAM_FRAMES})
        kinds, seqs, texts = [], [], []
        while True:
            msg = await sub.next_msg(timeout=10)
            if msg.headers is None:
                seq, events = streamframe.decode(msg.data)
                kinds.append("frame")
                seqs.append(seq)
                for data in event_payloads(events):
                    texts.append(json.loads(data)["choices"][0]["delta"].get("content") or "")
                continue
            kind = msg.headers[subjects.H_STREAM]
            kinds.append(kind)
            seqs.append(int(msg.headers[subjects.H_SEQ]))
            if kind in ("end", "error"):
                break
        assert kinds[0] == "start" and kinds[-1] == "end" and kinds.count("frame") >= 1, kinds
        assert seqs == list(range(len(seqs)))  # one numbering across headed and header-less messages
        assert "".join(texts).strip()
    finally:
        await nc.close()
