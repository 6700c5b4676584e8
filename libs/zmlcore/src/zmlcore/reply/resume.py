"""A stream that outlives its router: what the requester has received, and the ``Zml-Resume``
header that has another router continue the answer from there (sans-I/O, unit-tested).

The requester (the gateway's relay, the SDK's NATS transport: both through
:class:`zmlcore.reply.exchange.Exchange`) notices a dead router by its silence
(:mod:`zmlcore.reply.keepalive`). Before anything of the answer went out it sends the request
again; once content went out, a plain resend would start the answer again and repeat what the
client already has. Instead the resent request carries what was received
(:class:`~zmlcore.messages.StreamResume`: the text so far, the content chunks that carried it,
the last sequence number, the chunks' id, the node and attempts so far), and the router that
takes it continues the answer on a node exactly as it does when a *node* fails part-way
(``zml_router.answer.continuation``: the text as the assistant message's prefix, ``max_tokens``
reduced), numbering its messages from the next ``Zml-Seq`` and sending no second ``start``:
the requester splices nothing, its sequence check runs on. The router still refuses what cannot
be continued (``n > 1``, logprobs, a seed, tool-call deltas...), ending the stream with its
clean error.

:class:`Received` costs one list append per chunk message; the chunks are read only when a
resume is asked for (or folded now and then, so that a long answer holds its text, not its
chunks).

Example::

    got = Received()
    got.message(headers, data)      # start / chunk / events / end messages, as returned
    got.frame(data)                 # header-less frames (zmlcore.reply.streamframe)
    headers[subjects.H_RESUME] = encode(got.resume())
"""

from __future__ import annotations

import base64
import binascii

import msgspec

from zmlcore import subjects
from zmlcore.errors import BadRequestError
from zmlcore.messages import StreamResume, StreamStart
from zmlcore.reply.transcript import Transcript

#: Frames kept as received before they are folded into the text (at the next :meth:`Received.frame`
#: or message: frames the exchange records with :attr:`Received.add_frame` wait for one).
_FOLD_AT = 1024
#: The largest ``Zml-Resume`` value a router reads (a long answer's text, base64url): past it the
#: request is refused, never decoded.
MAX_HEADER_BYTES = 2 * 1024 * 1024

_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(StreamResume)
_start = msgspec.json.Decoder(StreamStart)


class Received:
    """What a requester has received of one streamed answer (see the module doc)."""

    __slots__ = ("_frames", "add_frame", "_transcript", "seq", "started", "ended", "broken", "_start")

    def __init__(self) -> None:
        self._frames: list[bytes] = []
        #: Record a header-less frame and nothing else (the list's own append: no Python call
        #: per chunk). For a caller that also calls :meth:`frame` or :meth:`message` between
        #: batches of these, which fold a long answer's frames into text.
        self.add_frame = self._frames.append
        self._transcript: Transcript | None = None  # made when a chunk is first read (most streams: never)
        #: The last sequence number received (``start`` is 0).
        self.seq = 0
        #: The ``start`` arrived (content may follow), the ``end`` or an error arrived.
        self.started = False
        self.ended = False
        #: A message was lost (a number skipped): what came after it is not what the caller
        #: has, so a continuation starts from before it.
        self.broken = False
        self._start = b""  # its body, read only for a resume

    def frame(self, data: bytes) -> None:
        """A header-less chunk frame, as returned to the caller (one append)."""
        frames = self._frames
        frames.append(data)
        if len(frames) >= _FOLD_AT:
            self._fold_frames()

    def message(self, headers: dict[str, str] | None, data: bytes) -> None:
        """A reply message with headers, as returned to the caller."""
        if headers is None:
            self.frame(data)
            return
        kind = headers.get(subjects.H_STREAM)
        if kind == "start":
            self.started = True
            self._start = data
            return
        if kind not in (subjects.STREAM_EVENTS, subjects.STREAM_CHUNK) and (
                kind is not None or subjects.H_ERROR_CODE in headers) and self._in_order(headers):
            # The end, or an error, with nothing lost before it: nothing will be continued, so
            # the frames' text is never read (folding it here cost every stream a parse of its
            # whole text at its end). After a gap the path below keeps what came before it.
            self.ended = True
            self._frames.clear()
            return
        self._fold_frames()
        if self.broken:
            return
        seq = headers.get(subjects.H_SEQ)
        if seq is not None and seq.isdigit():
            if int(seq) != self.seq + 1:
                self.broken = True
                return
            self.seq = int(seq)
        if kind == subjects.STREAM_EVENTS or kind == subjects.STREAM_CHUNK:
            t = self._read()
            t.begin(kind == subjects.STREAM_EVENTS)
            t.add(data)
        elif kind is not None or subjects.H_ERROR_CODE in headers:
            self.ended = True  # the end, or an error: nothing to continue

    def _in_order(self, headers: dict[str, str]) -> bool:
        """The frames held and this message continue the numbering with nothing lost: the
        first frame's and the last's numbers, their count and this message's number agree.
        Enough, as a core NATS subscription delivers at most once and in order (nothing comes
        twice, so a loss shows as numbers that do not add up), and it reads two numbers per
        stream instead of every frame's."""
        if self.broken:
            return False
        frames = self._frames
        n = self.seq + len(frames)
        if frames and (_frame_seq(frames[0]) != self.seq + 1 or _frame_seq(frames[-1]) != n):
            return False
        seq = headers.get(subjects.H_SEQ)
        return seq is None or not seq.isdigit() or int(seq) == n + 1

    def _read(self) -> Transcript:
        t = self._transcript
        if t is None:
            t = self._transcript = Transcript()
        return t

    def _fold_frames(self) -> None:
        if not self._frames:
            return
        t = self._read()
        t.begin(True)
        for data in self._frames:
            if self.broken:
                break
            i = data.find(b"\n")  # a frame: "<seq>\n<events>" (zmlcore.reply.streamframe)
            if i <= 0 or not data[:i].isdigit():
                self.broken = True  # not a frame: the caller ends the stream on it
                break
            n, events = int(data[:i]), data[i + 1:]
            if n != self.seq + 1:
                self.broken = True  # lost (or repeated): the caller has what came before
                break
            self.seq = n
            t.add(events)
        self._frames.clear()
        t.fold()

    def resume(self) -> StreamResume | None:
        """What to send another router so that it continues the answer, or None: nothing
        started (a plain resend starts it), or the answer ended already."""
        if not self.started or self.ended:
            return None
        self._fold_frames()
        sent = self._read().sent()
        node_id, attempts, continued_from = "", 0, None
        try:
            routing = _start.decode(self._start).routing
            node_id, attempts, continued_from = routing.node_id, routing.attempts, routing.continued_from
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # a start with the routing in headers only: the new router counts from 0
        self.broken = False  # the continuation numbers on from self.seq
        return StreamResume(text=sent.text, tokens=sent.tokens, seq=self.seq, chunk_id=sent.chunk_id,
                            created=sent.created, finished=sent.finished, usage=sent.usage, blocked=sent.blocked,
                            node_id=node_id, attempts=attempts, continued_from=continued_from)


def _frame_seq(data: bytes) -> int:
    """A frame's number (zmlcore.reply.streamframe: ``<seq>\\n<events>``), -1 if it is not a frame."""
    i = data.find(b"\n")
    return int(data[:i]) if i > 0 and data[:i].isdigit() else -1


def encode(resume: StreamResume) -> str:
    """The ``Zml-Resume`` header value: JSON, unpadded base64url (one ASCII line, whatever the text).

    >>> decode(encode(StreamResume(text="Hé\\n", tokens=2, seq=3))).text
    'Hé\\n'
    """
    return base64.urlsafe_b64encode(_encode(resume)).rstrip(b"=").decode("ascii")


def decode(value: str) -> StreamResume:
    """A ``Zml-Resume`` header value (BAD_REQUEST when it is not one)."""
    if len(value) > MAX_HEADER_BYTES:
        raise BadRequestError(f"{subjects.H_RESUME} is over {MAX_HEADER_BYTES} bytes")
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        out = _decode.decode(raw)
    except (binascii.Error, ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BadRequestError(f"{subjects.H_RESUME} could not be read: {exc}") from None
    if out.tokens < 0 or out.seq < 0 or out.attempts < 0:
        raise BadRequestError(f"{subjects.H_RESUME} holds a negative count")
    return out
