"""`zml up`: embedded NATS + every service (batch runners included) + the simulated demo fleet, in one command.

Prints one line with ``ready`` and the gateway URL once a request would succeed, then one line
per node state transition (down with the health service's reason, up again). Every child
(nats-server, services, sim fleet) is supervised: one that exits is started again after a backoff
(0.5 s doubling to 10 s; reset after a minute up) and the restart is logged. Only Ctrl-C or
SIGTERM stops `zml up`, and with it every child it started (by PID).

Secure by default: the embedded nats-server runs with authorization (an nkey identity per
service, each allowed only its own subjects, see docs/security.md), from a persistent data
folder (``--data-dir``, default ``~/.local/share/zml``) holding the seeds (mode 0600).
``--insecure`` runs an open broker, as before (tests, throw-away demos).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
import wave
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from zmlcore.config import ZMLConfig
    from zmlcore.runtime.launch import Proc
    from zml.cli._nodewatch import NodeWatch
    from zml.cli._supervise import Supervisor


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
    p.add_argument("--routers", type=int, metavar="N",
                   help="router replicas (default: [router] processes, \"auto\": one per two cores, at least one)")
    p.add_argument("--gateways", type=int, metavar="N",
                   help="gateway processes sharing --gateway-port through SO_REUSEPORT (default: [gateway] processes, "
                        "\"auto\": one per two cores, at least one)")
    p.add_argument("--standby", type=int, default=1, metavar="N",
                   help="standby replicas of health and warmup beside the active one, which take over "
                        "through a leader lease (default 1: two of each; 0: one of each)")
    p.add_argument("--cluster", type=int, choices=(1, 3, 5), default=1, metavar="N",
                   help="run a local N-server NATS cluster (3 or 5) with JetStream replicas = 3 for every "
                        "bucket and stream, and point every service at all its servers (default 1: one server)")
    p.add_argument("--sim-port-base", type=int, metavar="N",
                   help="put the simulated nodes on ports N, N+1, ... (default: free ports for the demo fleet, "
                        "the endpoints of --config as written)")
    p.add_argument("--data-dir", help="identities, NATS config and JetStream storage (default: ZML_DATA_DIR, then "
                                      "~/.local/share/zml; with --insecure a temporary folder)")
    p.add_argument("--insecure", action="store_true",
                   help="run NATS without authorization: anyone who reaches the port can read and inject anything")
    p.add_argument("--ready-timeout", type=float, default=90.0, help="seconds to wait for the first good request")
    p.add_argument("--metrics-port", type=int, metavar="N",
                   help="Prometheus /metrics ports N, N+1, ...: health and warmup (each replica), then one per router, "
                        "then one per batch runner (default: free ports, printed at start; 0: none). The gateway serves "
                        "/metrics on its own port")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="children's log lines")
    p.add_argument("-v", "--verbose", action="store_true", help="echo every child's log")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"zml up: {msg}", file=sys.stderr)
    return 2


def probe_request(cfg: ZMLConfig) -> tuple[str, bytes, str] | None:
    """(path, body, content type) of the request that says the fleet serves: a one-token chat
    with a model that chats, else an embedding, else a transcription of a tenth of a second."""
    served = sorted({m for n in cfg.nodes for m in n.models})
    by_kind: dict[str, list[str]] = {"chat": [], "embedding": [], "audio": []}
    for m in served:
        mc = cfg.models.get(cfg.resolve_model(m))
        by_kind["embedding" if mc is not None and mc.embedding else "audio" if mc is not None and mc.audio
                else "chat"].append(m)
    if by_kind["chat"]:
        body = {"model": by_kind["chat"][0], "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
        return "/v1/chat/completions", json.dumps(body).encode(), "application/json"
    if by_kind["embedding"]:
        return "/v1/embeddings", json.dumps({"model": by_kind["embedding"][0], "input": "ping"}).encode(), \
            "application/json"
    if by_kind["audio"]:
        from zmlcore.messages.audio import encode_form

        out = io.BytesIO()
        with wave.open(out, "wb") as w:  # a tenth of a second of 16 kHz silence
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(16000)
            w.writeframes(b"\x00\x00" * 1600)
        wav = out.getvalue()
        form, ctype = encode_form([("model", by_kind["audio"][0])], "ping.wav", wav, "audio/wav")
        return "/v1/audio/transcriptions", form, ctype
    return None


def _probe(url: str, request: tuple[str, bytes, str]) -> tuple[int, str]:
    path, body, ctype = request
    req = urllib.request.Request(url + path, data=body, headers={"content-type": ctype})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:300]
    except OSError as exc:
        return 0, str(exc)


def _gateway_id(url: str) -> str:
    """The id of the gateway process that answered /healthz on a new connection ("" if none)."""
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=5) as resp:
            return str(json.loads(resp.read()).get("gateway", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def run(args: argparse.Namespace) -> int:
    from zmlcore.config import load_config
    from zmlcore.errors import ConfigError
    from zmlcore.runtime.launch import ClusterPlan, endpoint_port, listen_ports, port_in_use, service_argv, spawn, start_nats, wait_port
    from zml.cli._identities import default_data_dir, ensure_builtin, running_server, write_server_config
    from zmlcore.runtime.sizing import nats_env, plan_processes, usable_cores
    from zml.cli._supervise import Supervisor
    from zml.cli._simports import relocate

    config = args.config or demo_config_path()
    ports_dir = None
    try:
        cfg = load_config(config)
        if args.sim_port_base is not None or args.config is None:
            # The demo fleet on free ports (or from --sim-port-base): two `zml up` can share a host.
            ports_dir = tempfile.TemporaryDirectory(prefix="zml-up-")
            config, cfg = relocate(config, cfg, args.sim_port_base, Path(ports_dir.name))
    except ConfigError as exc:
        return _fail(str(exc))
    gateways, routers = plan_processes(usable_cores(), args.gateways or cfg.gateway.processes,
                                       args.routers or cfg.router.processes)
    sim_nodes = [n for n in cfg.nodes if n.sim is not None]
    wanted = [(args.host, args.gateway_port, "gateway (--gateway-port)")]
    if not args.nats_url:
        wanted.append((args.host, args.nats_port, "NATS (--nats-port, or --nats-url to use a running server)"))
    wanted += [(*endpoint_port(n.endpoint), f"sim node {n.id} (endpoint in {config})") for n in sim_nodes]
    standby = max(0, args.standby)
    singletons = [f"{role}-{i + 1}" if standby else role for role in ("health", "warmup") for i in range(1 + standby)]
    # Batch runners share the Batch API's work (no leader): [batch] processes of them.
    runners = [f"batch-{i + 1}" for i in range(cfg.batch.processes)] if cfg.batch.enabled else []
    metrics_ports: dict[str, int] = {}
    if args.metrics_port != 0:
        names = [*singletons, *(f"router-{i + 1}" for i in range(routers)), *runners]
        if args.metrics_port is None:
            metrics_ports = {name: listen_ports(1, args.host) for name in names}
        else:
            metrics_ports = {name: args.metrics_port + i for i, name in enumerate(names)}
            wanted += [(args.host, port, f"{name} metrics (--metrics-port)") for name, port in metrics_ports.items()]
    for host, port, what in wanted:
        if port_in_use(host, port):
            return _fail(f"port {port} on {host} is already in use: needed by {what}")

    sup = Supervisor()
    stopping = False
    interrupts = 0

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping, interrupts
        if signum == signal.SIGINT:
            interrupts += 1
            if interrupts > 1:  # Ctrl-C again while stopping: no more waiting (the services count alike)
                print("zml up: interrupted again: killing every process now", file=sys.stderr, flush=True)
                sup.kill_all()
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tmp = None
    watch: NodeWatch | None = None
    v = args.verbose
    envs: dict[str, dict[str, str]] = {}  # per service: its identity (ZML_NATS_NKEY)
    common: dict[str, str] = {}  # for every service
    data_dir = None
    try:
        if args.nats_url:
            nats_url = args.nats_url
        else:
            args.data_dir = args.data_dir or os.environ.get("ZML_DATA_DIR") or None
            if args.data_dir is None and args.insecure:
                tmp = tempfile.TemporaryDirectory(prefix="zml-nats-")
            data_dir = Path(args.data_dir or (tmp.name if tmp else default_data_dir()))
            data_dir.mkdir(parents=True, exist_ok=True)
            other = running_server(data_dir)
            if other is not None:
                return _fail(f"{data_dir} is in use by a running nats-server (PID {other}), probably another "
                             "`zml up`: give this one its own --data-dir")
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
            store = str(data_dir / "jetstream")
            go_env = nats_env(usable_cores(), cfg.nats.server_gomaxprocs)
            # Restarted on the same port and store: services reconnect and re-watch.
            if args.cluster == 1:
                sup.add("nats", lambda: start_nats(args.host, args.nats_port, store, echo=v, config=conf,
                                                         env=go_env))
                nats_url = f"nats://{args.host}:{args.nats_port}"
            else:
                plan = ClusterPlan.make(args.host, args.cluster, store, first_port=args.nats_port)
                def member(i: int) -> Callable[[], Proc]:
                    member_conf = _member_config(conf, i)
                    return lambda: plan.start(i, echo=v, config=member_conf, env=go_env)

                for i in range(args.cluster):
                    sup.add(f"nats-{i + 1}", member(i))
                nats_url = plan.urls
                common["ZML_NATS_REPLICAS"] = "3"
                try:
                    plan.wait_ready(60)
                except RuntimeError as exc:
                    return _fail(str(exc))

        def service(name: str, *argv: str) -> None:
            env = {**common, **envs.get(name.split("-")[0], {})}  # router-2 runs as the router identity
            sup.add(name, lambda: spawn(name, list(argv), echo=v, env=env))

        if sim_nodes:
            service("sim", *service_argv("sim", config, nats_url))

        def extra(name: str) -> list[str]:
            out = ["--log-format", args.log_format]
            if name in metrics_ports:
                out += ["--metrics-port", str(metrics_ports[name])]
            return out

        ha = ["--ha"] if args.standby > 0 else []  # one active, the others standing by (leader lease)
        for name in singletons:
            service(name, *service_argv(name.split("-")[0], config, nats_url, *ha, *extra(name)))
        for i in range(routers):
            name = f"router-{i + 1}"
            service(name, *service_argv("router", config, nats_url, "--router-id", name, *extra(name)))
        for name in runners:
            service(name, *service_argv("batch", config, nats_url, "--runner-id", name, *extra(name)))
        gw_argv = ["--host", args.host, "--port", str(args.gateway_port), "--log-format", args.log_format]
        if gateways == 1:
            service("gateway", *service_argv("gateway", config, nats_url, *gw_argv))
        for i in range(gateways if gateways > 1 else 0):  # one port, the kernel spreads connections
            service(f"gateway-{i + 1}", *service_argv("gateway", config, nats_url, *gw_argv, "--reuse-port"))
        url = f"http://{args.host}:{args.gateway_port}"
        probe = probe_request(cfg)
        deadline = time.monotonic() + args.ready_timeout
        last = (0, "")
        answered: set[str] = set()
        while probe is not None and not stopping:
            sup.tick()
            failed = _config_failure(sup)
            if failed:
                return failed
            last = _probe(url, probe) if wait_port(args.host, args.gateway_port, 0.5) else (0, "gateway not listening")
            if last[0] == 200:
                if gateways <= 1:
                    break
                # Several gateway processes on one port: ready once each of them answers (the
                # kernel spreads new connections over their listeners; each has its own id).
                for _ in range(8 * gateways):
                    if len(answered) >= gateways:
                        break
                    answered.add(_gateway_id(url))
                    answered.discard("")  # no answer
                if len(answered) >= gateways:
                    break
                last = (0, f"{len(answered)} of {gateways} gateway processes answering")
            if time.monotonic() > deadline:
                return _fail(f"no successful request within {args.ready_timeout:g} s (last: {last[0]} {last[1]})")
            time.sleep(0.5)
        if not stopping:
            if envs and data_dir is not None:
                mine = "" if data_dir == default_data_dir() else f" --data-dir {data_dir}"
                print(f"zml up: NATS authorization on (identities in {data_dir}). Operator commands (zml nodes/cost/"
                      f"serve/keys/creds) use its admin identity{mine or ' by themselves'}. A client identity for raw "
                      f"NATS or the SDK: `zml creds issue NAME{mine}`, then ZML_NATS_NKEY=<the file it writes>",
                      flush=True)
            elif not args.nats_url:
                print("zml up: --insecure: NATS has no authorization; anyone who reaches "
                      f"{nats_url} can read every prompt and reply and register nodes", flush=True)
            print(f"zml ready: {url}  (OpenAI API at {url}/v1, NATS {nats_url}, {len(cfg.nodes)} nodes; "
                  f"gateway processes {gateways}, routers {routers}; "
                  "Ctrl-C to stop)", flush=True)
            if sim_nodes:
                print("zml up: simulated nodes " + ", ".join(f"{n.id} {n.endpoint}" for n in sim_nodes)
                      + " (`zml nodes` lists them)", flush=True)
            where = ", ".join(f"{name} :{port}" for name, port in metrics_ports.items())
            print(f"zml metrics: {url}/metrics, dashboard {url}/dashboard" + (f"; /metrics also on {where}" if where else ""),
                  flush=True)
            watch = _watch_nodes(cfg, nats_url, envs)
        while not stopping:
            sup.tick()
            time.sleep(0.2)
        return 0
    finally:
        if watch is not None:
            watch.stop()
        sup.stop_all()
        if tmp is not None:
            tmp.cleanup()
        if ports_dir is not None:
            ports_dir.cleanup()
        print("zml up: stopped", file=sys.stderr, flush=True)


def _watch_nodes(cfg: ZMLConfig, nats_url: str, envs: dict[str, dict[str, str]]) -> NodeWatch:
    """One line per node state transition, as the admin identity (or zml.toml's) sees them."""
    from zmlcore.access.identity import connect_options
    from zml.cli._nodewatch import NodeWatch

    options = connect_options(cfg.nats, seed_file=envs.get("admin", {}).get("ZML_NATS_NKEY"))
    watch = NodeWatch(nats_url, options, lambda line: print(f"zml up: {line}", flush=True))
    watch.start()
    return watch


def _member_config(conf: str | None, i: int) -> str | None:
    """Member ``i`` of a cluster shares the first server's config (authorization, TLS) but
    needs a pid file of its own (`zml creds` reloads every member through them)."""
    if conf is None or i == 0:
        return conf
    path = Path(conf).with_name(f"nats-{i + 1}.conf")
    path.write_text(Path(conf).read_text().replace("nats.pid", f"nats-{i + 1}.pid"))
    path.chmod(0o600)
    return str(path)


def _config_failure(sup: "Supervisor") -> int:
    """Before ready, a child that exits with code 2 (bad config, port taken) will not do better
    when restarted: stop with its message instead of looping."""
    for child in sup.children:
        if child.exits and child.exits[-1] == 2 and child.proc is not None:
            print(f"zml up: {child.name} failed to start:\n{child.proc.tail()}", file=sys.stderr)
            return 1
    return 0
