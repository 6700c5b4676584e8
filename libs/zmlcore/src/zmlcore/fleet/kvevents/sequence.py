"""One engine's KV-event stream put in order: a sans-I/O state machine. Pure.

vLLM numbers its PUB messages from 0 and keeps the last ``buffer_steps`` on a replay socket
(``zmlcore.fleet.kvevents.wire``). The subscriber feeds every live message to :meth:`Ordering.live`
and every replayed one to :meth:`Ordering.replayed`; each returns what to do, in order:

* :class:`Deliver` a payload (in sequence, each once);
* :class:`Replay` from a sequence number (a gap opened: ask the replay socket, hold live
  messages meanwhile);
* :class:`Reset` the node's cache state: events were lost for good (no replay socket, or the
  engine's buffer no longer holds them) or the engine restarted (its numbering went back).
  Applying the events that follow to an emptied state is safe; applying them over a state that
  missed a ``BlockRemoved`` is not (a router would send work to a node for a prefix it evicted).

A bridge that starts while the engine is already running (seq > 0 first) asks for a replay
from 0, so it learns what the engine's buffer still holds.

    order = Ordering(can_replay=True)
    for action in order.live(seq, payload):
        match action:
            case Deliver(): publish(action.payload)
            case Replay(): send_replay_request(action.start)
            case Reset(): publish_cleared(action.reason)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Deliver:
    seq: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class Replay:
    start: int


@dataclass(frozen=True, slots=True)
class Reset:
    reason: str


Action = Deliver | Replay | Reset


@dataclass(slots=True)
class Ordering:
    can_replay: bool
    #: The sequence number expected next (None: nothing received yet).
    next_seq: int | None = None
    #: Start of the replay in progress (None: none).
    replaying: int | None = None
    held: list[tuple[int, bytes]] = field(default_factory=list)
    #: Counters for metrics: delivered, replayed (delivered from the replay socket), resets.
    delivered: int = 0
    replayed_n: int = 0
    resets: int = 0

    def live(self, seq: int, payload: bytes) -> list[Action]:
        if self.replaying is not None:
            self.held.append((seq, payload))
            return []
        nxt = self.next_seq
        if nxt is None:
            if seq == 0 or not self.can_replay:
                return self._deliver(seq, payload)
            return self._start_replay(0, seq, payload)
        if seq == nxt:
            return self._deliver(seq, payload)
        if seq > nxt:
            if self.can_replay:
                return self._start_replay(nxt, seq, payload)
            return [self._reset(f"{seq - nxt} event batches lost (no replay socket)"), *self._deliver(seq, payload)]
        # A live message never repeats: numbering went back, so the engine restarted.
        reset = self._reset("the engine restarted")
        self.next_seq = None
        if seq == 0 or not self.can_replay:
            return [reset, *self._deliver(seq, payload)]
        return [reset, *self._start_replay(0, seq, payload)]

    def replayed(self, seq: int, payload: bytes) -> list[Action]:
        """A message from the replay socket; seq -1 ends the replay."""
        if self.replaying is None:
            return []  # a late answer to a replay given up on
        if seq < 0:
            return self.replay_done()
        out: list[Action] = []
        nxt = self.next_seq if self.next_seq is not None else self.replaying
        if seq < nxt:
            return []
        if seq > nxt and not (self.next_seq is None and nxt == 0):
            out.append(self._reset(f"event batches {nxt}..{seq - 1} are no longer in the engine's buffer"))
        self.replayed_n += 1
        out.extend(self._deliver(seq, payload))
        return out

    def replay_done(self) -> list[Action]:
        """The replay ended (its end marker, or the bridge gave up waiting): release held messages."""
        self.replaying = None
        held, self.held = self.held, []
        out: list[Action] = []
        for seq, payload in held:
            nxt = self.next_seq
            if nxt is not None and seq < nxt:
                continue
            if nxt is not None and seq > nxt:
                out.append(self._reset(f"event batches {nxt}..{seq - 1} were lost"))
            out.extend(self._deliver(seq, payload))
        return out

    def _start_replay(self, start: int, seq: int, payload: bytes) -> list[Action]:
        self.replaying = start
        self.held.append((seq, payload))
        return [Replay(start)]

    def _deliver(self, seq: int, payload: bytes) -> list[Action]:
        self.next_seq = seq + 1
        self.delivered += 1
        return [Deliver(seq, payload)]

    def _reset(self, reason: str) -> Reset:
        self.resets += 1
        return Reset(reason)
