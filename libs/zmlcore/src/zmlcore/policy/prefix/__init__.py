"""Cache-aware routing: which prompt prefixes each node's engine holds. Pure: no I/O, time passed in.

One index per router, three fidelities behind one interface, chosen per node by what its
engine offers (docs/routing.md, "Cache-aware routing"):

* **approximate** — learned from the routers' own decisions: ``record`` after each dispatch,
  by the replica that dispatched and, shared over NATS (``PrefixRecord``), by every other;
  an LRU per node sized from its KV capacity (``NodeState.kv_blocks x kv_block_size`` from
  ``vllm:cache_config_info``, else the accelerator type's default), entries that expire;
* **reported** — ``correct`` with what the engine said it had cached
  (``usage.prompt_tokens_details.cached_tokens``, llama.cpp's ``timings.cache_n``): the
  prompt's entries are confirmed, and a miss on a confirmed prefix (an eviction) drops what
  the engine's LRU has dropped with it;
* **precise** — ``apply_events`` with the engine's KV events (vLLM/SGLang ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared``, ``zmlcore.messages.KvEventBatch``): clears and
  evictions applied in lockstep with the engine.

API::

    from zmlcore.policy.prefix import PrefixIndex, prompt_keys

    index = PrefixIndex()                          # one per router (ttl_s=, max_entries=)
    index.update_node(node_state)                  # every poll: block size and capacity
    chain = prompt_keys(model, messages=msgs)      # once per request (~10 us at 8k tokens)
    m = index.lookup(chain, now)                   # every node's matched prefix, O(log L)
    m.tokens("h100-1", prompt_tokens)              # that node's cached tokens, whole blocks
    choose_node(fleet, RouteRequest(..., prefix=chain), policy, now, state, cache=index)
    index.record(node_id, chain, now)              # after dispatching (and from peers)
    index.correct(node_id, chain, cached, now, prompt_tokens)   # the engine's report
    index.apply_events(node_id, kv_event_batch, now)            # the engine's KV events
    index.forget_node(node_id)                     # the node left the fleet

Keys are computed on the prompt's text, not token ids (``keys.py`` says why); a match is
converted into each node's own tokens: ``Match.tokens`` rounds down to whole blocks of that
node's engine, so the same chain reads 1,024 cached tokens on a 16-token-block H100 and 896
on a 128-token-block Gaudi2.
"""

from zmlcore.policy.prefix.index import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, Match, PrefixIndex
from zmlcore.policy.prefix.keys import (
    BLOCK_BYTES,
    KeyChain,
    chain_from_bytes,
    chain_from_header,
    chain_header,
    keyed,
    model_seed,
    prompt_keys,
    request_keys,
    serialise,
)
from zmlcore.policy.prefix.node import KV_DEFAULTS, NodeCache, kv_geometry

__all__ = [
    "BLOCK_BYTES",
    "DEFAULT_MAX_ENTRIES",
    "DEFAULT_TTL_S",
    "KV_DEFAULTS",
    "KeyChain",
    "Match",
    "NodeCache",
    "PrefixIndex",
    "chain_from_bytes",
    "chain_from_header",
    "chain_header",
    "keyed",
    "kv_geometry",
    "model_seed",
    "prompt_keys",
    "request_keys",
    "serialise",
]
