"""The record of one request's answer across its attempts (:class:`Answer`), and the nodes an
answer was continued from, as routing metadata says them."""

from __future__ import annotations



from zmlcore.messages import InferRequest, StreamResume
from zmlcore.messages.audio import AudioRequest
from zmlcore.reply.transcript import Sent, Transcript

from zml_router.answer import assemble
from zml_router.answer.assemble import Assembler
from zml_router.answer.continuation import Splice


class Answer:
    """One request's answer across its attempts: whether the requester has the stream's
    ``start``, the last sequence number sent, the chunks relayed (for a continuation: what was
    sent), and the splice of a continuation attempt."""

    __slots__ = ("started", "seq", "transcript", "splice", "usage_asked", "ttft", "assembler", "timings", "fed")

    def __init__(self, usage_asked: bool = False, assembler: Assembler | None = None) -> None:
        self.started = False
        #: A non-streamed answer asked of the nodes as a stream and put back together here.
        self.assembler = assembler
        #: The answer's first token (seconds after the request arrived), whichever attempt sent it.
        self.ttft: float | None = None
        self.seq = 0
        self.transcript = Transcript()
        self.splice: Splice | None = None
        #: The requester asked for the usage chunk (stream_options.include_usage).
        self.usage_asked = usage_asked
        #: The chunk that carried the engine's own timings (llama-server's last), if any: the
        #: speed sample of the attempt reads them (zml_router.node.relay).
        self.timings: bytes | None = None
        #: The router's running total of prompt tokens sent to the answering node when its
        #: first token came (zml_router.node.relay's ``fed``; the speed sample's).
        self.fed = 0.0

    def sent(self) -> Sent:
        """What the requester has of this answer, whichever way it travels: the reply put back
        together so far (a non-streamed request asked of its node as a stream), else the stream
        relayed to it. The one place the rest of the router reads it from."""
        return self.assembler.sent() if self.assembler is not None else self.transcript.sent()

    def resume(self, r: StreamResume) -> Sent:
        """Start from what the requester of a stream whose router died has (zmlcore.reply.resume):
        its ``start`` went out, numbering goes on from its last message."""
        sent = Sent(text=r.text, tokens=r.tokens, chunk_id=r.chunk_id, created=r.created, finished=r.finished,
                    usage=r.usage, blocked=r.blocked)
        self.started = True
        self.seq = r.seq
        self.transcript = Transcript(sent)
        return sent


def answer_for(req: InferRequest | AudioRequest, raw: bytes = b"", stream_from_nodes: bool = True) -> Answer:
    """The record of one request's answer, before its first attempt. A non-streamed chat or
    completion is asked of its nodes as a stream and put back together (zml_router.answer.assemble)
    unless its model says ``stream_from_nodes = false`` or its body asks what only a whole
    reply gives (``assemble.wanted``)."""
    opts = getattr(req, "stream_options", None)
    kind = req.kind()
    asm = (Assembler(kind) if not req.stream and kind in ("chat", "completion") and stream_from_nodes
           and assemble.wanted(raw) else None)
    return Answer(usage_asked=isinstance(opts, dict) and bool(opts.get("include_usage")), assembler=asm)


def continued_from(failed: list[tuple[str, int, str]]) -> str | None:
    """``Outcome.continued_from`` (node, tokens of the answer so far when it failed, failure)
    as ``RoutingInfo.continued_from``: ``node@tokens:failure``, each node's share, comma-separated.

    >>> continued_from([("a", 5, "network"), ("b", 12, "slow")])
    'a@5:network,b@7:slow'
    """
    if not failed:
        return None
    out, before = [], 0
    for node_id, upto, failure in failed:
        out.append(f"{node_id}@{max(0, upto - before)}:{failure}")
        before = max(before, upto)
    return ",".join(out)


def resumed_from(r: StreamResume) -> list[tuple[str, int, str]]:
    """``Outcome.continued_from`` of a stream whose router died: the continuations its routing
    said before (``RoutingInfo.continued_from``, each node's share) and the node that was
    relaying when the router went (failure ``router``), as tokens of the answer so far.

    >>> resumed_from(StreamResume(text="x", tokens=20, seq=21, node_id="c", continued_from="a@5:network,b@7:slow"))
    [('a', 5, 'network'), ('b', 12, 'slow'), ('c', 20, 'router')]
    """
    out: list[tuple[str, int, str]] = []
    upto = 0
    for part in (r.continued_from or "").split(","):
        node, at, rest = part.rpartition("@")
        share, _, failure = rest.partition(":")
        if node and share.isdigit():
            upto += int(share)
            out.append((node, upto, failure))
    out.append((r.node_id or "unknown", max(r.tokens, upto), "router"))
    return out
