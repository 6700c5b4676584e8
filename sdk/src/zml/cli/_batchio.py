"""What both ways of running a batch file share (`zml batch`, and `zml batch --server`): reading
its items, and the progress bar."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO, Any

from zml._errors import BadRequestError

__all__ = ["Progress", "read_audio_items", "read_items"]


def _lines(path: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-empty line: its JSON, or its text when it is not JSON."""
    try:
        fh = open(path, encoding="utf-8")
    except OSError as exc:
        raise BadRequestError(f"cannot read {path}: {exc.strerror or exc}") from exc
    with fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if not line:
                continue
            try:
                yield lineno, json.loads(line)
            except ValueError:
                yield lineno, line


def read_items(path: str, chat: bool) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    for lineno, value in _lines(path):
        if isinstance(value, str):
            value = {"messages": [{"role": "user", "content": value}]} if chat else {"prompt": value}
        if not isinstance(value, dict) or ("prompt" not in value and "messages" not in value):
            raise BadRequestError(f"{path}:{lineno}: expected a prompt string or an object with prompt/messages")
        items.append(value)
    return items


def read_audio_items(path: str) -> list[dict[str, Any]]:
    """The lines of an audio batch: file paths (plain or JSON strings) or objects with ``file``;
    a relative path is taken from the input file's folder (the list travels with its audio): the
    path opened is ``_path``, ``file`` stays as written (the output rows quote it)."""
    items: list[dict[str, Any]] = []
    folder = os.path.dirname(os.path.abspath(path))
    for lineno, value in _lines(path):
        if isinstance(value, str):
            value = {"file": value}
        if not isinstance(value, dict) or not isinstance(value.get("file"), str) or not value["file"]:
            raise BadRequestError(f"{path}:{lineno}: expected an audio file's path or an object with `file`")
        items.append({**value, "_path": os.path.join(folder, os.path.expanduser(value["file"]))})
    return items


class Progress:
    """A progress bar with rate and ETA on stderr; plain lines when stderr is not a TTY."""

    def __init__(self, total: int, already: int, stream: IO[str] | None = None) -> None:
        self.total, self.already = total, already
        self.ok = self.err = 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()

    def line(self, now: float) -> str:
        done = self.already + self.ok + self.err
        run = self.ok + self.err
        elapsed = max(now - self.started, 1e-9)
        rate = run / elapsed
        left = self.total - done
        eta = "0s" if left <= 0 else (f"{left / rate:.0f}s" if rate > 0 else "?")
        pct = 100.0 * done / self.total if self.total else 100.0
        text = f"{done}/{self.total} ({pct:.0f}%) ok={self.already + self.ok} err={self.err} {rate:.1f} req/s ETA {eta}"
        if self.tty:
            width = 30
            fill = int(width * done / self.total) if self.total else width
            return f"\r[{'#' * fill}{'.' * (width - fill)}] {text}\x1b[K"
        return f"zml batch: {text}\n"

    def set(self, ok: int, err: int) -> None:
        """Counts from elsewhere (a server-side batch's); drawn at the same pace as update()."""
        with self._lock:
            self.ok, self.err = ok, err
            now = time.monotonic()
            if now - self.last >= (0.1 if self.tty else 2.0):
                self.last = now
                self.stream.write(self.line(now))
                self.stream.flush()

    def update(self, ok: bool) -> None:
        with self._lock:
            if ok:
                self.ok += 1
            else:
                self.err += 1
            now = time.monotonic()
            if now - self.last >= (0.1 if self.tty else 2.0):
                self.last = now
                self.stream.write(self.line(now))
                self.stream.flush()

    def finish(self) -> None:
        self.stream.write(self.line(time.monotonic()) + ("\n" if self.tty else ""))
        self.stream.flush()
