"""The per-attempt first-byte timeout (pure: no I/O, no clock).

A node that accepts a connection and never answers would otherwise hold a request for its
whole timeout. Each attempt therefore gets a deadline for its first byte: the first token of
a stream, or the whole reply of a non-streamed request (an OpenAI server sends nothing before
it is done). The deadline is a multiple of what the node should need, from the same model the
policies use, with a floor so that a fast estimate never turns a small hiccup into a failover:

    streamed:      max(floor, factor x estimated TTFT)
    not streamed:  max(floor, factor x (estimated TTFT + max_tokens x seconds per token))

Past it the router abandons the attempt (closing the connection frees the node's slot), marks
the node slow, cools it down for every replica and fails over; a request that never sent a
byte to its caller loses nothing.
"""

from __future__ import annotations

from zmlcore.fleet.accelerators import DECODE_BATCH_PENALTY
from zmlcore.messages import NodeState
from zmlcore.policy.estimate import estimate_ttft, node_speeds


def expected_s(st: NodeState, outstanding: int, pending: int, prompt_tokens: int, max_tokens: int,
               stream: bool) -> float:
    """Seconds the node should need before its first byte reaches the router.

    >>> st = NodeState(node_id="n", accelerator_type="nvidia_h100", family="H100", endpoint="")
    >>> round(expected_s(st, 0, 0, 1000, 100, stream=True), 3)
    0.1
    >>> round(expected_s(st, 0, 0, 1000, 60, stream=False), 3)
    1.1
    """
    ttft = estimate_ttft(st, outstanding, pending, prompt_tokens)
    if stream:
        return ttft
    _, dec, maxc = node_speeds(st)
    batch = min(outstanding + 1, maxc)
    return ttft + max_tokens * (1.0 + DECODE_BATCH_PENALTY * (batch - 1)) / dec


def first_byte_timeout(expected: float, floor_s: float, factor: float) -> float:
    """The attempt's deadline for its first byte, in seconds.

    >>> first_byte_timeout(0.1, floor_s=5.0, factor=4.0)
    5.0
    >>> first_byte_timeout(3.0, floor_s=5.0, factor=4.0)
    12.0
    """
    return max(floor_s, factor * expected)
