"""vLLM's KV-event wire format: real bytes of vLLM 0.11.0 and 0.34.0 (tests/data/kvevents/,
made with vLLM's own classes by make_fixtures.py) decode, and ZML's encoder writes them byte for byte."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from zmlcore.fleet.kvevents.wire import (
    CHECKED_SGLANG_VERSIONS,
    CHECKED_VLLM_VERSIONS,
    Cleared,
    Removed,
    Stored,
    WireError,
    decode_batch,
    encode_batch,
    split_pub,
    split_replay,
)

DATA = Path(__file__).parents[1] / "data" / "kvevents"


def fixture(version: str, engine: str = "vllm") -> dict[str, Any]:
    return json.loads((DATA / f"{engine}-{version}.json").read_text())


def expected(spec: dict[str, Any], medium: str | None = "GPU") -> list[Stored | Removed | Cleared]:
    out: list[Stored | Removed | Cleared] = []
    for ev in spec["events"]:
        if ev["kind"] == "stored":
            out.append(Stored(hashes=ev["hashes"], parent=ev["parent"], token_ids=ev["token_ids"],
                              block_size=ev["block_size"], medium=medium))
        elif ev["kind"] == "removed":
            out.extend(Removed(hashes=[h], medium=medium) for h in ev["hashes"])
        else:
            out.append(Cleared())
    return out


@pytest.mark.parametrize("version", CHECKED_VLLM_VERSIONS)
def test_real_vllm_bytes_decode(version: str) -> None:
    fx = fixture(version)
    assert fx["vllm"] == version
    for spec, hexed in zip(fx["scenario"], fx["payloads"]):
        batch = decode_batch(bytes.fromhex(hexed))
        assert batch.ts == spec["ts"]
        assert batch.dp_rank == 0
        assert batch.events == expected(spec)


@pytest.mark.parametrize("version", CHECKED_SGLANG_VERSIONS)
def test_sglang_bytes_decode_and_encode(version: str) -> None:
    fx = fixture(version, "sglang")
    for spec, hexed in zip(fx["scenario"], fx["payloads"]):
        batch = decode_batch(bytes.fromhex(hexed))
        assert batch.ts == spec["ts"] and batch.dp_rank is None  # SGLang's batch has no rank
        assert batch.events == expected(spec, medium=None)
        assert encode_batch(spec["ts"], [e for e in batch.events], layout="sglang").hex() == hexed


@pytest.mark.parametrize(("version", "layout"), [("0.34.0", "0.34"), ("0.11.0", "0.11")])
def test_encoder_writes_vllms_bytes(version: str, layout: str) -> None:
    fx = fixture(version)
    for spec, hexed in zip(fx["scenario"], fx["payloads"]):
        events: list[Stored | Removed | Cleared] = []
        for ev in spec["events"]:  # the encoder splits a Removed into one event per block, as vLLM does
            if ev["kind"] == "stored":
                events.append(Stored(hashes=ev["hashes"], parent=ev["parent"], token_ids=ev["token_ids"],
                                     block_size=ev["block_size"], medium="GPU"))
            elif ev["kind"] == "removed":
                events.append(Removed(hashes=ev["hashes"], medium="GPU"))
            else:
                events.append(Cleared())
        assert encode_batch(spec["ts"], events, layout=layout).hex() == hexed  # type: ignore[arg-type]


def test_a_hash_above_2_63_survives() -> None:
    batch = decode_batch(bytes.fromhex(fixture("0.34.0")["payloads"][0]))
    stored = batch.events[0]
    assert isinstance(stored, Stored) and stored.hashes[1] == 0xFEDC_BA98_7654_3210


def test_bytes_hashes_fold_to_vllms_int() -> None:
    digest = bytes(range(32))
    raw = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [digest], "medium": "GPU"}]])
    ev = decode_batch(raw).events[0]
    assert isinstance(ev, Removed)
    assert ev.hashes == [int.from_bytes(digest, "big") & ((1 << 64) - 1)]


def test_unknown_event_kinds_and_fields_are_skipped() -> None:
    raw = msgspec.msgpack.encode([2.0, [{"type": "BlockPinned", "x": 1},
                                        {"type": "AllBlocksCleared", "future_field": [1, 2]},
                                        ["SomethingNew", 1]], 3])
    batch = decode_batch(raw)
    assert batch.events == [Cleared()] and batch.dp_rank == 3


@pytest.mark.parametrize("payload", [
    b"\xc1", msgspec.msgpack.encode({"nope": 1}), msgspec.msgpack.encode([1.0]),
    msgspec.msgpack.encode(["ts", []]), msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
    msgspec.msgpack.encode([1.0, [["BlockStored", [1], None]]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [True]}]]),
])
def test_garbage_is_a_wire_error(payload: bytes) -> None:
    with pytest.raises(WireError):
        decode_batch(payload)


def test_frames() -> None:
    seq = (7).to_bytes(8, "big")
    assert split_pub([b"", seq, b"p"]) == (7, b"p")
    assert split_replay([b"", seq, b"p"]) == (7, b"p")  # vLLM <= 0.11
    assert split_replay([b"", b"topic", seq, b"p"]) == (7, b"p")  # newer
    assert split_replay([b"", b"", (-1).to_bytes(8, "big", signed=True), b""])[0] == -1
    with pytest.raises(WireError):
        split_pub([seq, b"p"])
    with pytest.raises(WireError):
        split_pub([b"", b"short", b"p"])
