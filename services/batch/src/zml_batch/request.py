"""A batch line as the request the routers get (pure).

The line's ``body`` is sent as uploaded, with the batch's policy added when the body names
none (``policy`` or ``routing`` of its own win): the runner publishes on ``zml.infer`` like any
raw NATS client, where ZML's fields travel in the body (docs/nats-api.md). The policy is
spliced in front of the body's first key, so the body is never re-encoded.

    line = parse(raw)                       # custom_id, model, the body to send
    body = with_policy(line.body, b'"cheap"', line.has_policy)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from zmlcore.messages.batch import input_line_decoder


class _Peek(msgspec.Struct):
    """The few body fields the runner reads (the rest is skipped, not decoded)."""

    model: str = ""
    policy: Any = None
    routing: Any = None


_peek = msgspec.json.Decoder(_Peek)


@dataclass(frozen=True, slots=True)
class Line:
    custom_id: str
    model: str
    body: bytes
    has_policy: bool


def parse(raw: bytes) -> Line:
    """One uploaded line (checked at upload, so it decodes; raises msgspec errors if not)."""
    line = input_line_decoder.decode(raw)
    body = bytes(line.body)
    peek = _peek.decode(body)
    return Line(line.custom_id, peek.model, body, peek.policy is not None or peek.routing is not None)


def policy_field(name: str, inline: dict[str, Any] | None) -> bytes:
    """The ``"policy": ...`` (or ``"routing": ...``) member to add: a name, or an inline policy."""
    if inline is not None:
        return b'"policy":' + msgspec.json.encode(inline)
    return b'"routing":' + msgspec.json.encode(name)


def with_policy(body: bytes, member: bytes, has_policy: bool) -> bytes:
    """``body`` with ``member`` as its first key, unless it names its own policy."""
    if has_policy or not member:
        return body
    start = body.index(b"{") + 1
    rest = body[start:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    return body[:start] + member + sep + body[start:]
