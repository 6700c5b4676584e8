"""Write the KV-event fixtures from an engine's own classes: ``python make_fixtures.py ENGINE
VERSION PATH/TO/kv_events.py`` (vLLM: vllm/distributed/kv_events.py from that release's wheel,
``pip download vllm==VERSION --no-deps`` then unzip it; SGLang:
python/sglang/srt/disaggregation/kv_events.py at the commit named as VERSION).

vLLM's Struct classes (EventBatch, KVCacheEvent, BlockStored, BlockRemoved, AllBlocksCleared,
KVEventBatch) are taken from the file by their syntax tree and run with msgspec alone, so the
payloads below are the bytes that release's publisher sends for these events. The scenario is
fixed (SCENARIO); ``ENGINE-VERSION.json`` holds each payload in hex with the events it carries,
and tests/unit/test_kvevents_wire.py decodes them and checks ZML's encoder against them.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path
from typing import Any, Optional, Union

import msgspec

CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch")
CONSTANTS = ("MEDIUM_GPU",)
H1, H2, H3 = 0x1234_5678_9ABC_DEF0, 0xFEDC_BA98_7654_3210, 17  # one above 2**63: uint64 on the wire
SCENARIO: list[dict[str, Any]] = [
    {"ts": 1765000000.25, "events": [
        {"kind": "stored", "hashes": [H1, H2], "parent": None, "token_ids": list(range(100, 132)),
         "block_size": 16}]},
    {"ts": 1765000000.5, "events": [
        {"kind": "stored", "hashes": [H3], "parent": H2, "token_ids": list(range(200, 216)), "block_size": 16},
        {"kind": "removed", "hashes": [H1]}]},
    {"ts": 1765000001.0, "events": [{"kind": "cleared"}]},
]


def load_classes(path: Path) -> dict[str, Any]:
    tree = ast.parse(path.read_text())
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in CLASSES:
            keep.append(node)
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in CONSTANTS for t in node.targets):
            keep.append(node)
    ns: dict[str, Any] = {"msgspec": msgspec, "Any": Any, "Optional": Optional, "Union": Union,
                          "ExternalBlockHash": Union[bytes, int], "__name__": "vllm_kv_events"}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return ns


def build(ns: dict[str, Any], spec: dict[str, Any]) -> Any:
    fields_stored = set(ns["BlockStored"].__struct_fields__)
    fields_removed = set(ns["BlockRemoved"].__struct_fields__)
    events = []
    for ev in spec["events"]:
        if ev["kind"] == "stored":
            kw: dict[str, Any] = {"block_hashes": ev["hashes"], "parent_block_hash": ev["parent"],
                                  "token_ids": ev["token_ids"], "block_size": ev["block_size"], "lora_id": None}
            optional = {"medium": "GPU", "lora_name": None, "extra_keys": [None] * len(ev["hashes"]),
                        "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
            kw.update({k: v for k, v in optional.items() if k in fields_stored})
            events.append(ns["BlockStored"](**kw))
        elif ev["kind"] == "removed":
            for h in ev["hashes"]:  # vLLM emits one BlockRemoved per block
                kw = {"block_hashes": [h]}
                kw.update({k: v for k, v in {"medium": "GPU", "group_idx": 0}.items() if k in fields_removed})
                events.append(ns["BlockRemoved"](**kw))
        else:
            events.append(ns["AllBlocksCleared"]())
    batch_fields = ns["KVEventBatch"].__struct_fields__
    kw = {"ts": spec["ts"], "events": events}
    if "data_parallel_rank" in batch_fields:
        kw["data_parallel_rank"] = 0  # the publisher sets its rank on every batch it sends
    return ns["KVEventBatch"](**kw)


def main(engine: str, version: str, path: str) -> None:
    ns = load_classes(Path(path))
    enc = msgspec.msgpack.Encoder()
    out = {engine: version, "scenario": SCENARIO,
           "payloads": [enc.encode(build(ns, spec)).hex() for spec in SCENARIO]}
    dest = Path(__file__).with_name(f"{engine}-{version}.json")
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {dest.name}: {len(out['payloads'])} payloads")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
