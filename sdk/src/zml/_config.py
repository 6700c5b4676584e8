"""Where a client's endpoint and key come from: arguments, then ``ZML_ENDPOINT`` /
``ZML_API_KEY``, then zml.toml (``config_path``, or found in the working directory or a parent).

From zml.toml the endpoint is the gateway's ``http://host:port`` and the key the first of the
gateway's ``api_keys``; without any source the endpoint is the gateway default,
``http://127.0.0.1:8080``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zml._errors import ConfigError
from zmlcore.config import ZMLConfig, find_config, load_config

DEFAULT_ENDPOINT = "http://127.0.0.1:8080"
SCHEMES = ("http://", "https://", "nats://", "tls://", "grpc://", "grpcs://")


@dataclass(slots=True)
class Settings:
    endpoint: str
    api_key: str | None
    config: ZMLConfig | None


def gateway_url(cfg: ZMLConfig) -> str:
    host = cfg.gateway.host
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{cfg.gateway.port}"


def resolve(
    endpoint: str | None,
    api_key: str | None,
    config_path: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Settings:
    env = os.environ if env is None else env
    endpoint = endpoint or env.get("ZML_ENDPOINT") or None
    api_key = api_key or env.get("ZML_API_KEY") or None
    cfg: ZMLConfig | None = None
    path: Path | str | os.PathLike[str] | None = config_path if config_path is not None else find_config(cwd)
    if path is not None:
        try:
            cfg = load_config(path, env=dict(env))
        except ConfigError:
            if config_path is not None or endpoint is None:
                raise
            cfg = None
    if endpoint is None:
        endpoint = gateway_url(cfg) if cfg is not None else DEFAULT_ENDPOINT
    if api_key is None and cfg is not None and cfg.gateway.api_keys:
        api_key = cfg.gateway.api_keys[0]
    if not endpoint.startswith(SCHEMES):
        raise ConfigError(f"endpoint {endpoint!r} must start with http://, https://, nats:// or grpc://")
    return Settings(endpoint=endpoint.rstrip("/"), api_key=api_key, config=cfg)
