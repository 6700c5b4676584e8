"""Operator commands work after `zml up` as a newcomer meets them: a fresh home (so a fresh
default data folder), `zml up` in one process, and a second "shell" with a clean environment
(no ZML_* variable) running `zml nodes add`, `zml cost set`, `zml serve`, `zml creds ...`,
`zml keys ...`. They find the data folder's admin identity by themselves, as kubectl finds its
kubeconfig; a shell whose data folder is another one is told, in one line and at once, what to
pass; Ctrl-C ends a command without a traceback.

Before: without ZML_NATS_NKEY the commands connected anonymously and nats-py retried the
"Authorization Violation" forever (`zml nodes add` hung; Ctrl-C printed a traceback).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from zmlcore.runtime.launch import Proc, free_port, spawn

MODEL = "meta-llama/llama-3-8b-instruct"


def _clean_env(home: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """A second shell's environment: PATH and HOME (plus ``extra``), and where Python keeps
    bytecode (PYTHONPYCACHEPREFIX, PYTHONDONTWRITEBYTECODE, as tests/conftest.py set them):
    without them each command wrote __pycache__ folders into the source tree."""
    python = {k: v for k, v in os.environ.items() if k in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
    return {"PATH": os.environ["PATH"], "HOME": str(home), **python, **(extra or {})}


@dataclass
class Newcomer:
    home: Path
    gateway: str
    nats_url: str
    data_dir: Path
    up: Proc

    def shell(self, *args: str, home: Path | None = None, env: dict[str, str] | None = None,
              timeout: float = 60) -> tuple[subprocess.CompletedProcess[str], float]:
        """``zml ARGS`` in a second shell: PATH and HOME only (plus ``env``; see _clean_env), in an
        empty folder."""
        cwd = (home or self.home) / "work"
        cwd.mkdir(exist_ok=True)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "zml.cli", *args], capture_output=True, text=True, timeout=timeout,
                             cwd=cwd, env=_clean_env(home or self.home, env))
        return out, time.monotonic() - t0


@pytest.fixture(scope="module")
def newcomer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Newcomer]:
    home = tmp_path_factory.mktemp("home")
    gw, nats_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZML_", "XDG_"))}
    env["HOME"] = str(home)
    up = spawn("zml-up", [sys.executable, "-m", "zml.cli", "up", "--gateway-port", str(gw), "--nats-port",
                          str(nats_port), "--standby", "0"], env=env, cwd=str(home))
    try:
        assert up.wait_for("zml ready", 120), up.tail()
        yield Newcomer(home, f"http://127.0.0.1:{gw}", f"nats://127.0.0.1:{nats_port}",
                       home / ".local" / "share" / "zml", up)
    finally:
        up.stop()


def _ok(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 0, f"rc={out.returncode}\n{out.stdout}\n{out.stderr}"
    assert "Traceback" not in out.stderr, out.stderr
    return out.stdout


def test_banner_says_commands_need_nothing(newcomer: Newcomer) -> None:
    banner = next(line for line in newcomer.up.lines if "authorization on" in line)
    assert "admin identity by themselves" in banner, banner


def test_operator_commands_find_the_admin_identity(newcomer: Newcomer) -> None:
    sim = httpx.get(newcomer.gateway + "/v1/nodes", timeout=10).json()["nodes"][0]
    # declared as what it is: a node that fails hardware validation is added, but exits 1
    out, took = newcomer.shell("nodes", "add", "foo", "--accelerator", sim["accelerator_type"], "--backend", "openai",
                               "--url", sim["endpoint"], "--serves", "x")
    assert "foo: added" in _ok(out) and took < 30
    assert "h100-1: $1.5/h" in _ok(newcomer.shell("cost", "set", "h100-1", "1.5")[0])
    assert "ready on 1 node" in _ok(newcomer.shell("serve", MODEL, "--nodes", "h100-1")[0])
    # the node list over NATS as the admin identity too (an SDK-based command)
    listed = _ok(newcomer.shell("nodes", "--json", "--endpoint", newcomer.nats_url)[0])
    assert "h100-1" in {n["node_id"] for n in json.loads(listed)["nodes"]}
    # the URL named as the user would type it: still the local `zml up`
    local = newcomer.nats_url.replace("127.0.0.1", "localhost")
    assert "foo: removed" in _ok(newcomer.shell("nodes", "remove", "foo", "--nats-url", local)[0])


def test_creds_and_keys_from_a_second_shell(newcomer: Newcomer) -> None:
    issued = _ok(newcomer.shell("creds", "issue", "billing", "--plan", "maker")[0])
    assert "issued billing (client)" in issued and "plan maker" in issued and "reloaded" in issued
    assert "billing" in _ok(newcomer.shell("creds", "list")[0])
    assert "plan team" in _ok(newcomer.shell("creds", "plan", "billing", "--plan", "team")[0])
    key = _ok(newcomer.shell("keys", "create", "--plan", "maker", "--name", "ci")[0])
    assert "key:  zml_" in key
    assert "ci" in _ok(newcomer.shell("keys", "list")[0])
    assert "revoked billing" in _ok(newcomer.shell("creds", "revoke", "billing")[0])


def test_another_shells_data_folder_is_told_what_to_pass(newcomer: Newcomer, tmp_path: Path) -> None:
    stranger = tmp_path / "other-home"  # no `zml up` runs from this home's data folder
    stranger.mkdir()
    args = ("cost", "set", "h100-1", "2", "--nats-url", newcomer.nats_url)
    out, took = newcomer.shell(*args, home=stranger)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zml: error: [AUTH_FAILED]"), lines
    assert "--data-dir" in lines[0] and "ZML_DATA_DIR" in lines[0] and "ZML_NATS_NKEY" in lines[0]
    # ... and doing what it says works: --data-dir, ZML_DATA_DIR or ZML_NATS_NKEY
    done, took_ok = newcomer.shell(*args, "--data-dir", str(newcomer.data_dir), home=stranger)
    _ok(done)
    # The refusal itself is immediate: no slower than the same command done (interpreter start-up,
    # connect, one request), where waiting out a timeout would be 3 s more. Not an absolute bound:
    # start-up alone took 7 s at load 17.
    assert took < took_ok + 3, (took, took_ok)
    _ok(newcomer.shell(*args, home=stranger, env={"ZML_DATA_DIR": str(newcomer.data_dir)})[0])
    _ok(newcomer.shell(*args, home=stranger, env={"ZML_NATS_NKEY": str(newcomer.data_dir / "creds" / "admin.nk")})[0])
    # a service identity connects, but its role may not do this: said at once, not a timeout
    out, took = newcomer.shell(*args, env={"ZML_NATS_NKEY": str(newcomer.data_dir / "creds" / "gateway.nk")})
    assert out.returncode == 1 and "[AUTH_FAILED]" in out.stderr and "admin role" in out.stderr, out.stderr
    assert took < took_ok + 3, (took, took_ok)


def _wait_for_connection(listener: socket.socket, proc: subprocess.Popen[str]) -> socket.socket:
    """The command's connection, however long a loaded box takes to import and start it (the
    full suite on 2 busy cores once took over 30 s); if the command ends first, its stderr."""
    listener.settimeout(0.5)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            return listener.accept()[0]
        except TimeoutError:
            if proc.poll() is not None:
                raise AssertionError(f"the command ended before connecting: {proc.communicate()}") from None
    proc.kill()
    raise AssertionError(f"the command never connected in 90 s: {proc.communicate()}")


@pytest.mark.parametrize("argv", [
    ("nodes", "add", "n", "--accelerator", "cpu", "--url", "http://127.0.0.1:9", "--serves", "x"),
    ("infer", "--model", MODEL, "--prompt", "hi"),  # the SDK's sync bridge over nats://
])
def test_ctrl_c_ends_a_command_without_a_traceback(newcomer: Newcomer, argv: tuple[str, ...]) -> None:
    with socket.socket() as silent:  # accepts connections and never answers: the command waits
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"nats://127.0.0.1:{silent.getsockname()[1]}"
        extra = ("--endpoint", url) if argv[0] == "infer" else ("--nats-url", url)
        proc = subprocess.Popen([sys.executable, "-m", "zml.cli", *argv, *extra], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=newcomer.home,
                                env=_clean_env(newcomer.home),
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        conn = _wait_for_connection(silent, proc)  # the command is past start-up and waits for NATS's INFO
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        conn.close()
        _, err = proc.communicate(timeout=10)
    assert proc.returncode in (130, -signal.SIGINT), (proc.returncode, err)
    assert "Traceback" not in err and "Task was destroyed" not in err, err
