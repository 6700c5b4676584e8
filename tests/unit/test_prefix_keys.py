"""Prompt key chains: computed once per request, the same in every router replica."""

from __future__ import annotations

import random

from zmlcore.messages import ChatMessage
from zmlcore.policy.prefix import BLOCK_BYTES, KeyChain, chain_from_bytes, prompt_keys, serialise
from zmlcore.policy.prefix.keys import KEY_BLOCKS, KEY_ENDS, MAX_BLOCKS


def text(n: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("abcdefghij klmnop\n") for _ in range(n))


def test_a_follow_up_turn_shares_every_key_of_the_previous_one() -> None:
    turn1 = [{"role": "system", "content": text(3000)}, {"role": "user", "content": text(900, 2)}]
    turn2 = [*turn1, {"role": "assistant", "content": text(1200, 3)}, {"role": "user", "content": text(400, 4)}]
    a, b = prompt_keys("m", messages=turn1), prompt_keys("m", messages=turn2)
    assert len(a) == a.nbytes // BLOCK_BYTES and len(b) > len(a)
    assert b.keys[:len(a)] == a.keys


def test_a_change_moves_the_keys_from_its_block_on() -> None:
    base = text(20_000).encode()
    for block in (3, 11):
        at = block * BLOCK_BYTES + 100
        changed = base[:at] + b"#" + base[at + 1:]
        a, b = chain_from_bytes(base), chain_from_bytes(changed)
        first = sum(1 for end in KEY_ENDS if end <= at)  # keys that end before the change
        assert a.keys[:first] == b.keys[:first]
        assert all(x != y for x, y in zip(a.keys[first:], b.keys[first:]))


def test_models_never_share_keys_and_only_whole_blocks_are_keyed() -> None:
    p = text(5000)
    a, b = prompt_keys("m1", prompt=p), prompt_keys("m2", prompt=p)
    assert not set(a.keys) & set(b.keys)
    assert len(prompt_keys("m", prompt=p[: BLOCK_BYTES - 3])) == 0  # "m\0" + the prompt
    assert len(prompt_keys("m", prompt=p[: BLOCK_BYTES - 2])) == 1
    assert len(chain_from_bytes(b"x" * (BLOCK_BYTES * (MAX_BLOCKS + 10)))) == len(KEY_BLOCKS) == 32


def test_keys_are_fixed_across_processes_and_versions() -> None:
    """Every replica (and every version of them in a rolling upgrade) must compute the same
    keys, so the constants are pinned: a change here is a wire change (PrefixRecord)."""
    kc = prompt_keys("meta-llama/Llama-3.1-8B-Instruct", messages=[{"role": "user", "content": "a" * 1100}])
    assert kc.keys == [5498307415919626917, 3893993971243867379]


def test_messages_as_structs_or_dicts_and_content_parts_serialise_alike() -> None:
    parts = [{"type": "text", "text": "look at this"}, {"type": "image_url", "image_url": {"url": "data:x"}}]
    as_dicts = serialise([{"role": "user", "content": parts}])
    as_structs = serialise([ChatMessage(role="user", content=parts)])
    assert as_dicts == as_structs and b"look at this" in as_dicts and b"data:x" in as_dicts
    assert serialise([{"role": "user", "content": "é"}]) == "user\x00é\x01".encode()
    assert serialise(prompt=["first", "second"]) == b"first"
    assert serialise() == b""


def test_chains_travel_packed() -> None:
    kc = prompt_keys("m", prompt=text(4000))
    assert KeyChain.from_bytes(kc.to_bytes(), kc.nbytes) == kc


def reference_keys(data: bytes, seed: int = 0) -> list[int]:
    """The keys as the module docstring defines them, one block at a time in plain Python:
    key ``i`` = sum over blocks ``j < KEY_BLOCKS[i]`` of ``POS_j x digest_j`` mod 2^64, where
    ``digest_j`` is the block's little-endian 64-bit words dotted with ``C`` (the first one
    xor the seed)."""
    from zmlcore.policy.prefix.keys import _C, _POS

    m = 2**64
    c, pos = [int(x) for x in _C], [int(x) for x in _POS]
    n = min(len(data) // BLOCK_BYTES, MAX_BLOCKS)
    acc, out = 0, []
    for j in range(n):
        block = data[j * BLOCK_BYTES:(j + 1) * BLOCK_BYTES]
        d = sum(int.from_bytes(block[8 * w:8 * w + 8], "little") * c[w] for w in range(len(c))) % m
        if j == 0:
            d ^= seed
        acc = (acc + pos[j] * d) % m
        if j + 1 in KEY_BLOCKS:
            out.append(acc)
    return out


def test_the_vectorised_hash_is_the_definition() -> None:
    """The numpy hash (which skips the blocks past the last key) against the definition, for
    prompts ending inside and at the end of a key's span, with and without a seed."""
    rng = random.Random(5)
    for nblocks in (1, 7, 8, 9, 10, 11, 63, 64, 65, 79, 80, 81, MAX_BLOCKS + 3):
        data = rng.randbytes(nblocks * BLOCK_BYTES + rng.randrange(BLOCK_BYTES))
        for seed in (0, 0xDEADBEEF):
            assert chain_from_bytes(data, seed).keys == reference_keys(data, seed), (nblocks, seed)


class _Msg(dict):  # type: ignore[type-arg]
    pass


def test_serialise_is_role_nul_text_soh_whatever_the_messages_form() -> None:
    """The canonical bytes, written out: the dict fast path, dict subclasses, structs, a
    ``name``, no content, content parts."""
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi", "name": "ann"},
        _Msg(role="assistant", content=None),
        ChatMessage(role="user", content="yo"),
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"content": "no role"},
    ]
    want = "m\x00system\x00sys\x01user:ann\x00hi\x01assistant\x00\x01user\x00yo\x01user\x00a\x02b\x01\x00no role\x01"
    assert serialise(msgs, model="m") == want.encode()


def test_the_usual_chat_path_serialises_as_the_general_loop() -> None:
    """Plain dicts with text content take a shorter path (keys._usual_chat); any other message,
    wherever it is in the list, hands the whole list to the general loop: the same bytes."""
    base = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi \ud800 é"}]
    tails: list[dict[str, object]] = [
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "hi", "name": "ann"},
        {"role": "user", "content": None},
        {"role": "user", "content": [{"type": "text", "text": "a"}]},
        {"content": "no role"},
        {"role": "user"},
    ]
    for tail in tails:
        msgs = [*base, tail]
        # the same messages as structs: never the dict path
        structs = [_Msg(role=m.get("role", ""), content=m.get("content"), name=m.get("name")) for m in msgs]
        assert serialise(msgs, model="m") == serialise(structs, model="m"), tail
        assert serialise(msgs) == serialise(structs), tail


def test_a_chain_travels_in_a_header_and_only_for_its_model() -> None:
    from zmlcore.policy.prefix import chain_from_header, chain_header, request_keys

    msgs = [ChatMessage(role="system", content="s" * 9000), ChatMessage(role="user", content="q " * 400)]
    kc = request_keys("m", msgs, None)
    assert kc is not None and len(kc) > 8
    value = chain_header(kc, "m")
    assert value.isascii() and value.isprintable() and len(value) < 400  # a NATS header value
    assert chain_from_header(value, "m") == kc
    assert chain_from_header(value, "m2") is None
    # the router's form of the same request (dicts, decoded from raw JSON) keys alike
    assert request_keys("m", [{"role": m.role, "content": m.content} for m in msgs], None) == kc
    assert request_keys("m", None, "p" * 2000) == prompt_keys("m", prompt="p" * 2000)
    assert request_keys("m", None, None) is None and request_keys("m", None, {"x": 1}) is None
