"""vLLM's KV-event wire format (``--kv-events-config``), decoded and encoded. Pure.

A vLLM engine started with ``--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` sends,
once per scheduler step that changed its prefix cache, a ZMQ PUB message of three frames::

    [topic (utf-8, "" by default), seq (8 bytes big-endian, from 0), payload (msgpack)]

and keeps the last ``buffer_steps`` payloads for replay on a ROUTER socket: a DEALER/REQ peer
sends ``[b"", start_seq (8 bytes big-endian)]`` and gets every buffered batch with
``seq >= start_seq``, then an end marker whose seq is -1.

The payload is a msgspec ``KVEventBatch``. Two layouts exist and both are decoded here
(checked against bytes made with the engines' own classes: tests/data/kvevents/):

* **vLLM 0.9 - 0.11**: the batch *and* the events are arrays, an event's first element its tag:
  ``[ts, [["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium],
  ["BlockRemoved", hashes, medium], ["AllBlocksCleared"]], dp]``; a replayed message is
  ``[seq, payload]``.
* **SGLang** (``--kv-events-config``, its own copy of vLLM's early classes): the same arrays
  without ``medium`` and without the batch's ``dp``: ``[ts, [["BlockStored", hashes, parent,
  token_ids, block_size, lora_id], ["BlockRemoved", hashes], ...]]``; replays as vLLM 0.11.
* **vLLM 0.12 - 0.34** (the newest checked): the batch is still an array, the events are maps
  tagged by ``"type"``: ``{"type": "BlockStored", "block_hashes": [...], ...}``, with fields
  added release by release (``lora_name``, ``extra_keys``, ``group_idx``, ...); a replayed
  message is ``[topic, seq, payload]``.

Block hashes are unsigned 64-bit ints (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default)
or raw digests (bytes), which are folded to the same 64-bit int vLLM itself would send. Fields
this module does not use are ignored, so a newer release that adds fields still decodes.

Example::

    batch = decode_batch(payload)
    for ev in batch.events:
        match ev:
            case Stored(): ...
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

#: Every engine release whose bytes the tests decode (tests/data/kvevents/).
CHECKED_VLLM_VERSIONS = ("0.11.0", "0.34.0")
CHECKED_SGLANG_VERSIONS = ("006d053",)  # a commit of SGLang's main branch

_MASK64 = (1 << 64) - 1
END_SEQ = -1


class WireError(ValueError):
    """A payload that is not a KV-event batch in any known layout."""


# ----- the normalised events (what ZML keeps of them) -------------------------------------------


class Stored(msgspec.Struct, frozen=True, kw_only=True, tag="stored", array_like=True):
    """Blocks newly cached, in chain order: ``hashes[0]``'s parent is ``parent`` (None: the
    chain starts at the first block of a prompt), ``hashes[i]``'s parent is ``hashes[i-1]``."""

    hashes: list[int]
    parent: int | None = None
    #: Tokens of the stored blocks (``len(hashes) * block_size`` of them).
    token_ids: list[int] = []
    block_size: int = 0
    medium: str | None = None


class Removed(msgspec.Struct, frozen=True, kw_only=True, tag="removed", array_like=True):
    """Blocks evicted."""

    hashes: list[int]
    medium: str | None = None


class Cleared(msgspec.Struct, frozen=True, kw_only=True, tag="cleared", array_like=True):
    """Every block of the node is gone (``AllBlocksCleared``, a restarted engine, or events
    that were lost and could not be replayed: ``reason`` says which)."""

    reason: str = "cleared"


Event = Stored | Removed | Cleared


class Batch(msgspec.Struct, frozen=True, kw_only=True):
    ts: float
    events: list[Event]
    dp_rank: int | None = None


def _hash(value: Any) -> int:
    if isinstance(value, bool):
        raise WireError("a block hash is an int or bytes, not a bool")
    if isinstance(value, int):
        return value & _MASK64
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big") & _MASK64
    raise WireError(f"a block hash is an int or bytes, not {type(value).__name__}")


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise WireError("block_hashes is not a list")
    return [_hash(v) for v in value]


def _int(value: Any, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise WireError(f"{what} is not an int")
    return value


def _ints(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise WireError(f"{what} is not a list of ints")
    return value


def _medium(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _event(raw: Any) -> Event | None:
    """One event in either layout; None for a tag this module does not know (skipped)."""
    if isinstance(raw, dict):  # vLLM >= 0.12: a map tagged by "type"
        kind = raw.get("type")
        if kind == "BlockStored":
            parent = raw.get("parent_block_hash")
            return Stored(hashes=_hashes(raw.get("block_hashes")),
                          parent=None if parent is None else _hash(parent),
                          token_ids=_ints(raw.get("token_ids", []), "token_ids"),
                          block_size=_int(raw.get("block_size", 0), "block_size"),
                          medium=_medium(raw.get("medium")))
        if kind == "BlockRemoved":
            return Removed(hashes=_hashes(raw.get("block_hashes")), medium=_medium(raw.get("medium")))
        if kind == "AllBlocksCleared":
            return Cleared()
        if isinstance(kind, str):
            return None
        raise WireError("an event map without a 'type' tag")
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # vLLM <= 0.11: [tag, fields...]
        kind, fields = raw[0], raw[1:]
        if kind == "BlockStored":
            if len(fields) < 4:
                raise WireError("BlockStored has fewer than 4 fields")
            parent = fields[1]
            return Stored(hashes=_hashes(fields[0]), parent=None if parent is None else _hash(parent),
                          token_ids=_ints(fields[2], "token_ids"), block_size=_int(fields[3], "block_size"),
                          medium=_medium(fields[5]) if len(fields) > 5 else None)
        if kind == "BlockRemoved":
            if not fields:
                raise WireError("BlockRemoved has no block_hashes")
            return Removed(hashes=_hashes(fields[0]), medium=_medium(fields[1]) if len(fields) > 1 else None)
        if kind == "AllBlocksCleared":
            return Cleared()
        return None
    raise WireError("an event is neither a tagged map nor a tagged array")


_raw = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> Batch:
    """A ``KVEventBatch`` payload in either layout (raises :class:`WireError`)."""
    try:
        raw = _raw.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):  # an EventBatch encoded as a map (no release does; be lenient)
        ts, events, dp = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        dp = raw[2] if len(raw) > 2 else None
    else:
        raise WireError("a batch is [ts, events, dp_rank?]")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise WireError("a batch is [ts, events, dp_rank?]")
    out = [e for e in (_event(r) for r in events) if e is not None]
    return Batch(ts=float(ts), events=out, dp_rank=dp if isinstance(dp, int) and not isinstance(dp, bool) else None)


def seq_of(frame: bytes) -> int:
    """The signed 8-byte big-endian sequence number of a PUB or replay message."""
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def split_pub(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a PUB message ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise WireError(f"a KV-event message has 3 frames, not {len(frames)}")
    return seq_of(frames[1]), frames[2]


def split_replay(frames: list[bytes]) -> tuple[int, bytes]:
    """``(seq, payload)`` of a replayed message as a DEALER receives it: ``[b"", seq, payload]``
    (vLLM <= 0.11) or ``[b"", topic, seq, payload]`` (newer); seq -1 ends the replay."""
    if frames and frames[0] == b"":
        frames = frames[1:]
    if len(frames) == 2:
        return seq_of(frames[0]), frames[1]
    if len(frames) == 3:
        return seq_of(frames[1]), frames[2]
    raise WireError(f"a replayed message has 2 or 3 frames after the delimiter, not {len(frames)}")


# ----- encoding, as vLLM 0.34 does (the simulated node's publisher) ---------------------------


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _SGLangBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Any]


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag_field="type"):
    pass


class _BlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _BlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


Layout = Literal["0.34", "0.11", "sglang"]
_enc = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[Event], *, dp_rank: int | None = 0, layout: Layout = "0.34") -> bytes:
    """The payload an engine sends for these events: byte for byte what vLLM 0.34 (or 0.11, or
    SGLang) encodes for a full-attention model on one GPU without LoRA (tests/data/kvevents/
    checks it)."""
    if layout == "sglang":
        rows_sg: list[Any] = []
        for ev in events:
            if isinstance(ev, Stored):
                rows_sg.append(["BlockStored", ev.hashes, ev.parent, ev.token_ids, ev.block_size, None])
            elif isinstance(ev, Removed):
                rows_sg.append(["BlockRemoved", ev.hashes])
            else:
                rows_sg.append(["AllBlocksCleared"])
        return _enc.encode(_SGLangBatch(ts=ts, events=rows_sg))
    if layout == "0.11":
        rows: list[Any] = []
        for ev in events:
            if isinstance(ev, Stored):
                rows.append(["BlockStored", ev.hashes, ev.parent, ev.token_ids, ev.block_size, None, ev.medium])
            elif isinstance(ev, Removed):
                rows.append(["BlockRemoved", ev.hashes, ev.medium])
            else:
                rows.append(["AllBlocksCleared"])
        return _enc.encode(_Batch(ts=ts, events=rows, data_parallel_rank=dp_rank))
    out: list[Any] = []
    for ev in events:
        if isinstance(ev, Stored):
            out.append(_BlockStored(block_hashes=ev.hashes, parent_block_hash=ev.parent, token_ids=ev.token_ids,
                                    block_size=ev.block_size, lora_id=None, medium=ev.medium, lora_name=None,
                                    extra_keys=[None] * len(ev.hashes), group_idx=0,
                                    kv_cache_spec_kind="full_attention"))
        elif isinstance(ev, Removed):
            # vLLM sends one BlockRemoved per evicted block.
            out.extend(_BlockRemoved(block_hashes=[h], medium=ev.medium, group_idx=0) for h in ev.hashes)
        else:
            out.append(_AllBlocksCleared())
    return _enc.encode(_Batch(ts=ts, events=out, data_parallel_rank=dp_rank))
