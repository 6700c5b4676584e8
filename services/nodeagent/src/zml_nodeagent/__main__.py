"""``python -m zml_nodeagent`` / ``zml node-agent``: serve ``GET /zml/v1/node``."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from zml_nodeagent.server import NodeAgent
from zml_nodeagent.smi import detect


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zml node-agent", description="Serve the ZML node probe (GET /zml/v1/node) "
                                "beside a serving engine, from nvidia-smi / amd-smi / rocm-smi / hl-smi / neuron-ls.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=9400, help="port (default 9400)")
    p.add_argument("--engine-url", help="the engine beside this agent, e.g. http://127.0.0.1:8000 (reports its models)")
    p.add_argument("--engine", default="", help="engine name to report (vllm, tgi, sglang, llamacpp, openai)")
    p.add_argument("--driver-version", default=None,
                   help="report this driver/SDK version (for tools that do not print it, e.g. the Neuron SDK)")
    p.add_argument("--print", action="store_true", help="print the document once and exit")
    return p


async def _serve(agent: NodeAgent, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await agent.start(host, port)
    print(f"zml node-agent ready: http://{host}:{agent.port}/zml/v1/node", flush=True)
    await stop.wait()
    await agent.stop()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    agent = NodeAgent(engine_url=args.engine_url, engine=args.engine, driver_version=args.driver_version,
                      detector=detect)
    if args.print:
        print(json.dumps(asyncio.run(agent.document()), indent=2))
        return 0
    asyncio.run(_serve(agent, args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
