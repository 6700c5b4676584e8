"""A machine-wide record of the ports ZML processes picked for servers not bound yet.

``listen_ports`` picks a free port for a server another process binds seconds later (`zml up`'s
metrics ports, a test stack's nodes). Between the pick and the bind the port looks free to
everyone, so two processes picking at once (two `zml up`, a test worker beside another) could
pick the same one, and the second server to start died on "address already in use" (seen in
CI: a health service's metrics port, 5 s after `zml up` picked it). Each process already
remembered its own picks; this file remembers everyone's for :data:`HOLD_S` seconds.

One file in the temp directory, ``port:time`` tokens, read and rewritten under an exclusive
``flock``. Where the file cannot be opened or locked (another user's, no ``fcntl``), a pick is
not recorded machine-wide and only the process's own memory applies, as before.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: the per-process memory only
    fcntl = None  # type: ignore[assignment]

#: Seconds a pick stays recorded: longer than any service takes to start and bind.
HOLD_S = 120.0
PATH = Path(tempfile.gettempdir()) / "zml-picked-ports"


def claim(ports: Iterable[int], *, path: Path | None = None, now: float | None = None) -> bool:
    """Record ``ports`` as picked; False if any of them was picked by some process within
    :data:`HOLD_S` (then nothing is recorded). True also when there is no shared record."""
    if fcntl is None:
        return True
    wanted = list(ports)
    t = time.time() if now is None else now
    try:
        fd = os.open(PATH if path is None else path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "r+") as f:
            held: dict[int, float] = {}
            for token in f.read().split():
                port, _, at = token.partition(":")
                try:
                    if t - float(at) < HOLD_S:
                        held[int(port)] = float(at)
                except ValueError:
                    continue  # a torn or foreign line: dropped on this rewrite
            if any(p in held for p in wanted):
                return False
            held.update((p, t) for p in wanted)
            f.seek(0)
            f.truncate()
            f.write(" ".join(f"{p}:{at:.1f}" for p, at in held.items()))
        return True
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the lock
