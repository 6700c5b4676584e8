"""``python -m zml_gateway --config zml.toml [--nats-url URL] [--host H] [--port P]``"""

from __future__ import annotations

import argparse
import asyncio
import errno
import socket
import sys

from zmlcore.config import load_config
from zmlcore.errors import ConfigError
from zmlcore.runner import install_uvloop, run_service
from zmlcore.telemetry import setup_logging, setup_tracing


def port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc.errno not in (errno.EADDRINUSE, errno.EACCES)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zml gateway", description="ZML HTTP gateway (OpenAI-compatible)")
    p.add_argument("--config", help="path to zml.toml")
    p.add_argument("--nats-url", help="NATS URL (overrides zml.toml and ZML_NATS_URL)")
    p.add_argument("--host", help="bind address (default from zml.toml, 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default from zml.toml, 8080)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging("gateway")
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"zml gateway: {exc}", file=sys.stderr)
        return 2
    host = args.host or cfg.gateway.host
    port = cfg.gateway.port if args.port is None else args.port
    if port and not port_free(host, port):
        print(f"zml gateway: port {port} on {host} is already in use (choose another with --port)", file=sys.stderr)
        return 2
    setup_tracing("zml-gateway")
    from zml_gateway.service import GatewayService

    install_uvloop()
    service = GatewayService(cfg, host, port)
    asyncio.run(run_service(service, args.nats_url or cfg.nats.url, "zml-gateway",
                            ready_line=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
