"""Ports of the simulated nodes `zml up` starts: free ones for the shipped demo fleet (so two
`zml up` on one machine do not collide), ``--sim-port-base N`` for N, N+1, ... in node order.

The services all read one zml.toml, so the ports are changed in a copy of it: each sim node's
endpoint (and a probe endpoint on the same address) is replaced in the TOML text, which keeps
the file's comments and layout, and the copy is loaded again to check every endpoint moved.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import urlsplit

from zmlcore.config import NodeConfig, ZMLConfig, load_config
from zmlcore.errors import ConfigError
from zmlcore.runtime.launch import listen_ports


def pick_ports(nodes: list[NodeConfig], base: int | None, host: str = "127.0.0.1") -> dict[str, int]:
    """node id -> port: ``base + i``, or a distinct free port each when ``base`` is None."""
    if base is not None:
        return {n.id: base + i for i, n in enumerate(nodes)}
    ports: dict[str, int] = {}
    for n in nodes:
        port = listen_ports(1, host)
        while port in ports.values():
            port = listen_ports(1, host)
        ports[n.id] = port
    return ports


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def with_ports(text: str, nodes: list[NodeConfig], ports: dict[str, int]) -> str:
    """``text`` (a zml.toml) with each node's endpoint origin moved to its new port (all at
    once: a new port may be another node's old one)."""
    moves: dict[str, str] = {}
    for n in nodes:
        parts = urlsplit(n.endpoint)
        host = parts.hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
        moves[_origin(n.endpoint)] = f"{parts.scheme}://{host}:{ports[n.id]}"
    if not moves:
        return text
    # Only inside a TOML string, and only a whole origin (":91010" is not ":9101").
    pattern = re.compile(r"""(["'])(""" + "|".join(map(re.escape, moves)) + r""")(?=[/"'])""")
    return pattern.sub(lambda m: m.group(1) + moves[m.group(2)], text)


def relocate(config: str, cfg: ZMLConfig, base: int | None, into: Path) -> tuple[str, ZMLConfig]:
    """A copy of ``config`` in folder ``into`` with the sim nodes on new ports."""
    sims = [n for n in cfg.nodes if n.sim is not None]
    ports = pick_ports(sims, base)
    bad = [p for p in ports.values() if not 0 < p < 65536]
    if bad:
        raise ConfigError(f"--sim-port-base gives port {bad[-1]}, outside 1..65535")
    path = into / "zml.toml"
    path.write_text(with_ports(Path(config).read_text(), sims, ports))
    moved = load_config(path)
    wrong = [n.id for n in moved.nodes if n.id in ports and urlsplit(n.endpoint).port != ports[n.id]]
    if wrong:
        raise ConfigError(f"{config}: could not move the endpoint of sim node {wrong[0]!r} to a new port")
    return str(path), moved
