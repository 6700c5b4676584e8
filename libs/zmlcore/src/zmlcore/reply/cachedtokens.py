"""How many prompt tokens an engine says it served from its prefix cache, read from its reply
bytes without decoding them (a router reads every reply; most carry no such field). Pure.

* ``usage.prompt_tokens_details.cached_tokens``: vLLM (``--enable-prompt-tokens-details``),
  SGLang (``--enable-cache-report``), OpenAI's API, llama-server; in a stream, in the usage chunk.
* ``timings.cache_n``: llama-server, in a reply and in a stream's last chunks (preferred when
  both are present: it is llama-server's own count).

>>> cached_tokens(b'{"usage":{"prompt_tokens":900,"prompt_tokens_details":{"cached_tokens":768}}}')
768
>>> cached_tokens(b'{"timings":{"cache_n":299,"prompt_n":37}}')
299
>>> cached_tokens(b'{"usage":{"prompt_tokens":9}}') is None
True
"""

from __future__ import annotations

_FIELDS = (b'"cache_n":', b'"cached_tokens":')
_DIGITS = b"0123456789"


def _int_after(data: bytes, i: int) -> int | None:
    n = len(data)
    while i < n and data[i] in b" \t\r\n":
        i += 1
    j = i
    while j < n and data[j] in _DIGITS:
        j += 1
    return int(data[i:j]) if j > i else None


def cached_tokens(data: bytes) -> int | None:
    """The engine's cached prompt tokens in a reply body or stream chunk; None if it says nothing."""
    for field in _FIELDS:
        i = data.rfind(field)
        if i >= 0:
            value = _int_after(data, i + len(field))
            if value is not None:
                return value
    return None


def _float_after(data: bytes, i: int) -> float:
    n = len(data)
    while i < n and data[i] in b" \t\r\n":
        i += 1
    j = i
    while j < n and data[j] in b"0123456789.eE+-":
        j += 1
    try:
        return float(data[i:j]) if j > i else 0.0
    except ValueError:
        return 0.0


def engine_speeds(data: bytes) -> tuple[float, float]:
    """The engine's own per-request prefill and decode tokens/s (llama-server's ``timings``:
    ``prompt_per_second``, ``predicted_per_second``); 0 for what it does not say.

    >>> engine_speeds(b'{"timings":{"cache_n":0,"prompt_per_second":13950.5,"predicted_per_second":512.25}}')
    (13950.5, 512.25)
    """
    i = data.rfind(b'"prompt_per_second":')
    j = data.rfind(b'"predicted_per_second":')
    return (_float_after(data, i + 20) if i >= 0 else 0.0, _float_after(data, j + 23) if j >= 0 else 0.0)


def prompt_tokens(data: bytes) -> int | None:
    """``usage.prompt_tokens`` of the same reply (converts cached tokens to the prompt's share)."""
    i = data.rfind(b'"prompt_tokens":')
    return _int_after(data, i + 16) if i >= 0 else None
