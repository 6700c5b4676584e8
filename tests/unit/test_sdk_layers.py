"""The SDK's import layering, read from the source (every import, including those inside
functions): no circle between its modules, and no module imports one of a higher layer. The
fleet lookup in particular sits below the models and the transports (issue 18)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "sdk" / "src"

#: Top to bottom. A module may import its own layer's modules or lower ones, never higher ones.
LAYERS: list[tuple[str, ...]] = [
    ("zml", "zml.cli"),
    ("zml._client", "zml._async_client"),
    ("zml._transport_http", "zml._transport_nats", "zml._transport_grpc", "zml._batch", "zml._batches",
     "zml._settings"),
    ("zml._core",),
    ("zml._models", "zml._batch_models"),
    ("zml._fleet",),
    ("zml._config", "zml._ratelimit"),
    ("zml._errors",),
]


def _modules() -> dict[str, Path]:
    out = {}
    for path in (ROOT / "zml").rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The SDK modules ``name`` imports (a ``from pkg import mod`` names the module itself)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base)
    return {m for m in found if m in known and m != name}


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, set(mods)) for name, path in mods.items()}


def _layer(name: str) -> int:
    best = -1, -1  # (length of the matching prefix, layer)
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best[0]:
                best = len(prefix), i
    assert best[1] >= 0, f"{name} is in no layer of LAYERS: place it"
    return best[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_sdk_has_no_import_circle() -> None:
    graph = _graph()
    assert "zml._fleet" in graph and "zml._core.reply" in graph  # the reader sees the package
    assert _cycles(graph) == []


def test_no_sdk_module_imports_a_higher_layer() -> None:
    upward = [f"{a} -> {b}" for a, deps in sorted(_graph().items()) for b in sorted(deps) if _layer(b) < _layer(a)]
    assert upward == []


def test_the_fleet_lookup_imports_no_model_core_transport_or_client() -> None:
    assert _graph()["zml._fleet"] <= {"zml._config", "zml._errors"}


def test_the_checks_see_a_circle_and_an_upward_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _layer("zml._core.reply") > _layer("zml._transport_nats") > _layer("zml._client")
