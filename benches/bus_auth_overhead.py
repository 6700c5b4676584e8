"""Request-reply round trips through nats-server: open vs nkey auth + ZML permissions (client role
requesting zml.infer, a router-role responder in the queue group replying to _ZML_INBOX).

    python benches/bus_auth_overhead.py

Five interleaved rounds of 3,000 sequential round trips each (200-byte payload), median per
round trip; then the cost of one connect (nkey: the server's nonce is signed). Results are in
docs/security.md ("Overhead").
"""
import asyncio, tempfile, time, statistics, os
from pathlib import Path
import nats
from zmlcore import subjects
from zml.cli import _identities
from zmlcore.runtime.launch import start_nats, free_port
from zmlcore.access.identity import connect_options
from zmlcore.config import NatsConfig

N = 3000

async def run(url, client_opts, router_opts):
    srv = await nats.connect(url, **router_opts)
    async def echo(msg):
        await srv.publish(msg.reply, msg.data)
    await srv.subscribe(subjects.INFER, queue=subjects.ROUTER_QUEUE, cb=echo)
    await srv.flush()
    cli = await nats.connect(url, **client_opts)
    for _ in range(200):
        await cli.request(subjects.INFER, b"x" * 200, timeout=5)
    t0 = time.perf_counter()
    for _ in range(N):
        await cli.request(subjects.INFER, b"x" * 200, timeout=5)
    dt = time.perf_counter() - t0
    await cli.close(); await srv.close()
    return dt / N * 1e6

async def main():
    d = Path(tempfile.mkdtemp())
    ids = _identities.ensure_builtin(d); alice = _identities.issue(d, "alice")
    conf = _identities.write_server_config(d)
    p1, p2 = free_port(), free_port()
    open_srv = start_nats("127.0.0.1", p1, str(d / "js1"))
    auth_srv = start_nats("127.0.0.1", p2, str(d / "js2"), config=conf)
    try:
        u1, u2 = f"nats://127.0.0.1:{p1}", f"nats://127.0.0.1:{p2}"
        co = connect_options(NatsConfig(), seed_file=alice.seed_file)
        ro = connect_options(NatsConfig(), seed_file=ids["router"].seed_file)
        res = {"open": [], "auth": []}
        for _ in range(5):
            res["open"].append(await run(u1, {}, {}))
            res["auth"].append(await run(u2, co, ro))
        for k, v in res.items():
            print(k, "median us/round trip", round(statistics.median(v), 1), [round(x) for x in v])
        t0 = time.perf_counter()
        for _ in range(20):
            nc = await nats.connect(u2, **co); await nc.close()
        t1 = time.perf_counter()
        for _ in range(20):
            nc = await nats.connect(u1); await nc.close()
        t2 = time.perf_counter()
        print("connect ms: auth", round((t1 - t0) / 20 * 1000, 2), "open", round((t2 - t1) / 20 * 1000, 2))
    finally:
        open_srv.stop(); auth_srv.stop()
asyncio.run(main())
