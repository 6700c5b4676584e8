"""``python -m zml_gateway --config zml.toml [--nats-url URL] [--host H] [--port P] [--grpc-port G]`` (``zml gateway``)."""

from __future__ import annotations

import argparse
import sys

from zmlcore.config import ZMLConfig
from zmlcore.errors import ConfigError
from zmlcore.runtime.launch import port_in_use
from zmlcore.runtime.runner import Service, service_main, service_parser


def build_parser() -> argparse.ArgumentParser:
    p = service_parser("gateway", "ZML HTTP gateway (OpenAI-compatible)")
    p.add_argument("--host", help="bind address (default from zml.toml, 127.0.0.1)")
    p.add_argument("--port", type=int, help="HTTP port (default from zml.toml, 8080)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (default from zml.toml [gateway] grpc_port; 0: off)")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT so several gateway processes share the port (`zml up` does)")
    return p


def _make(cfg: ZMLConfig, args: argparse.Namespace) -> Service:
    from zml_gateway.service import GatewayService

    host = args.host or cfg.gateway.host
    port = cfg.gateway.port if args.port is None else args.port
    if port and not args.reuse_port and port_in_use(host, port):
        raise ConfigError(f"port {port} on {host} is already in use (choose another with --port)")
    grpc_port = cfg.gateway.grpc_port if args.grpc_port is None else args.grpc_port
    if grpc_port and not args.reuse_port and port_in_use(host, grpc_port):
        raise ConfigError(f"gRPC port {grpc_port} on {host} is already in use (choose another with --grpc-port)")
    return GatewayService(cfg, host, port, reuse_port=args.reuse_port, grpc_port=grpc_port)


def main(argv: list[str] | None = None) -> int:
    return service_main("gateway", build_parser().parse_args(argv), _make)


if __name__ == "__main__":
    sys.exit(main())
