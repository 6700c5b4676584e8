"""The fences stay the only doors: outside zmlcore.bus.natsinternals and
zml_gateway.uvicorninternals, product code reads no private attribute of nats-py's or uvicorn's
objects and imports none of uvicorn's internal modules (read from the sources' syntax trees).

A private name counts when nats-py's or uvicorn's classes define or store it and ZML's own code
does not (``self._transport`` of the SDK's client is ZML's, not nats-py's): a new ``nc._pending``
or ``watcher._updates`` in a service fails here, naming the file and line."""

from __future__ import annotations

import ast
import dis
import functools
from pathlib import Path

import nats.aio.client
import nats.aio.subscription
import nats.aio.transport
import nats.js.client
import nats.js.kv
import nats.js.manager
import uvicorn.protocols.http.flow_control
import uvicorn.protocols.http.httptools_impl
import uvicorn.server

ROOT = Path(__file__).resolve().parents[2]
FENCES = {"natsinternals.py", "uvicorninternals.py"}
DEPENDENCY_CLASSES = (
    nats.aio.client.Client, nats.aio.subscription.Subscription, nats.js.kv.KeyValue, nats.js.kv.KeyValue.KeyWatcher,
    nats.js.client.JetStreamContext, nats.js.client.JetStreamContext.PushSubscription,
    nats.js.manager.JetStreamManager, nats.aio.transport.TcpTransport, nats.aio.transport.WebSocketTransport,
    uvicorn.protocols.http.httptools_impl.HttpToolsProtocol, uvicorn.protocols.http.httptools_impl.RequestResponseCycle,
    uvicorn.protocols.http.flow_control.FlowControl, uvicorn.server.Server, uvicorn.server.ServerState,
)
#: uvicorn modules its docs do not present (Config, Server and run are the API).
UVICORN_INTERNAL = ("uvicorn.protocols", "uvicorn.server", "uvicorn.lifespan", "uvicorn.loops", "uvicorn.middleware")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def dependency_privates() -> set[str]:
    out: set[str] = set()
    for cls in DEPENDENCY_CLASSES:
        for klass in cls.__mro__[:-1]:  # not object
            out |= {n for n in vars(klass) if _private(n)}
            code = getattr(vars(klass).get("__init__"), "__code__", None)
            if code is not None:
                out |= {str(i.argval) for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"
                        and _private(str(i.argval))}
    return out


@functools.cache  # both tests read the same sources (neither changes the trees): parsed once, ~1.5 CPU-s
def product_trees() -> list[tuple[Path, ast.Module]]:
    files = [p for d in ("libs", "services", "sdk") for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name]
    return [(p, ast.parse(p.read_text(), str(p))) for p in files]


def own_privates(trees: list[tuple[Path, ast.Module]]) -> set[str]:
    """Private names ZML's own code defines: methods, and attributes it assigns."""
    out: set[str] = set()
    for _, tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and _private(node.name):
                out.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and _private(node.attr):
                out.add(node.attr)
            elif (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                       for t in node.targets)):
                out |= {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant)
                        and isinstance(c.value, str) and _private(c.value)}
    return out


def test_no_private_attribute_of_nats_py_or_uvicorn_outside_the_fences() -> None:
    trees = product_trees()
    theirs = dependency_privates() - own_privates([(p, t) for p, t in trees if p.name not in FENCES])
    assert {"_pending_data_size", "_updates", "_jsm", "_flush_queue", "_pending_queue", "_start_asgi_task"} <= theirs
    found = []
    for path, tree in trees:
        if path.name in FENCES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in theirs:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr")
                  and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in theirs):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "dependency privates outside the fences (move them into the fence module):\n" + "\n".join(found)


def test_uvicorn_internal_modules_are_imported_by_the_fence_only() -> None:
    found = []
    for path, tree in product_trees():
        if path.name in FENCES:
            continue
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: {m}" for m in mods if m.startswith(UVICORN_INTERNAL)]
    assert not found, "\n".join(found)
