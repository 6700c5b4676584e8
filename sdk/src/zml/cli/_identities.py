"""Identities on disk and the nats-server authorization built from them.

A data folder (``zml up``'s, default ``~/.local/share/zml``) holds::

    identities.json   name -> role + public nkey (no secrets)
    creds/NAME.nk     each identity's nkey seed, mode 0600 (the only copy of the private key)
    auth.conf         nats-server ``authorization`` block: one nkey user per identity, with
                      the permissions of its role (zmlcore.access.permissions); written from identities.json
    nats.conf         the embedded server's config: includes auth.conf, optional TLS, pid file
    nats.pid          written by nats-server; `zml creds issue/revoke` signal it to reload
    *_PID.ports       written by nats-server: its ports, incl. a loopback-only monitoring port
                      whose /varz ``config_load_time`` confirms that a reload took effect

Issuing or revoking an identity rewrites auth.conf and asks the running server to reload it
(SIGHUP, what ``nats-server --signal reload`` sends): no restart, and a revoked identity's
connections are closed by the server at once. A signal is only a request: ``reload_server``
returns once every server's /varz shows a newer config load, so an identity just issued can
connect as soon as the command returns.

    ident = issue(data_dir, "billing-batch")        # role "client"
    print(ident.seed_file, ident.public_key)
    revoke(data_dir, "billing-batch")
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from dataclasses import dataclass
from typing import NamedTuple
from pathlib import Path

from zmlcore.errors import ConfigError
from zmlcore.access.permissions import ROLES, SERVICE_ROLES, permissions

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
#: `zml up` creates these once; the CLI's own identity is "admin".
BUILTIN = (*SERVICE_ROLES, "admin")


@dataclass(frozen=True)
class Identity:
    name: str
    role: str
    public_key: str
    seed_file: str


def default_data_dir() -> Path:
    """``$ZML_DATA_DIR``, else ``$XDG_DATA_HOME/zml`` or ``~/.local/share/zml``."""
    chosen = os.environ.get("ZML_DATA_DIR")
    if chosen:
        return Path(chosen).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "zml"


def data_dir_of(flag: str | None) -> tuple[Path, bool]:
    """The data folder a command works on and whether the user chose it (``--data-dir`` or
    ``ZML_DATA_DIR``) rather than getting the default."""
    if flag:
        return Path(flag).expanduser(), True
    return default_data_dir(), bool(os.environ.get("ZML_DATA_DIR"))


def served_urls(data_dir: str | os.PathLike[str]) -> list[str]:
    """The client URLs of the nats-servers running from ``data_dir`` now (every member of a
    `zml up --cluster`): nats-server writes them to ``nats-server_PID.ports``; files of servers
    that are gone are ignored."""
    out: list[str] = []
    for ports in sorted(Path(data_dir).glob("*_*.ports")):
        pid = ports.stem.rpartition("_")[2]
        if not pid.isdigit() or not _is_nats_server(int(pid)):
            continue
        try:
            urls = json.loads(ports.read_text()).get("nats") or []
        except (OSError, ValueError, AttributeError):
            continue
        out += [str(u) for u in urls if isinstance(u, str)]
    return out


def _write_private(path: Path, data: str) -> None:
    """Write ``data`` to ``path`` atomically, readable by the owner only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(data)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _new_seed() -> str:
    import nkeys  # type: ignore[import-untyped,unused-ignore]

    return str(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER).decode())


def _public(seed: str) -> str:
    import nkeys  # type: ignore[import-untyped,unused-ignore]

    kp = nkeys.from_seed(bytearray(seed.encode()))
    try:
        return str(kp.public_key.decode())
    finally:
        kp.wipe()


def _load(data_dir: Path) -> dict[str, dict[str, str]]:
    path = data_dir / "identities.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    return {str(k): dict(v) for k, v in data.items()}


def identities(data_dir: str | os.PathLike[str]) -> list[Identity]:
    d = Path(data_dir)
    return [Identity(n, v["role"], v["public_key"], str(d / "creds" / f"{n}.nk")) for n, v in sorted(_load(d).items())]


def get(data_dir: str | os.PathLike[str], name: str) -> Identity | None:
    return next((i for i in identities(data_dir) if i.name == name), None)


def render_authorization(ids: list[Identity]) -> str:
    """The ``authorization`` block (nats-server's config format accepts JSON values)."""
    users = []
    lines = ["# Written by zml (zml.cli._identities) from identities.json: edit with `zml creds`.", "authorization {",
             "  users = ["]
    for ident in ids:
        users.append(f"    # {ident.name} ({ident.role})\n    "
                     + json.dumps({"nkey": ident.public_key, "permissions": permissions(ident.role, ident.public_key)}))
    lines.append(",\n".join(users))
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def _save(data_dir: Path, table: dict[str, dict[str, str]]) -> None:
    _write_private(data_dir / "identities.json", json.dumps(table, indent=2, sort_keys=True) + "\n")
    _write_private(data_dir / "auth.conf", render_authorization(identities(data_dir)))


def issue(data_dir: str | os.PathLike[str], name: str, role: str = "client") -> Identity:
    """Create identity ``name`` with ``role`` (a new seed file, mode 0600) and write auth.conf.
    Issuing an existing name is an error: revoke it first (that is how a seed is rotated)."""
    if not _NAME.match(name):
        raise ConfigError(f"identity name {name!r}: use letters, digits, '-' and '_' (at most 64)")
    if role not in ROLES:
        raise ConfigError(f"role {role!r}: one of {', '.join(ROLES)}")
    d = Path(data_dir)
    (d / "creds").mkdir(parents=True, exist_ok=True)
    os.chmod(d / "creds", 0o700)
    table = _load(d)
    if name in table:
        raise ConfigError(f"identity {name!r} exists ({table[name]['role']}): `zml creds revoke {name}` first")
    seed = _new_seed()
    seed_file = d / "creds" / f"{name}.nk"
    _write_private(seed_file, seed + "\n")
    table[name] = {"role": role, "public_key": _public(seed)}
    _save(d, table)
    return Identity(name, role, table[name]["public_key"], str(seed_file))


def revoke(data_dir: str | os.PathLike[str], name: str) -> Identity:
    """Remove identity ``name`` from auth.conf and delete its seed."""
    d = Path(data_dir)
    table = _load(d)
    if name not in table:
        raise ConfigError(f"no identity {name!r} in {d}")
    ident = Identity(name, table[name]["role"], table[name]["public_key"], str(d / "creds" / f"{name}.nk"))
    del table[name]
    _save(d, table)
    Path(ident.seed_file).unlink(missing_ok=True)
    return ident


def ensure_builtin(data_dir: str | os.PathLike[str]) -> dict[str, Identity]:
    """The service and admin identities, created on first use; auth.conf rewritten (so a
    change of permissions in a new ZML version applies at the next start)."""
    d = Path(data_dir)
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)
    for name in BUILTIN:
        ident = get(d, name)
        if ident is None or not Path(ident.seed_file).exists():
            if ident is not None:
                revoke(d, name)
            issue(d, name, role=name)
    _save(d, _load(d))
    return {i.name: i for i in identities(d) if i.name in BUILTIN}


def write_server_config(data_dir: str | os.PathLike[str], *, tls_cert: str | None = None, tls_key: str | None = None,
                        tls_ca: str | None = None, verify_clients: bool = False) -> str:
    """nats.conf for the embedded server (listen address and store come from the command line)."""
    d = Path(data_dir)
    lines = ["# Written by `zml up`: authorization is in auth.conf (zml creds issue/revoke edit it).",
             f"pid_file: {json.dumps(str(d / 'nats.pid'))}",
             # Monitoring on a free loopback port (a member's -m flag wins), named in the ports
             # file: its /varz tells `zml creds` when a reload has taken effect.
             'http: "127.0.0.1:-1"',
             f"ports_file_dir: {json.dumps(str(d))}",
             "include auth.conf"]
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ConfigError("NATS server TLS needs both server_tls_cert_file and server_tls_key_file")
        tls = {"cert_file": tls_cert, "key_file": tls_key, "timeout": 5}
        if tls_ca:
            tls["ca_file"] = tls_ca
        if verify_clients:
            if not tls_ca:
                raise ConfigError("server_tls_verify_clients needs tls_ca_file (the CA that signs client certificates)")
            tls["verify"] = True
        lines.append("tls " + json.dumps(tls))
    path = d / "nats.conf"
    _write_private(path, "\n".join(lines) + "\n")
    return str(path)


def running_server(data_dir: str | os.PathLike[str]) -> int | None:
    """The PID of the nats-server running from ``data_dir`` (its pid file), or None."""
    try:
        pid = int((Path(data_dir) / "nats.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if _is_nats_server(pid) else None


def _is_nats_server(pid: int) -> bool:
    """PID runs now and is a nats-server (not another process that got a stale file's PID)."""
    cmdline = Path(f"/proc/{pid}/cmdline")
    try:
        if cmdline.exists() and b"nats-server" not in cmdline.read_bytes():
            return False
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OSError):
        return False
    return True


class Reloaded(NamedTuple):
    pid: int
    #: every running server showed a newer config load within the wait (False: it may still
    #: be reloading, or it has no monitoring port to ask, or it rejected the new file)
    confirmed: bool


def reload_server(data_dir: str | os.PathLike[str], wait_s: float = 5.0) -> Reloaded | None:
    """Ask the running nats-server of ``data_dir`` to reload its config (SIGHUP to the PID in
    its pid file, what ``nats-server --signal reload`` sends), and every other member of a
    `zml up --cluster` (``nats-N.pid``), then wait up to ``wait_s`` for each to show a newer
    ``config_load_time`` on /varz. None if no server of this folder is running."""
    pid = running_server(data_dir)
    if pid is None:
        return None
    pids = [pid]
    for other in sorted(Path(data_dir).glob("nats-*.pid")):
        try:
            member = int(other.read_text().strip())
            if member != pid and b"nats-server" in Path(f"/proc/{member}/cmdline").read_bytes():
                pids.append(member)
        except (OSError, ValueError):
            pass  # that member is down: it reads the new file when it starts
    before = {p: _config_load_time(data_dir, p) for p in pids}
    signalled = []
    for p in pids:
        try:
            os.kill(p, signal.SIGHUP)
            signalled.append(p)
        except ProcessLookupError:
            pass
    if pid not in signalled:
        return None
    deadline = time.monotonic() + wait_s
    waiting = [p for p in signalled if before[p] is not None]
    while waiting and time.monotonic() < deadline:
        waiting = [p for p in waiting if _config_load_time(data_dir, p) in (None, before[p])]
        if waiting:
            time.sleep(0.02)
    return Reloaded(pid, confirmed=not waiting and all(before[p] is not None for p in signalled))


def _config_load_time(data_dir: str | os.PathLike[str], pid: int) -> str | None:
    """``config_load_time`` from /varz of server ``pid`` (its ports file names the monitoring
    URL); None when it has none or does not answer."""
    for ports in Path(data_dir).glob(f"*_{pid}.ports"):
        try:
            urls = json.loads(ports.read_text()).get("monitoring") or []
            with urllib.request.urlopen(f"{urls[0]}/varz", timeout=2) as r:  # noqa: S310 (loopback)
                value = json.loads(r.read()).get("config_load_time")
                return value if isinstance(value, str) else None
        except (OSError, ValueError, IndexError, AttributeError):
            return None
    return None
