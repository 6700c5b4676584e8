"""The body a node gets: the caller's bytes untouched when nothing must change, else rewritten
once per model name the nodes know the model by.

A request is forwarded as it came unless (a) it still carries ZML's own fields (a raw
``zml.infer`` body; the gateway moves them to headers: zmlcore.messages.frontdoor) or (b) the node must
see another model name (an alias, or a node's ``served_names`` engine name). Then the body is
decoded once, and each distinct name is encoded once (a failover to a node with another
engine name re-encodes, never re-decodes).
"""

from __future__ import annotations

from typing import Any

import msgspec

from zmlcore.messages.frontdoor import drop_zml_keys, has_zml_keys

_decode_any = msgspec.json.Decoder()
_encode = msgspec.json.encode


class NodeBodies:
    """``bodies(name)``: the body naming model ``name``, for a request asking for ``asked``;
    ``clean``: ZML's fields are already out of ``raw`` (a front-door body)."""

    __slots__ = ("raw", "asked", "clean", "_data", "_made")

    def __init__(self, raw: bytes, asked: str, clean: bool) -> None:
        self.raw = raw
        self.asked = asked
        self.clean = clean
        self._data: dict[str, Any] | None = None
        self._made: dict[str, bytes] = {}

    def __call__(self, name: str) -> bytes:
        body = self._made.get(name)
        if body is None:
            if name == self.asked and (self.clean or not has_zml_keys(self.raw)):
                body = self.raw  # nothing of ours to strip, the name the node knows: as it came
            else:
                data = self._data
                if data is None:
                    data = _decode_any.decode(self.raw)
                    self._data = data if self.clean else drop_zml_keys(data)
                data["model"] = name
                body = _encode(data)
            self._made[name] = body
        return body
