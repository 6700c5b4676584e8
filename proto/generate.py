"""Regenerate the Python modules of proto/zml/v1/zml.proto into zmlcore.rpc.

    python proto/generate.py           # write libs/zmlcore/src/zmlcore/rpc/zml_pb2*.py(i)
    python proto/generate.py --check   # exit 1 if the committed modules differ (a test runs this)

The generated code is committed (no protoc at install time: users get grpcio and protobuf
only). protoc names the import after the proto package (``from zml.v1 import zml_pb2``), which
would clash with the SDK's own ``zml`` package, so that one line is rewritten to
``zmlcore.rpc``. Needs grpcio-tools (a test dependency).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO = "zml/v1/zml.proto"
OUT = ROOT / "libs" / "zmlcore" / "src" / "zmlcore" / "rpc"
FILES = ("zml_pb2.py", "zml_pb2.pyi", "zml_pb2_grpc.py")


def generate() -> dict[str, str]:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        argv = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}", PROTO]
        if protoc.main(argv) != 0:
            raise SystemExit(f"protoc failed on {PROTO}")
        out = {}
        for name in FILES:
            text = (Path(tmp) / "zml" / "v1" / name).read_text()
            out[name] = text.replace("from zml.v1 import zml_pb2", "from zmlcore.rpc import zml_pb2")
        return out


def main(argv: list[str]) -> int:
    fresh = generate()
    if "--check" in argv:
        stale = [n for n, text in fresh.items() if not (OUT / n).exists() or (OUT / n).read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python proto/generate.py", file=sys.stderr)
            return 1
        return 0
    for name, text in fresh.items():
        (OUT / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
