"""What routers learn about the engines' prefix caches, on the wire.

* :class:`KvEventBatch` — a node's KV cache events (the *precise* fidelity), bridged into NATS
  from the engine's ZMQ publisher (vLLM / SGLang ``--kv-events-config``). The three event kinds
  carry the fields of vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``
  (``vllm.distributed.kv_events``) under the same names, so a bridge copies them over. Block
  hashes are the engine's (vLLM: ``int`` before 0.10, ``bytes`` since); the index does not
  interpret them (``zmlcore.policy.prefix``: events are applied in lockstep, by block count).
* :class:`PrefixRecord` — one router replica tells the others where it sent a prompt (the
  *approximate* fidelity, shared so that N replicas route as one), and optionally what the
  engine then reported of it (the *reported* fidelity).
"""

from __future__ import annotations

from typing import Union

import msgspec

#: An engine's block hash (vLLM < 0.10: int; >= 0.10: bytes, sha256-based).
BlockHash = Union[int, bytes]


class KvBlockStored(msgspec.Struct, tag="stored", kw_only=True, omit_defaults=True):
    """The engine cached full blocks (``parent_block_hash`` None: the chain's first)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    #: The blocks' tokens (a bridge may leave them out: the index only counts blocks).
    token_ids: list[int] = []
    #: Tokens per block (0: the batch's / node's).
    block_size: int = 0
    lora_id: int | None = None
    #: Storage tier: "GPU" (or None) is the device cache the router scores; "CPU" and others
    #: are offload tiers and are ignored for now.
    medium: str | None = None


class KvBlockRemoved(msgspec.Struct, tag="removed", kw_only=True, omit_defaults=True):
    """The engine evicted these blocks."""

    block_hashes: list[BlockHash]
    medium: str | None = None


class KvAllCleared(msgspec.Struct, tag="cleared", kw_only=True):
    """The engine dropped its whole cache (reset, restart)."""


KvEvent = Union[KvBlockStored, KvBlockRemoved, KvAllCleared]


class KvEventBatch(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One batch of a node's KV events, in the engine's order.

    ``seq`` is the engine publisher's sequence number (vLLM's ZMQ multipart sequence) so a
    consumer sees gaps; ``ts`` the engine's timestamp (unix seconds).
    """

    node_id: str
    events: list[KvEvent]
    seq: int = -1
    ts: float = 0.0
    #: The engine's tokens per block (vLLM ``block_size``); 0: unknown (per-event or node's).
    block_size: int = 0
    #: The model the engine serves (its cache keys are per model).
    model: str = ""
    #: The engine's data-parallel rank (vLLM ``data_parallel_rank``), when it has several.
    dp_rank: int | None = None


class PrefixRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A replica's routing decision for a prompt, shared with the other replicas.

    ``keys`` is the prompt's key chain packed as little-endian uint64
    (``zmlcore.policy.prefix.KeyChain.to_bytes``). ``cached_tokens`` >= 0 marks a correction
    (the engine reported that many cached tokens of ``prompt_tokens``), -1 a dispatch.
    """

    router_id: str
    node_id: str
    keys: bytes
    nbytes: int = 0
    ts: float = 0.0
    cached_tokens: int = -1
    prompt_tokens: int = 0


kv_event_batch_decoder = msgspec.json.Decoder(KvEventBatch)
kv_event_batch_msgpack_decoder = msgspec.msgpack.Decoder(KvEventBatch)
prefix_record_decoder = msgspec.json.Decoder(PrefixRecord)
