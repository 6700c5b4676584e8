"""Write zml.v1's ``Routing`` message from its schema and regenerate the Python modules of
proto/zml/v1/zml.proto into zmlcore.rpc.

    python proto/generate.py           # rewrite message Routing, write zmlcore/rpc/zml_pb2*.py(i)
    python proto/generate.py --check   # exit 1 if the .proto or the modules are stale (a test runs this)

``--check`` compares what the modules *mean*, not their bytes: the serialized file descriptor
(every message, field, number and service), each RPC's kind, path and types, and the stubs'
classes and fields. Their text also carries the versions of the grpcio-tools that wrote them
(``GRPC_GENERATED_VERSION``, ``Protobuf Python Version``) and its formatting; any grpcio-tools
the test extra allows must agree with the committed modules, or CI turns red on a release
nobody chose.

``message Routing`` is written from :class:`zmlcore.messages.RoutingInfo`, the one schema of
routing metadata (body, headers, gRPC metadata and the SDK derive from it too): a field added
there becomes a field here. Numbers are stable: a field keeps the number the committed .proto
gives it, a new one takes the next free number, and a field gone from RoutingInfo is
``reserved`` (its number and name never reused). Types: ``str`` string, ``int`` uint32 (counts),
``float`` double, ``bool`` bool, ``X | None`` optional X, ``list[X]`` repeated X.

The generated code is committed (no protoc at install time: users get grpcio and protobuf
only). protoc names the import after the proto package (``from zml.v1 import zml_pb2``), which
would clash with the SDK's own ``zml`` package, so that one line is rewritten to
``zmlcore.rpc``. Needs grpcio-tools (a test dependency).
"""

from __future__ import annotations

import ast
import re
import sys
import tempfile
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO = "zml/v1/zml.proto"
OUT = ROOT / "libs" / "zmlcore" / "src" / "zmlcore" / "rpc"
FILES = ("zml_pb2.py", "zml_pb2.pyi", "zml_pb2_grpc.py")

_SCALARS = {str: "string", int: "uint32", float: "double", bool: "bool"}
_BLOCK = re.compile(r"((?://[^\n]*\n)*)message Routing \{\n(.*?)\n\}\n", re.S)
_FIELD = re.compile(r"^\s*(?:optional |repeated )?\w+ (\w+) = (\d+);", re.M)
_RESERVED = re.compile(r"^\s*reserved ([\d, ]+);", re.M)
_HEADER = ("// Routing metadata of a reply (also in the trailing metadata as zml-*). Written by proto/generate.py\n"
           "// from zmlcore.messages.RoutingInfo, which documents each field: change that class, not this\n"
           "// message. Field numbers never change.\n")


def _proto_type(name: str, tp: Any) -> str:
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType) and type(None) in args and len(args) == 2:
        return "optional " + _proto_type(name, next(a for a in args if a is not type(None)))
    if typing.get_origin(tp) is list and args and args[0] in _SCALARS:
        return "repeated " + _SCALARS[args[0]]
    if tp in _SCALARS:
        return _SCALARS[tp]
    raise SystemExit(f"RoutingInfo.{name}: no proto type for {tp!r}; map it in proto/generate.py")


def routing_message(proto_text: str) -> str:
    """``proto_text`` with its ``message Routing`` written from RoutingInfo."""
    import msgspec

    from zmlcore.messages import RoutingInfo

    found = _BLOCK.search(proto_text)
    if found is None:
        raise SystemExit(f"{PROTO}: no `message Routing {{...}}` block")
    body = found.group(2)
    numbers = {name: int(n) for name, n in _FIELD.findall(body)}
    reserved = {int(n) for line in _RESERVED.findall(body) for n in line.replace(" ", "").split(",") if n}
    reserved_names = set(re.findall(r'reserved "(\w+)";', body))
    fields = msgspec.structs.fields(RoutingInfo)
    next_free = max([0, *numbers.values(), *reserved]) + 1
    lines = []
    for f in fields:
        if f.name in reserved_names:
            raise SystemExit(f"RoutingInfo.{f.name}: a removed field's name is reserved in zml.v1.Routing")
        if f.name not in numbers:
            numbers[f.name] = next_free
            next_free += 1
        lines.append(f"  {_proto_type(f.name, f.type)} {f.name} = {numbers[f.name]};")
    gone = sorted((n, name) for name, n in numbers.items() if name not in {f.name for f in fields})
    reserved |= {n for n, _ in gone}
    reserved_names |= {name for _, name in gone}
    if reserved:
        lines.append(f"  reserved {', '.join(str(n) for n in sorted(reserved))};")
    lines += [f'  reserved "{name}";' for name in sorted(reserved_names)]
    block = _HEADER + "message Routing {\n" + "\n".join(lines) + "\n}\n"
    return proto_text[:found.start()] + block + proto_text[found.end():]


def generate(proto_text: str) -> dict[str, str]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        (src / PROTO).parent.mkdir(parents=True)
        (src / PROTO).write_text(proto_text)
        argv = ["protoc", f"-I{src}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}", PROTO]
        if protoc.main(argv) != 0:
            raise SystemExit(f"protoc failed on {PROTO}")
        out = {}
        for name in FILES:
            text = (Path(tmp) / "zml" / "v1" / name).read_text()
            out[name] = text.replace("from zml.v1 import zml_pb2", "from zmlcore.rpc import zml_pb2")
        return out


_RPC = re.compile(r"channel\.(\w+)\(\s*'([^']+)',\s*request_serializer=[\w.]*?(\w+)\.SerializeToString,"
                  r"\s*response_deserializer=[\w.]*?(\w+)\.FromString")


def meaning(name: str, text: str) -> object:
    """What a generated module says, free of the generator's version and layout."""
    tree = ast.parse(text)
    if name == "zml_pb2.py":
        # The serialized FileDescriptorProto: the whole .proto, compiled.
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "AddSerializedFile" and isinstance(node.args[0], ast.Constant)):
                return node.args[0].value
        raise SystemExit(f"{name}: no AddSerializedFile(...) in it")
    if name == "zml_pb2_grpc.py":
        rpcs = sorted(_RPC.findall(text))
        classes = sorted(n.name for n in tree.body if isinstance(n, ast.ClassDef))
        functions = sorted(n.name for n in tree.body if isinstance(n, ast.FunctionDef))
        return rpcs, classes, functions
    # zml_pb2.pyi: each class with its fields' names and types.
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            fields = sorted((t.target.id, ast.unparse(t.annotation)) for t in node.body
                            if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name))
            out.append((node.name, fields))
    return sorted(out)


def main(argv: list[str]) -> int:
    committed = (PROTO_DIR / PROTO).read_text()
    proto_text = routing_message(committed)
    fresh = generate(proto_text)
    if "--check" in argv:
        stale = [n for n, text in fresh.items()
                 if not (OUT / n).exists() or meaning(n, (OUT / n).read_text()) != meaning(n, text)]
        if proto_text != committed:
            stale.insert(0, f"{PROTO} (message Routing differs from zmlcore.messages.RoutingInfo)")
        if stale:
            print(f"out of date: {', '.join(stale)}; run python proto/generate.py", file=sys.stderr)
            return 1
        return 0
    (PROTO_DIR / PROTO).write_text(proto_text)
    for name, text in fresh.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
