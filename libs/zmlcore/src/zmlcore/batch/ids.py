"""Identifiers of the Batch API (pure).

File and batch ids sort by creation time (milliseconds first, then randomness), so a list
newest-first is a sort by id. An owner (the API key's identity) becomes a KV key token by a
hash: tokens are short and safe, and a record's key names its owner, so another owner asking
for the same id asks for a key that does not exist.

    >>> len(new_batch_id(1700000000.0))
    30
    >>> line_request_id("batch_018bcfe5680000abcdef012345", 7)
    'batch_018bcfe5680000abcdef012345-7'
"""

from __future__ import annotations

import hashlib
import os
import re

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
#: The owner of everything when the gateway has no API keys (one tenant: whoever can reach it).
ANONYMOUS = "anonymous"
_ID = re.compile(r"^(file-|batch_)[0-9a-f]{24}$")


def _stamp(now: float) -> str:
    return f"{int(now * 1000):012x}{os.urandom(6).hex()}"


def new_file_id(now: float) -> str:
    return FILE_PREFIX + _stamp(now)


def new_batch_id(now: float) -> str:
    return BATCH_PREFIX + _stamp(now)


def valid_id(value: str, prefix: str) -> bool:
    """Is ``value`` an id of ours with ``prefix``? (Anything else is a 404 without a lookup:
    it may not even be a valid KV key.)"""
    return value.startswith(prefix) and _ID.match(value) is not None


def owner_token(owner: str) -> str:
    """The KV key token of an owner identity."""
    return "o" + hashlib.sha256(owner.encode()).hexdigest()[:24]


def line_request_id(batch_id: str, line: int) -> str:
    """The request id a line is dispatched with: the same on every attempt and every runner,
    so the routers refuse a second copy while one is in flight (DUPLICATE_REQUEST_ID)."""
    return f"{batch_id}-{line}"


def output_line_id(batch_id: str, line: int) -> str:
    """``id`` of a line in the output file: stable, so a rebuilt file is the same file."""
    return "batch_req_" + hashlib.sha256(f"{batch_id}:{line}".encode()).hexdigest()[:24]
