"""What `zml up` prints when a node changes state: one line per transition (down with the health
service's reason, up again with how long it was out, loading, added, removed), read from the
health service (``zml.admin.nodes.list``) every second by a thread of its own.

:class:`Transitions` is the pure part: states in, lines out (time passed in).

>>> from zmlcore.messages import NodeState
>>> t = Transitions()
>>> def st(status, reason=""):
...     return NodeState(node_id="h1", accelerator_type="cpu", family="CPU", endpoint="http://h1",
...                      status=status, reason=reason, last_ok=99.0)
>>> t.update([st("up")], now=100.0)
[]
>>> t.update([st("down", "connection refused")], now=101.5)
['node h1 down: connection refused (last answered 2.5 s ago)']
>>> t.update([st("up")], now=110.0)
['node h1 up again (out for 8.5 s)']
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from zmlcore.messages import NodeState

#: How often the health service is asked.
WATCH_S = 1.0
_OUT = ("down", "invalid")


@dataclass(slots=True)
class _Seen:
    status: str
    #: When it left "up" (0 while up, or never up).
    out_since: float = 0.0
    ever_up: bool = False


class Transitions:
    """Each node's last status; :meth:`update` says what changed."""

    def __init__(self) -> None:
        self.seen: dict[str, _Seen] = {}
        self._first = True

    def update(self, nodes: list[NodeState], now: float) -> list[str]:
        lines: list[str] = []
        first, self._first = self._first, False
        for st in sorted(nodes, key=lambda s: s.node_id):
            prev = self.seen.get(st.node_id)
            status = st.status
            why = f": {st.reason}" if st.reason else ""
            if prev is None:
                self.seen[st.node_id] = _Seen(status, 0.0 if status == "up" else now, status == "up")
                if not first:
                    lines.append(f"node {st.node_id} added ({status}{why})")
                elif status in _OUT:  # already out when `zml up` became ready: say so once
                    lines.append(f"node {st.node_id} {status}{why}")
                continue
            if status == prev.status or status == "unknown":
                continue
            if status == "up":
                if prev.ever_up or prev.status in _OUT:
                    lines.append(f"node {st.node_id} up again" +
                                 (f" (out for {now - prev.out_since:.1f} s)" if prev.out_since else ""))
                prev.out_since, prev.ever_up = 0.0, True
            else:
                if prev.status == "up":
                    prev.out_since = now
                if status in _OUT:
                    last = f" (last answered {now - st.last_ok:.1f} s ago)" if st.last_ok else ""
                    lines.append(f"node {st.node_id} {status}{why}{last}")
                elif status == "loading" and prev.ever_up:
                    lines.append(f"node {st.node_id} loading{why}")
            prev.status = status
        for node_id in sorted(set(self.seen) - {st.node_id for st in nodes}):
            del self.seen[node_id]
            lines.append(f"node {node_id} removed")
        return lines


class NodeWatch:
    """The watching thread: ``NodeWatch(url, options, say).start()``, ``.stop()`` at the end.
    ``options``: nats-py connect options (identity, TLS); ``say`` prints one line."""

    def __init__(self, url: str, options: dict[str, Any], say: Callable[[str], None]) -> None:
        self.url = url
        self.options = options
        self.say = say
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), name="zml-up-nodes", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=3 * WATCH_S)

    async def _run(self) -> None:
        import time

        from zmlcore.bus.connect import connect
        from zmlcore.fleet.registry import list_nodes

        transitions = Transitions()
        nc = None
        try:
            while not self._stop.is_set():
                try:
                    if nc is None:
                        nc = await connect(self.url, "zml-up-nodes", quiet=True, give_up_s=WATCH_S, **self.options)
                    for line in transitions.update(await list_nodes(nc, timeout=2 * WATCH_S), time.time()):
                        self.say(line)
                except Exception:  # health restarting, a broker blink: the next round asks again
                    pass
                await asyncio.sleep(WATCH_S)
        finally:
            if nc is not None:
                await nc.close()
