"""``zml sim``: run one simulated node from flags, or every ``[nodes.sim]`` node of a zml.toml.

Prints ``zml-sim ready <n> nodes`` once every node listens; stops on SIGINT/SIGTERM.
A port already in use prints one line naming the node and port and exits with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from zmlcore.fleet.accelerators import ACCELERATORS
from zmlcore.errors import ConfigError
from zml_sim.engine import Faults
from zml_sim.engine import SimError
from zml_sim.server import DEFAULT_MODEL
from zml_sim.server import ENGINES
from zml_sim.server import SimNode
from zml_sim.server import SimPortInUseError
from zml_sim.server import start_fleet

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zml sim",
        description="Run simulated accelerator nodes that imitate vLLM/TGI/SGLang/llama.cpp servers.",
    )
    mode = p.add_argument_group("mode (one of)")
    mode.add_argument("--config", help="zml.toml: run every [[nodes]] entry with a [nodes.sim] table")
    mode.add_argument("--accelerator", choices=sorted(ACCELERATORS), help="single node: accelerator type")
    p.add_argument("--node", action="extend", nargs="+", default=[], metavar="ID",
                   help="with --config: run only these node ids (repeatable)")
    p.add_argument("--host", default=None, help="interface to bind (default 127.0.0.1; with --config "
                   "the default is each endpoint's host)")
    p.add_argument("--port", type=int, default=None, help="single node: port (0 = any free port)")
    p.add_argument("--node-id", default=None, help="single node: id (default <family>-sim)")
    p.add_argument("--model", action="extend", nargs="+", default=[], metavar="M",
                   help=f"single node: model to load (repeatable; default {DEFAULT_MODEL})")
    p.add_argument("--engine", choices=ENGINES, default="vllm", help="engine to imitate")
    p.add_argument("--lora", action="append", default=[], metavar="FILE",
                   help="single node, --engine llamacpp: a --lora file it was started with (repeat: ids 0, 1, ...)")
    p.add_argument("--time-scale", type=float, default=None,
                   help="run this many times faster than real time (overrides the config)")
    p.add_argument("--load-time-s", type=float, default=None, help="model load time (simulated seconds)")
    p.add_argument("--speed", type=float, default=None, help="relative speed, H100 = 1.0")
    p.add_argument("--prefill-tps", type=float, default=None, help="prefill tokens/s")
    p.add_argument("--decode-tps", type=float, default=None, help="decode tokens/s per sequence at batch 1")
    p.add_argument("--max-concurrency", type=int, default=None, help="sequences decoded together")
    p.add_argument("--max-waiting", type=int, default=None, help="waiting-queue bound (overload beyond)")
    p.add_argument("--memory-gib", type=float, default=None, help="accelerator memory")
    p.add_argument("--driver-version", default=None, help="driver version the node probe reports")
    p.add_argument("--seed", type=int, default=0, help="random seed (output lengths, faults)")
    faults = p.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    faults.add_argument("--error-rate", type=float, default=0.0, help="share of requests answered with an error")
    faults.add_argument("--error-status", type=int, default=500, help="status of injected errors")
    faults.add_argument("--drop-mid-stream", type=float, default=0.0,
                        help="share of requests whose connection drops after the first token")
    faults.add_argument("--stall-mid-stream", type=float, default=0.0,
                        help="share of requests that send nothing after the first token (connection kept open)")
    faults.add_argument("--slowdown", type=float, default=1.0, help="factor >= 1 on every duration")
    faults.add_argument("--hang", action="store_true", help="accept requests and never answer")
    faults.add_argument("--overload", action="store_true", help="answer the engine's overload error")
    faults.add_argument("--retry-after-s", type=float, default=None, help="Retry-After on errors/overload")
    faults.add_argument("--separator-tokens", action="store_true",
                        help="output words holding U+2028/U+2029/U+0085 (JSON-legal, not SSE line ends)")
    return p


def _faults(args: argparse.Namespace) -> Faults:
    return Faults().updated({
        "error_rate": args.error_rate, "error_status": args.error_status,
        "drop_mid_stream": args.drop_mid_stream, "stall_mid_stream": args.stall_mid_stream, "slowdown": args.slowdown, "hang": args.hang,
        "overload": args.overload, "retry_after_s": args.retry_after_s,
        "separator_tokens": args.separator_tokens,
    })


def _fail(message: str) -> int:
    print(f"zml-sim: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


async def _run(args: argparse.Namespace, faults: Faults) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    nodes: list[SimNode] = []
    try:
        if args.config:
            from zmlcore.config import load_config

            cfg = load_config(args.config)
            chosen = [n for n in cfg.nodes if n.sim is not None and (not args.node or n.id in args.node)]
            missing = set(args.node) - {n.id for n in cfg.nodes}
            if missing:
                return _fail(f"{args.config}: no node {sorted(missing)[0]!r}")
            if not chosen:
                return _fail(f"{args.config}: no [[nodes]] entry with a [nodes.sim] table")
            starting = asyncio.ensure_future(
                start_fleet(chosen, args.host, time_scale=args.time_scale, faults=faults))
        else:
            if args.port is None:
                return _fail("--port is required with --accelerator (0 picks a free port)")
            if args.lora and args.engine != "llamacpp":
                return _fail("--lora is llama.cpp's (--engine llamacpp)")
            acc = ACCELERATORS[args.accelerator]
            node = SimNode(
                args.node_id or f"{acc.family.lower()}-sim", args.accelerator,
                args.model or [DEFAULT_MODEL], engine=args.engine, time_scale=args.time_scale or 1.0, loras=args.lora,
                seed=args.seed, max_waiting=args.max_waiting, driver_version=args.driver_version,
                faults=faults, speed=args.speed, prefill_tps=args.prefill_tps,
                decode_tps=args.decode_tps, max_concurrency=args.max_concurrency,
                load_time_s=args.load_time_s, memory_gib=args.memory_gib,
            )

            async def one() -> list[SimNode]:
                await node.start(args.host or "127.0.0.1", args.port, wait=False)
                try:
                    await node.wait_listening()
                except BaseException:
                    await node.stop()
                    raise
                return [node]

            starting = asyncio.ensure_future(one())
        waiter = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, waiter], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():  # signalled while loading
            starting.cancel()
            await asyncio.wait([starting])
            waiter.cancel()
            return 0
        nodes = starting.result()
        print(f"zml-sim ready {len(nodes)} nodes", flush=True)
        for n in nodes:
            print(f"zml-sim node {n.node_id} {n.accelerator} {n.engine_kind} {n.url}", file=sys.stderr,
                  flush=True)
        await waiter
        return 0
    except SimPortInUseError as exc:
        return _fail(f"node {exc.node_id}: port {exc.port} is already in use")
    except (ConfigError, SimError, ValueError) as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(f"cannot bind: {exc}")
    finally:
        await asyncio.gather(*(n.stop() for n in nodes), return_exceptions=True)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``zml sim`` and ``python -m zml_sim``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.config) == bool(args.accelerator):
        parser.print_usage(sys.stderr)
        return _fail("give either --config zml.toml or --accelerator TYPE --port N")
    if args.time_scale is not None and args.time_scale <= 0:
        return _fail("--time-scale must be > 0")
    try:
        faults = _faults(args)
    except ValueError as exc:
        return _fail(str(exc))
    try:
        return asyncio.run(_run(args, faults))
    except KeyboardInterrupt:
        return 130
