"""One shard's lines as a runner works through them (sans-I/O: no clock of its own, no NATS).

The runner (``zml_batch.worker``) asks :meth:`ShardRun.take` for the next line to send, and
reports how each attempt ended: :meth:`answered` (a result to record: the node's answer, or an
error that retrying cannot fix), :meth:`retry` (back in line after a delay: the fleet had no
room, the router or node failed), :meth:`recorded` once the result is durably stored. Lines
answered before this runner took the shard (it was taken over from a runner that died) are
given at the start and never sent again.

    run = ShardRun(task.first, len(task.lines), answered_before={3: (True, 20, 9)}, max_attempts=5)
    job = run.take(now)            # a Job, or None (nothing due now)
    run.answered(job.index, ok=True, prompt=12, completion=30)
    ...
    run.finished                   # every line answered (or stopped and nothing in flight)
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field


@dataclass(slots=True)
class Job:
    index: int  # the line's index in the batch
    attempt: int  # 1 on the first send


@dataclass(slots=True)
class ShardRun:
    first: int
    size: int
    #: index -> (ok, prompt tokens, completion tokens) of lines answered before we took over.
    answered_before: dict[int, tuple[bool, int, int]] = field(default_factory=dict)
    max_attempts: int = 5
    ok: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    stopped: str = ""
    _due: list[tuple[float, int]] = field(default_factory=list)  # (not before, index): a heap
    _attempts: dict[int, int] = field(default_factory=dict)
    _in_flight: set[int] = field(default_factory=set)
    _answered: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        for index, (ok, prompt, completion) in self.answered_before.items():
            self._answered.add(index)
            self._count(ok, prompt, completion)
        self._due = [(0.0, i) for i in range(self.first, self.first + self.size) if i not in self._answered]
        heapq.heapify(self._due)

    @property
    def counts(self) -> list[int]:
        """[completed, failed, prompt tokens, completion tokens]: the record's progress entry."""
        return [self.ok, self.failed, self.prompt_tokens, self.completion_tokens]

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def left(self) -> int:
        """Lines not answered yet (in flight included)."""
        return self.size - len(self._answered)

    @property
    def finished(self) -> bool:
        """Nothing more will happen: every line answered, or stopped with nothing in flight."""
        return not self._in_flight and (self.left == 0 or bool(self.stopped))

    def next_due(self) -> float | None:
        """When the next line may be sent (None: none waiting)."""
        return self._due[0][0] if self._due and not self.stopped else None

    def peek(self, now: float) -> int | None:
        """The line :meth:`take` would give now, left in place (None: nothing due)."""
        while self._due and self._due[0][1] in self._answered:  # answered elsewhere (learn)
            heapq.heappop(self._due)
        if self.stopped or not self._due or self._due[0][0] > now:
            return None
        return self._due[0][1]

    def learn(self, recorded: dict[int, tuple[bool, int, int]]) -> int:
        """Lines another runner recorded meanwhile (it was given this shard while we were cut
        off from the broker): they are not sent again. Returns how many were new to us."""
        new = 0
        for index, (ok, prompt, completion) in recorded.items():
            if not self.first <= index < self.first + self.size or index in self._answered \
                    or index in self._in_flight:
                continue  # ours in flight: its own result will be refused as a second one
            self._answered.add(index)
            self._count(ok, prompt, completion)
            new += 1
        return new

    def take(self, now: float) -> Job | None:
        if self.peek(now) is None:
            return None
        _, index = heapq.heappop(self._due)
        if index in self._answered:  # answered elsewhere meanwhile (learn): skipped
            return self.take(now)
        attempt = self._attempts.get(index, 0) + 1
        self._attempts[index] = attempt
        self._in_flight.add(index)
        return Job(index, attempt)

    def answered(self, index: int, *, ok: bool, prompt: int = 0, completion: int = 0) -> None:
        """The line has its result (recorded: call after the result is stored)."""
        self._in_flight.discard(index)
        if index in self._answered:
            return
        self._answered.add(index)
        self._count(ok, prompt, completion)

    def retry(self, index: int, not_before: float, *, counts: bool = True) -> bool:
        """Put the line back, to be sent no sooner than ``not_before``. ``counts``: the attempt
        reached a node (it counts toward max_attempts); a refusal for want of room does not.
        False when its attempts are used up (answer it as failed instead)."""
        self._in_flight.discard(index)
        if not counts:
            self._attempts[index] = self._attempts.get(index, 1) - 1
        elif self._attempts.get(index, 0) >= self.max_attempts:
            self._in_flight.add(index)  # still ours until answered
            return False
        heapq.heappush(self._due, (not_before, index))
        return True

    def stop(self, why: str) -> None:
        """No more lines start (the batch was cancelled or its window ended); those in flight
        finish and are recorded."""
        self.stopped = why

    def unanswered(self) -> list[int]:
        return [i for i in range(self.first, self.first + self.size) if i not in self._answered]

    def _count(self, ok: bool, prompt: int, completion: int) -> None:
        if ok:
            self.ok += 1
        else:
            self.failed += 1
        self.prompt_tokens += prompt
        self.completion_tokens += completion
