"""`zml up`: embedded NATS + every service + the simulated demo fleet, in one command.

Prints one line with ``ready`` and the gateway URL once a request would succeed; Ctrl-C or
SIGTERM stops every child it started (by PID, in reverse order).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path


def demo_config_path() -> str:
    return str(resources.files("zml") / "data" / "demo.toml")


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("up", help="run NATS, all services and the demo fleet of simulated nodes")
    p.add_argument("--config", help="zml.toml to run (default: the shipped demo fleet)")
    p.add_argument("--host", default="127.0.0.1", help="interface for the gateway and NATS (default 127.0.0.1)")
    p.add_argument("--gateway-port", type=int, default=8080, help="HTTP port (default 8080)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--nats-port", type=int, default=4222, help="port of the embedded NATS (default 4222)")
    g.add_argument("--nats-url", help="use this NATS server (with JetStream) instead of starting one")
    p.add_argument("--routers", type=int, default=1, help="router replicas (default 1)")
    p.add_argument("--data-dir", help="JetStream storage (default: a temporary folder)")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds to wait for the first good request")
    p.add_argument("--metrics-port", type=int, default=9464,
                   help="first Prometheus /metrics port: health, warmup, then one per router (default 9464; "
                        "0: none). The gateway serves /metrics on its own port")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="children's log lines")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every child's log")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"zml up: {msg}", file=sys.stderr)
    return 2


def _probe(url: str, model: str) -> tuple[int, str]:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except OSError as exc:
        return 0, str(exc)


def run(args: argparse.Namespace) -> int:
    from zmlcore.config import load_config
    from zmlcore.errors import ConfigError
    from zmlcore.launch import endpoint_port, port_in_use, service_argv, spawn, start_nats, wait_port

    config = args.config or demo_config_path()
    try:
        cfg = load_config(config)
    except ConfigError as exc:
        return _fail(str(exc))
    sim_nodes = [n for n in cfg.nodes if n.sim is not None]
    wanted = [(args.host, args.gateway_port, "gateway (--gateway-port)")]
    if not args.nats_url:
        wanted.append((args.host, args.nats_port, "NATS (--nats-port, or --nats-url to use a running server)"))
    wanted += [(*endpoint_port(n.endpoint), f"sim node {n.id} (endpoint in {config})") for n in sim_nodes]
    metrics_ports: dict[str, int] = {}
    if args.metrics_port:
        names = ["health", "warmup", *(f"router-{i + 1}" for i in range(max(1, args.routers)))]
        metrics_ports = {name: args.metrics_port + i for i, name in enumerate(names)}
        wanted += [(args.host, port, f"{name} metrics (--metrics-port)") for name, port in metrics_ports.items()]
    for host, port, what in wanted:
        if port_in_use(host, port):
            return _fail(f"port {port} on {host} is already in use: needed by {what}")

    procs = []
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tmp = None
    try:
        if args.nats_url:
            nats_url = args.nats_url
        else:
            data_dir = args.data_dir
            if data_dir is None:
                tmp = tempfile.TemporaryDirectory(prefix="zml-nats-")
                data_dir = tmp.name
            Path(data_dir).mkdir(parents=True, exist_ok=True)
            procs.append(start_nats(args.host, args.nats_port, data_dir, echo=args.verbose))
            nats_url = f"nats://{args.host}:{args.nats_port}"
        if sim_nodes:
            sim = spawn("sim", service_argv("sim", config, nats_url), echo=args.verbose)
            procs.append(sim)
        def extra(name: str) -> list[str]:
            out = ["--log-format", args.log_format]
            if name in metrics_ports:
                out += ["--metrics-port", str(metrics_ports[name])]
            return out

        procs.append(spawn("health", service_argv("health", config, nats_url, *extra("health")), echo=args.verbose))
        procs.append(spawn("warmup", service_argv("warmup", config, nats_url, *extra("warmup")), echo=args.verbose))
        for i in range(max(1, args.routers)):
            name = f"router-{i + 1}"
            procs.append(spawn(name, service_argv("router", config, nats_url, "--router-id", name, *extra(name)),
                               echo=args.verbose))
        gw_argv = service_argv("gateway", config, nats_url, "--host", args.host, "--port", str(args.gateway_port),
                               "--log-format", args.log_format)
        procs.append(spawn("gateway", gw_argv, echo=args.verbose))
        url = f"http://{args.host}:{args.gateway_port}"
        if not wait_port(args.host, args.gateway_port, 30):
            return _died(procs) or _fail("the gateway did not start")
        model = next(iter(sorted({m for n in cfg.nodes for m in n.models})), None)
        deadline = time.monotonic() + args.ready_timeout
        last = (0, "")
        while model is not None and not stopping:
            last = _probe(url, model)
            if last[0] == 200:
                break
            dead = _died(procs)
            if dead:
                return dead
            if time.monotonic() > deadline:
                return _fail(f"no successful request within {args.ready_timeout:g} s (last: {last[0]} {last[1]})")
            time.sleep(0.5)
        if not stopping:
            print(f"zml ready: {url}  (OpenAI API at {url}/v1, NATS {nats_url}, {len(cfg.nodes)} nodes; Ctrl-C to stop)",
                  flush=True)
            where = ", ".join(f"{name} :{port}" for name, port in metrics_ports.items())
            print(f"zml metrics: {url}/metrics, dashboard {url}/dashboard" + (f"; /metrics also on {where}" if where else ""),
                  flush=True)
        while not stopping:
            dead = _died(procs)
            if dead:
                return dead
            time.sleep(0.2)
        return 0
    finally:
        # Signal every child at once, then wait: stopping them one by one adds up the drains.
        for proc in procs:
            proc.terminate()
        for proc in reversed(procs):
            proc.stop()
        if tmp is not None:
            tmp.cleanup()
        print("zml up: stopped", file=sys.stderr, flush=True)


def _died(procs: list) -> int:  # type: ignore[type-arg]
    for proc in procs:
        if not proc.alive():
            print(f"zml up: {proc.name} exited with code {proc.popen.returncode}:\n{proc.tail()}", file=sys.stderr)
            return 1
    return 0
