"""`zml serve MODEL [--nodes a,b | --family MI300X]`: load a model now and follow it until ready.

Asks the warmup service (NATS ``zml.warmup.serve``), then watches the node state stream (KV
``zml_nodes``) and prints one line per change until every target node has the model loaded.
Exit status 0 when all are ready, 1 if any failed or the timeout passed.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from zml.cli._bus import Target, add_bus_args, resolve


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("serve", help="load a model on its nodes now and report progress until ready",
                       description="Load MODEL now (through the warmup service) and report progress until "
                                   "every target node serves it.")
    p.add_argument("model", help="model name or alias")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--nodes", help="comma-separated node ids (default: every node configured with the model)")
    g.add_argument("--family", action="append", default=[], help="only nodes of this family (repeatable)")
    add_bus_args(p)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for ready (default 900)")
    p.add_argument("--no-wait", action="store_true", help="ask for the load and return")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    target = resolve(nats_url=args.nats_url, config_path=args.config, data_dir=args.data_dir)
    return asyncio.run(serve(args.model, nodes=[n for n in (args.nodes or "").split(",") if n],
                             family=args.family, target=target, timeout=args.timeout, wait=not args.no_wait))


async def serve(model: str, *, nodes: list[str], family: list[str], target: Target, timeout: float,
                wait: bool = True, out: "object" = None) -> int:
    import msgspec
    from nats.errors import NoRespondersError
    from nats.errors import TimeoutError as NatsTimeout

    from zmlcore import subjects
    from zmlcore.errors import ErrorBody, from_wire
    from zmlcore.bus.kvfollow import KVFollower
    from zmlcore.messages import ServeRequest, node_state_decoder
    from zmlcore.messages.warmup import serve_reply_decoder

    stream = out or sys.stdout

    def say(line: str) -> None:
        print(line, file=stream, flush=True)  # type: ignore[arg-type]

    t0 = time.monotonic()
    from zml.cli._bus import check_denied, operator_nats

    async with operator_nats(target) as nc:
        req = ServeRequest(model=model, nodes=nodes, family=family)
        try:
            msg = await nc.request(subjects.WARMUP_SERVE, msgspec.json.encode(req), timeout=min(timeout, 120.0))
        except NoRespondersError:
            say("zml serve: no warmup service answers (start `zml warmup`, or use `zml up`)")
            return 2
        except NatsTimeout:
            check_denied(nc, target)  # no answer because the server refused the request
            say("zml serve: the warmup service did not answer in time")
            return 1
        if msg.headers and subjects.H_ERROR_CODE in msg.headers:
            raise from_wire(msgspec.json.decode(msg.data, type=ErrorBody).error)
        reply = serve_reply_decoder.decode(msg.data)
        pending: dict[str, str] = {}
        failed = 0
        for t in reply.targets:
            extra = f" via {t.mechanism}" if t.mechanism else ""
            say(f"{t.node_id}: {t.state}{extra}" + (f" ({t.message})" if t.message else ""))
            if t.state == "loading":
                pending[t.node_id] = t.state
            elif t.state in ("failed", "skipped"):
                failed += 1
        if not wait or not pending:
            if not failed:
                say(f"{reply.model}: ready on {sum(t.state == 'loaded' for t in reply.targets)} node(s)")
            return 1 if failed else 0
        done = asyncio.Event()

        def on_put(key: str, value: bytes) -> None:
            nonlocal failed
            if key not in pending:
                return
            st = node_state_decoder.decode(value)
            if reply.model in st.models and reply.model not in st.loading_models:
                del pending[key]
                say(f"{key}: ready ({time.monotonic() - t0:.1f} s)")
            elif st.status in ("down", "invalid"):
                del pending[key]
                failed += 1
                say(f"{key}: {st.status} ({st.reason})")
            elif pending[key] != st.status:
                pending[key] = st.status
                say(f"{key}: loading ({time.monotonic() - t0:.1f} s, node {st.status})")
            if not pending:
                done.set()

        follower = KVFollower(nc, subjects.NODES_BUCKET, on_put=on_put, on_delete=lambda key: None)
        task = asyncio.create_task(follower.run())
        try:
            await asyncio.wait_for(done.wait(), max(0.0, t0 + timeout - time.monotonic()))
        except asyncio.TimeoutError:
            say(f"zml serve: not ready after {timeout:g} s: {', '.join(sorted(pending))} still loading")
            return 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        if not failed:
            say(f"{reply.model}: ready on {sum(t.state in ('loaded', 'loading') for t in reply.targets)} node(s) "
                f"in {time.monotonic() - t0:.1f} s")
        return 1 if failed else 0
