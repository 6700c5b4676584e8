"""What happened to one request, read for its error reply, its completion event, its metrics and
its trace. Written by the request's steps, not by the I/O that carries them out: intake (whose
request, its id), route (where it went, how each attempt ended, from the ``AttemptResult``
the node I/O returns) and the service for the one thing only it knows, the error it replied
with."""

from __future__ import annotations

from typing import Any

from zmlcore.messages import RoutingInfo


class Outcome:
    """What happened to one request, for its error reply, completion event and metrics."""

    __slots__ = ("request_id", "stream", "model", "node_id", "family", "ok", "error_code", "node_error",
                 "failed_nodes", "attempts", "info", "queued", "slow_nodes", "label", "op", "prompt_tokens",
                 "completion_tokens", "continued_from", "prefill_failed", "flow")

    def __init__(self) -> None:
        self.request_id = ""  # set once validated: it goes into subjects, headers and logs
        self.stream = False
        self.model = ""
        self.op = ""  # chat | completion | embedding
        self.node_id = ""
        self.family = ""
        self.ok = False
        self.error_code = ""
        self.node_error = False
        self.failed_nodes: list[str] = []
        self.slow_nodes: list[str] = []
        self.attempts = 0
        self.info: RoutingInfo | None = None
        self.queued = False  # parked in the saturation queue: its event comes when it is served
        self.label = ""  # the API key's cost-attribution label (gateway header)
        #: Nodes that failed part-way, the answer continued on the next: (node, tokens of the
        #: answer so far when it failed, failure).
        self.continued_from: list[tuple[str, int, str]] = []
        self.prompt_tokens = 0  # the node's usage, when it reported one
        self.completion_tokens = 0
        #: A split's prefill leg that failed, the request served whole on its decode node:
        #: ``node:failure`` (docs/disaggregation.md).
        self.prefill_failed: str | None = None
        #: Its flow control (zml_router.request.flowgate.Note), None for a plain request.
        self.flow: Any = None
