"""Shared fixtures: a real nats-server (JetStream, free port) per session, and the whole ZML
stack (sim fleet + health + two routers + gateway) started the way `zml up` starts it.

With ZML_TEST_DOCKER=1 and a Docker engine, NATS comes from testcontainers' NATS image.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

import schedule
from pki import Pki, make_pki
from schedule import SHARED_STACK
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, start_nats, wait_port

@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The chaos and engine suites (``-m chaos``, ``-m engine``) run in one process, whatever
    pyproject's addopts say: they kill processes under load and time the recovery, so tests of
    their own beside them would be part of the fault. Only the default selection is parallel."""
    markexpr = config.option.markexpr or ""
    if ("chaos" in markexpr or "engine" in markexpr) and "not engine and not chaos" not in markexpr:
        config.option.numprocesses = 0
        config.option.dist = "no"


MODEL = "meta-llama/llama-3-8b-instruct"
MODEL_2 = "mistralai/mistral-7b-instruct"

# The demo fleet's shape, fast: the sims run 20x real time and load in well under a second.
FLEET = [
    ("h100-1", "nvidia_h100", [MODEL, MODEL_2]),
    ("h100-2", "nvidia_h100", [MODEL]),
    ("a100-1", "nvidia_a100", [MODEL]),
    ("mi300x-1", "amd_mi300x", [MODEL, MODEL_2]),
    ("mi300x-2", "amd_mi300x", [MODEL]),
    ("gaudi2-1", "intel_gaudi2", [MODEL]),
]


LLAMA3_POLICY = (
    '[policies.llama3-production]\naccelerator_chain = ["H100", "MI300X", "A100"]\n'
    'latency_target_ms = 500\ncost_priority = "balanced"\n'
)


def fleet_toml(ports: dict[str, int], *, fleet: list[tuple[str, str, list[str]]] | None = None,
               time_scale: float = 20.0, poll_s: float = 0.5, extra: str = "", router: str = "cooldown_s = 2\n",
               sim_extra: str = "") -> str:
    out = [
        "[defaults]\nrequest_timeout_s = 20\n",
        # kv_heartbeat_s = one poll: these stacks judge recovery by the routers' state ages, which
        # write-on-change lets grow to the heartbeat (tests/integration/test_health_kv_writes.py).
        f"[health]\npoll_interval_s = {poll_s}\nkv_heartbeat_s = {poll_s}\nprobe_timeout_s = 1.0\n"
        "down_after = 2\nup_after = 1\n",
        f"[router]\n{router}",
        f'[models."{MODEL}"]\naliases = ["llama-3-8b"]\n',
        extra,
    ]
    for node_id, acc, models, *node_extra in fleet or FLEET:  # a 4th item: more of the node's keys
        models_toml = ", ".join(f'"{m}"' for m in models)
        out.append(
            f'[[nodes]]\nid = "{node_id}"\naccelerator = "{acc}"\n{"".join(node_extra)}'
            f'endpoint = "http://127.0.0.1:{ports[node_id]}"\nmodels = [{models_toml}]\n'
            f"[nodes.sim]\ntime_scale = {time_scale}\nload_time_s = 2.0\nseed = {len(out)}\n{sim_extra}"
        )
    return "\n".join(out)


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    if os.environ.get("ZML_TEST_DOCKER") == "1":
        from testcontainers.nats import NatsContainer

        with NatsContainer("nats:2.10", jetstream=True) as container:
            yield container.nats_uri()
        return
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="zml-test-nats-") as store:
        proc = start_nats("127.0.0.1", port, store)
        try:
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.stop()


@dataclass
class Stack:
    gateway_url: str
    nats_url: str
    config_path: str
    model: str
    node_ids: list[str]
    node_ports: dict[str, int]
    procs: dict[str, Proc] = field(default_factory=dict)
    #: service name -> its Prometheus /metrics port (routers and health; the gateway uses its own)
    metrics_ports: dict[str, int] = field(default_factory=dict)
    #: role -> nkey seed file, for a broker with authorization (SecureBus); empty: open broker.
    identities: dict[str, str] = field(default_factory=dict)
    #: The gateway's gRPC address ("127.0.0.1:PORT", zml.v1.Zml; docs/grpc.md).
    grpc_target: str = ""

    env: dict[str, str] = field(default_factory=dict)  # for every service (TLS settings)

    def env_of(self, role: str) -> dict[str, str] | None:
        out = {**self.env, **({"ZML_NATS_NKEY": self.identities[role]} if role in self.identities else {})}
        return out or None

    def sim_url(self, node_id: str) -> str:
        return f"http://127.0.0.1:{self.node_ports[node_id]}"

    def faults(self, node_id: str, **faults: Any) -> None:
        r = httpx.post(self.sim_url(node_id) + "/sim/faults", json=faults, timeout=5)
        assert r.status_code == 200, r.text

    def clear_faults(self) -> None:
        for node_id in self.node_ids:
            r = httpx.delete(self.sim_url(node_id) + "/sim/faults", timeout=5)
            assert r.status_code == 200, r.text

    def sim_state(self, node_id: str) -> dict[str, Any]:
        return httpx.get(self.sim_url(node_id) + "/sim/state", timeout=5).json()

    def decisions(self, node_id: str | None = None) -> float:
        """Attempts the stack's routers sent (to ``node_id``, or to any node), from their
        zml_router_decisions_total: what ZML asked of the nodes. The sims' own counters also
        count the health service's calibrations, which may land at any moment of a slow run."""
        total = 0.0
        for name, port in self.metrics_ports.items():
            if not name.startswith("router") or not self.procs.get(name) or not self.procs[name].alive():
                continue
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("zml_router_decisions_total{")
                         and (node_id is None or f'node="{node_id}"' in line))
        return total

    def start_router(self, name: str) -> Proc:
        self.metrics_ports[name] = port = free_port()
        proc = spawn(name, service_argv("router", self.config_path, self.nats_url, "--router-id", name,
                                        "--metrics-port", str(port)),
                     env=self.env_of("router"))
        self.procs[name] = proc
        return proc

    def stop(self) -> None:
        # Signalled at once, then waited for (as `zml up` stops): one by one, their drains add
        # up to ~1.5 s a stack, ~40 stacks a run.
        procs = list(self.procs.values())
        for p in procs:
            p.terminate()
        for p in reversed(procs):
            p.stop()


def wait_ready(gateway_url: str, model: str, timeout: float = 60.0, want_nodes: int = 1,
               verify: Any = True) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    with httpx.Client(timeout=5, verify=verify) as client:
        while time.monotonic() < deadline:
            try:
                nodes = client.get(gateway_url + "/v1/nodes").json()["nodes"]
                up = [n for n in nodes if n.get("status") == "up" and model in n.get("models", [])]
                if len(up) >= want_nodes:
                    r = client.post(gateway_url + "/v1/chat/completions",
                                    json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                    if r.status_code == 200:
                        return
                    last = r.text
                else:
                    last = f"{len(up)} nodes up"
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                last = repr(exc)
            time.sleep(0.2)
    raise RuntimeError(f"stack not ready: {last}")


def launch_stack(nats_url: str, tmp: Path, *, fleet: list[tuple[str, str, list[str]]] | None = None,
                 routers: int = 2, identities: dict[str, str] | None = None, env: dict[str, str] | None = None,
                 https_verify: Any = None, **toml: Any) -> Stack:
    """Sims + health + routers + gateway as separate processes, started as `zml up` does.
    ``identities``: role -> seed file when the broker has authorization (SecureBus.seeds);
    ``env``: for every service (e.g. ZML_NATS_TLS_*); ``https_verify``: the gateway serves HTTPS
    (ZML_GATEWAY_TLS_* in ``env``), verified with this (a CA file or an SSLContext)."""
    fleet = fleet or FLEET
    ports = {f[0]: free_port() for f in fleet}
    config = tmp / "zml.toml"
    config.write_text(fleet_toml(ports, fleet=fleet, **toml))
    gw_port, grpc_port = free_port(), free_port()
    procs: dict[str, Proc] = {}
    scheme = "https" if https_verify is not None else "http"
    stack = Stack(f"{scheme}://127.0.0.1:{gw_port}", nats_url, str(config), MODEL, [f[0] for f in fleet], ports, procs,
                  identities=dict(identities or {}), env=dict(env or {}), grpc_target=f"127.0.0.1:{grpc_port}")
    try:
        procs["sim"] = spawn("sim", service_argv("sim", str(config), nats_url))
        stack.metrics_ports["health"] = free_port()
        procs["health"] = spawn("health", service_argv("health", str(config), nats_url, "--metrics-port",
                                                       str(stack.metrics_ports["health"])),
                                env=stack.env_of("health"))
        for i in range(1, routers + 1):
            stack.start_router(f"router-{i}")
        procs["gateway"] = spawn("gateway", service_argv("gateway", str(config), nats_url, "--port", str(gw_port),
                                                               "--grpc-port", str(grpc_port)),
                                 env=stack.env_of("gateway"))
        deadline = time.monotonic() + 30
        while not wait_port("127.0.0.1", gw_port, 0.2):
            dead = [p.name for p in procs.values() if not p.alive()]
            assert not dead and time.monotonic() < deadline, f"not started: {dead or 'gateway'}"

        wait_ready(stack.gateway_url, MODEL, want_nodes=len([f for f in fleet if MODEL in f[2]]),
                   verify=True if https_verify is None else https_verify)
    except BaseException:
        for p in procs.values():
            print(f"--- {p.name}\n{p.tail(30)}")
        stack.stop()
        raise
    return stack


class SharedStack:
    """The stack the read-mostly e2e files share (``zml_stack``), on a broker of its own. Started
    when a test first asks for it, stopped when the next test is in a file that does not use it
    (those files run one after the other, tests/schedule.py): idle, it costs ~13% of a core.
    Asked for again, it starts again."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tmp_path_factory = tmp_path_factory
        self.stack: Stack | None = None
        self.nats: Proc | None = None

    def get(self) -> Stack:
        if self.stack is None:
            folder = self.tmp_path_factory.mktemp("stack")
            port = free_port()
            self.nats = start_nats("127.0.0.1", port, str(folder / "nats"))
            try:
                self.stack = launch_stack(f"nats://127.0.0.1:{port}", folder, extra=LLAMA3_POLICY)
            except BaseException:
                self.stop()
                raise
        return self.stack

    def stop(self) -> None:
        if self.stack is not None:
            self.stack.stop()
            self.stack = None
        if self.nats is not None:
            self.nats.stop()
            self.nats = None


_shared_stack: SharedStack | None = None


@pytest.fixture(scope="session")
def _shared_stack_holder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStack]:
    global _shared_stack
    _shared_stack = SharedStack(tmp_path_factory)
    try:
        yield _shared_stack
    finally:
        _shared_stack.stop()
        _shared_stack = None


@pytest.fixture(scope="module")
def zml_stack(_shared_stack_holder: SharedStack) -> Stack:
    """Sims + health + two routers + gateway, shared by every test that asks for it: for tests
    that read (a fault set by one is cleared by it). Its broker is its own: ``zml_stack.nats_url``."""
    return _shared_stack_holder.get()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if _shared_stack is not None and (nextitem is None or _file(nextitem) not in _shared_stack_files):
            _shared_stack.stop()


_shared_stack_files: set[str] = set()


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files using the shared stack one after the other (where the first of them was), so
    that one process (``-n 0``, or the unit xdist gets from tests/schedule.py) starts it once."""
    files: dict[str, bool] = {}
    for item in items:
        files[_file(item)] = files.get(_file(item), False) or SHARED_STACK in getattr(item, "fixturenames", ())
    _shared_stack_files.update(f for f, shared in files.items() if shared)
    first = next((i for i, f in enumerate(files) if files[f]), 0)
    rank = {f: (first if shared else i) for i, (f, shared) in enumerate(files.items())}
    items.sort(key=lambda item: rank[_file(item)])  # stable: the order within a file is kept


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadfile":
        return None
    return schedule.make_scheduler(config, log)


_record: schedule.Record | None = None


def _keep_bytecode(config: pytest.Config) -> None:
    """With PYTHONDONTWRITEBYTECODE set, every process the suite starts (2 xdist workers, ~40
    stacks of 5 services, `zml up`s, CLI runs) compiled ZML's sources again, and pytest rewrote
    every test module's asserts again: ~12 CPU-s of collection per worker. Bytecode is kept
    instead under pytest's cache folder (PYTHONPYCACHEPREFIX; an own prefix wins), so the source
    tree stays as clean as the variable asked. Set before the workers and services start, which
    inherit it."""
    if "PYTHONDONTWRITEBYTECODE" not in os.environ:
        return
    prefix = os.environ.get("PYTHONPYCACHEPREFIX") or sys.pycache_prefix
    if not prefix:
        try:
            cache = Path(os.path.expandvars(config.getini("cache_dir"))).expanduser()
        except ValueError:  # -p no:cacheprovider: its ini key is unknown
            cache = Path(".pytest_cache")
        prefix = str((config.rootpath / cache / "pycache") if not cache.is_absolute() else cache / "pycache")
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ["PYTHONPYCACHEPREFIX"] = sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False  # this process too: `-n 0` collects here


def pytest_configure(config: pytest.Config) -> None:
    global _record
    _keep_bytecode(config)
    if not hasattr(config, "workerinput"):  # the controller (or -n 0): it sees every report
        _record = schedule.Record(config)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _record is not None:
        _record.add(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _record is not None:
        _record.save()


@contextmanager
def lone_gateway(nats_url: str, folder: Path, request_timeout_s: int = 10) -> Iterator[str]:
    """A gateway alone on ``nats_url`` (no router, no fleet), for tests that stand in for the
    router on NATS; yields its URL once it listens."""
    config = folder / "zml.toml"
    config.write_text(f"[defaults]\nrequest_timeout_s = {request_timeout_s}\n")
    port = free_port()
    proc = spawn("gateway", service_argv("gateway", str(config), nats_url, "--port", str(port)))
    try:
        for _ in range(150):
            if wait_port("127.0.0.1", port, 0.2):
                break
            assert proc.alive(), proc.tail(30)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A broker of the module's own, for stacks whose KV buckets must not mix with others'."""
    port = free_port()
    proc = start_nats("127.0.0.1", port, str(tmp_path_factory.mktemp("nats")))
    try:
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.stop()


@dataclass
class SecureBus:
    """A nats-server with authorization as `zml up` runs it: an nkey identity per service and
    for the admin CLI, each with its role's permissions (zmlcore.access.permissions)."""

    url: str
    data_dir: Path
    proc: Proc
    seeds: dict[str, str]  # role/name -> seed file

    def issue(self, name: str, role: str = "client") -> str:
        from zml.cli import _identities

        ident = _identities.issue(self.data_dir, name, role=role)
        done = _identities.reload_server(self.data_dir)
        assert done is not None and done.confirmed, "nats-server did not confirm the reload"
        self.seeds[name] = ident.seed_file
        return ident.seed_file


def start_secure_bus(data_dir: Path, **tls: Any) -> SecureBus:
    from zml.cli import _identities

    ids = _identities.ensure_builtin(data_dir)
    conf = _identities.write_server_config(data_dir, **tls)
    port = free_port()
    proc = start_nats("127.0.0.1", port, str(data_dir / "jetstream"), config=conf)
    return SecureBus(f"nats://127.0.0.1:{port}", data_dir, proc, {n: i.seed_file for n, i in ids.items()})


@pytest.fixture(scope="module")
def secure_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBus]:
    """A broker of the module's own with authorization on (what `zml up` runs by default)."""
    bus = start_secure_bus(tmp_path_factory.mktemp("secure-nats"))
    try:
        yield bus
    finally:
        bus.proc.stop()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A test CA, server and client certificates, and a client certificate of another CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_bus(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBus]:
    """A broker with authorization and mutual TLS: it verifies client certificates."""
    bus = start_secure_bus(tmp_path_factory.mktemp("tls-nats"), tls_cert=pki.server_cert, tls_key=pki.server_key,
                           tls_ca=pki.ca, verify_clients=True)
    try:
        yield bus
    finally:
        bus.proc.stop()
