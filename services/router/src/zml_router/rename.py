"""The reply's ``model`` is the name the client asked for, not the engine's.

A node with ``served_names`` is sent the engine's own name for a model (a GGUF path, the path
vLLM was started with) and answers with it. The router forwards the node's bytes as they are,
so the rename is a targeted byte edit of the ``"model"`` value: find ``"model"``, skip the
colon and whitespace, compare the value with the JSON string of the engine's name, splice. No
regex and no decode of the body; a body where that fails (an engine escaping ``/`` as ``\\/``,
say) is decoded once and re-encoded with the top-level ``model`` replaced.

>>> r = Renamer("/models/llama.gguf", "llama-3-8b")
>>> r(b'{"id":"x","model": "/models/llama.gguf","choices":[]}')
b'{"id":"x","model": "llama-3-8b","choices":[]}'
"""

from __future__ import annotations

import msgspec

_KEY = b'"model"'
_WS = b" \t\r\n"
_encode = msgspec.json.encode
_decode = msgspec.json.Decoder()


class Renamer:
    """Replace ``engine_name`` by ``asked`` as a reply's (or stream chunk's) ``model``."""

    __slots__ = ("engine", "asked", "engine_json", "asked_json")

    def __init__(self, engine_name: str, asked: str) -> None:
        self.engine = engine_name
        self.asked = asked
        self.engine_json = _encode(engine_name)
        self.asked_json = _encode(asked)

    def __call__(self, body: bytes) -> bytes:
        if _KEY not in body:
            return body  # a chunk without "model" (some engines' last chunks)
        start = 0
        while (k := body.find(_KEY, start)) >= 0:
            start = k + len(_KEY)
            i = start
            n = len(body)
            while i < n and body[i] in _WS:
                i += 1
            if i >= n or body[i] != 0x3A:  # ':' -- the word in a value, not a key
                continue
            i += 1
            while i < n and body[i] in _WS:
                i += 1
            if body.startswith(self.engine_json, i):
                return body[:i] + self.asked_json + body[i + len(self.engine_json):]
        return self._slow(body)

    def _slow(self, body: bytes) -> bytes:
        try:
            data = _decode.decode(body)
        except msgspec.DecodeError:
            return body
        if isinstance(data, dict) and data.get("model") == self.engine:
            data["model"] = self.asked
            return _encode(data)
        return body
