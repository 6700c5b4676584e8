"""An engine's error answer in words: its message and kind out of the JSON it came in, so a
caller reads ``400 BadRequestError: This model's maximum context length is 8192 tokens...``
rather than escaped JSON. Pure.

Shapes read (the message may be cut: routers keep the first 500 bytes of an error body):

* OpenAI, vLLM, llama.cpp: ``{"error": {"message": ..., "type": ..., "code": ...}}``;
* vLLM before 0.10, SGLang: ``{"object": "error", "message": ..., "type": ..., "code": ...}``;
* TGI: ``{"error": "...", "error_type": "validation"}``;
* FastAPI servers: ``{"detail": "..."}`` or ``{"detail": [{"loc": [...], "msg": ...}]}``.

Anything else is returned as it came (stripped).

>>> engine_error(400, '{"error":{"message":"This model\\'s maximum context length is 8192 tokens.",'
...                   '"type":"BadRequestError","param":null,"code":400}}')
"400 BadRequestError: This model's maximum context length is 8192 tokens."
>>> engine_error(422, '{"error":"Input validation error: `max_new_tokens` must be > 0","error_type":"validation"}')
'422 validation: Input validation error: `max_new_tokens` must be > 0'
>>> engine_error(400, '{"error":{"code":400,"message":"the request exceeds the available context size, try incr')
'400: the request exceeds the available context size, try incr...'
>>> engine_error(500, "upstream connect error")
'500: upstream connect error'
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["engine_error", "engine_message"]

#: The first "message" (or TGI's "error", FastAPI's "detail") string of a body cut short.
_CUT = re.compile(r'"(message|error|detail|msg)"\s*:\s*"((?:[^"\\]|\\.)*)')
_CUT_TYPE = re.compile(r'"(?:type|error_type)"\s*:\s*"((?:[^"\\]|\\.)*)"')


def engine_message(body: str) -> tuple[str, str]:
    """(message, kind) of an engine's error body; kind "" when it names none, message the body
    itself when it is not one of the shapes above."""
    text = body.strip()
    try:
        data = json.loads(text)
    except ValueError:
        return _cut(text)
    if not isinstance(data, dict):
        return text, ""
    err: Any = data.get("error")
    if isinstance(err, dict):
        data = err
    elif isinstance(err, str) and err:
        return err, _text(data.get("error_type"))
    message = data.get("message")
    if isinstance(message, str) and message:
        return message, _text(data.get("type"))
    detail = data.get("detail")
    if isinstance(detail, str) and detail:
        return detail, ""
    if isinstance(detail, list) and detail and all(isinstance(d, dict) for d in detail):
        parts = [f"{'.'.join(str(p) for p in d.get('loc') or [])}: {d.get('msg', '')}".lstrip(": ") for d in detail]
        return "; ".join(parts), ""
    return text, ""


def engine_error(status: int, body: str) -> str:
    """``"STATUS KIND: message"`` of an engine's error answer (``"STATUS: message"`` without a kind)."""
    message, kind = engine_message(body)
    return f"{status} {kind}: {message}" if kind else f"{status}: {message}"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _cut(text: str) -> tuple[str, str]:
    """A JSON body cut short: its message as far as it goes."""
    m = _CUT.search(text)
    if m is None:
        return text, ""
    try:
        message = json.loads(f'"{m.group(2)}"')
    except ValueError:
        message = m.group(2)
    kind = _CUT_TYPE.search(text)
    whole = text[m.end():m.end() + 1] == '"'
    return message + ("" if whole else "..."), kind.group(1) if kind else ""
