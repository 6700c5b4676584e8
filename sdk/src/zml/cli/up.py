"""`zml up`: embedded NATS + every service + the simulated demo fleet, in one command.

Prints one line with ``ready`` and the gateway URL once a request would succeed; Ctrl-C or
SIGTERM stops every child it started (by PID, in reverse order).

Secure by default: the embedded nats-server runs with authorization (an nkey identity per
service, each allowed only its own subjects, see docs/security.md), from a persistent data
folder (``--data-dir``, default ``~/.local/share/zml``) holding the seeds (mode 0600).
``--insecure`` runs an open broker, as before (tests, throw-away demos).
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
    p.add_argument("--data-dir", help="identities, NATS config and JetStream storage (default: ~/.local/share/zml; "
                                      "with --insecure a temporary folder)")
    p.add_argument("--insecure", action="store_true",
                   help="run NATS without authorization: anyone who reaches the port can read and inject anything")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds to wait for the first good request")
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
    from zmlcore.natscreds import default_data_dir, ensure_builtin, write_server_config

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
    envs: dict[str, dict[str, str]] = {}  # per service: its identity (ZML_NATS_NKEY)
    data_dir = None
    try:
        if args.nats_url:
            nats_url = args.nats_url
        else:
            if args.data_dir is None and args.insecure:
                tmp = tempfile.TemporaryDirectory(prefix="zml-nats-")
            data_dir = Path(args.data_dir or (tmp.name if tmp else default_data_dir()))
            data_dir.mkdir(parents=True, exist_ok=True)
            conf = None
            if not args.insecure:
                try:
                    ids = ensure_builtin(data_dir)
                    n = cfg.nats
                    conf = write_server_config(data_dir, tls_cert=n.server_tls_cert_file, tls_key=n.server_tls_key_file,
                                               tls_ca=n.tls_ca_file, verify_clients=n.server_tls_verify_clients)
                except ConfigError as exc:
                    return _fail(str(exc))
                envs = {name: {"ZML_NATS_NKEY": ident.seed_file} for name, ident in ids.items()}
            procs.append(start_nats(args.host, args.nats_port, str(data_dir / "jetstream"), echo=args.verbose,
                                    config=conf))
            nats_url = f"nats://{args.host}:{args.nats_port}"
        if sim_nodes:
            sim = spawn("sim", service_argv("sim", config, nats_url), echo=args.verbose)
            procs.append(sim)
        procs.append(spawn("health", service_argv("health", config, nats_url), echo=args.verbose, env=envs.get("health")))
        procs.append(spawn("warmup", service_argv("warmup", config, nats_url), echo=args.verbose, env=envs.get("warmup")))
        for i in range(max(1, args.routers)):
            procs.append(spawn(f"router-{i + 1}", service_argv("router", config, nats_url, "--router-id", f"router-{i + 1}"),
                               echo=args.verbose, env=envs.get("router")))
        gw_argv = service_argv("gateway", config, nats_url, "--host", args.host, "--port", str(args.gateway_port))
        procs.append(spawn("gateway", gw_argv, echo=args.verbose, env=envs.get("gateway")))
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
            if envs and data_dir is not None:
                print(f"zml up: NATS authorization on (identities in {data_dir}). A client identity for raw NATS or "
                      f"the SDK: `zml creds issue NAME --data-dir {data_dir}`, then ZML_NATS_NKEY=<the file it "
                      f"writes>. Operator commands (zml nodes/cost/serve): "
                      f"ZML_NATS_NKEY={data_dir / 'creds' / 'admin.nk'}", flush=True)
            elif not args.nats_url:
                print("zml up: --insecure: NATS has no authorization; anyone who reaches "
                      f"{nats_url} can read every prompt and reply and register nodes", flush=True)
            print(f"zml ready: {url}  (OpenAI API at {url}/v1, NATS {nats_url}, {len(cfg.nodes)} nodes; Ctrl-C to stop)",
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
