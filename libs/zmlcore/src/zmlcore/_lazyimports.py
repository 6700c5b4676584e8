"""Optional dependencies of our dependencies, loaded when first used instead of at start.

nats-py imports aiohttp (with yarl, multidict, frozenlist, attrs, ...) for its websocket
transport when ``nats.aio.transport`` loads. The router, the gateway and the health service never
use aiohttp otherwise, yet paid ~0.27 CPU-s each for it at every start (4 of a test stack's 5
services, ~40 stacks a test run, and every `zml` command that speaks NATS). So the module is
registered unloaded: ``import aiohttp`` then costs nothing, and the first use of any of its
attributes (a ``ws://`` server URL; the simulator's own aiohttp server) runs the module in place,
as the import would have.

``importlib.util.LazyLoader`` cannot do this on Python 3.11: the import statement itself reads
the module's ``__spec__``, which loads it.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from typing import Any

#: Imported by a dependency at its own import; used by ZML only on some paths.
DEFERRED = ("aiohttp",)

_lock = threading.RLock()


class _Unloaded(types.ModuleType):
    """A module whose code has not run yet: a missing attribute runs it (once), in this object."""

    def __getattr__(self, attr: str) -> Any:
        with _lock:
            if type(self) is _Unloaded:
                spec = self.__spec__
                assert spec is not None and spec.loader is not None
                self.__class__ = types.ModuleType  # type: ignore[assignment]
                if spec.submodule_search_locations is not None:  # submodules import from here on
                    self.__path__ = list(spec.submodule_search_locations)
                spec.loader.exec_module(self)
        return getattr(self, attr)


def defer(name: str) -> None:
    """Register ``name`` unloaded. A module already imported, or not installed, is left alone."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
        return
    module = importlib.util.module_from_spec(spec)
    module.__dict__.pop("__path__", None)  # importing a submodule must run the package first
    module.__class__ = _Unloaded
    sys.modules[name] = module


for _name in DEFERRED:
    defer(_name)
