"""Arguments and helpers shared by the SDK's sub-commands (infer, batch, bench, nodes)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from zml._errors import PolicyConfigError
from zml._models import Policy


def add_client_args(p: argparse.ArgumentParser, *, retries: int = 3) -> None:
    g = p.add_argument_group("connection")
    g.add_argument("--endpoint", help="http(s)://gateway, grpc://gateway:grpc_port or nats://server "
                                      "(default: ZML_ENDPOINT, zml.toml, http://127.0.0.1:8080)")
    g.add_argument("--api-key", help="bearer key (default: ZML_API_KEY)")
    g.add_argument("--config", dest="config_path", help="zml.toml (default: found in . or a parent)")
    g.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
    g.add_argument("--max-retries", type=int, default=retries, help=f"retries of transient errors (default {retries})")
    g.add_argument("--data-dir", help="the `zml up` data folder whose admin identity NATS is used with when "
                                      "ZML_NATS_NKEY is unset (nats:// endpoints, nodes add/remove; default: "
                                      "ZML_DATA_DIR, then ~/.local/share/zml when its server is the one asked)")


def add_request_args(p: argparse.ArgumentParser, *, model_required: bool = True, max_tokens: int | None = None) -> None:
    g = p.add_argument_group("request")
    g.add_argument("--model", required=model_required, help="model id, e.g. meta-llama/llama-3-8b-instruct")
    g.add_argument("--policy", help="policy name from zml.toml or a built-in, or an inline JSON object "
                                    "like '{\"accelerator_chain\": [\"H100\", \"MI300X\"]}'")
    g.add_argument("--routing", help="policy name (the API reference's spelling)")
    g.add_argument("--accelerator-id", help="pin a node by id (bypasses routing)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="output token budget (default 512)")
    g.add_argument("--temperature", type=float, default=None, help="sampling temperature (default 0.7)")


def parse_policy(value: str | None) -> str | Policy | None:
    if value is None or not value.lstrip().startswith("{"):
        return value
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise PolicyConfigError(f"--policy: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise PolicyConfigError("--policy: expected a JSON object")
    data.setdefault("name", "inline")
    try:
        return Policy(**data)
    except TypeError as exc:
        raise PolicyConfigError(f"--policy: {exc}") from exc


def client_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    from zml.cli._bus import adopt_identity

    adopt_identity(args.endpoint, args.config_path, getattr(args, "data_dir", None))
    return {
        "endpoint": args.endpoint,
        "api_key": args.api_key,
        "config_path": args.config_path,
        "timeout": args.timeout,
        "max_retries": args.max_retries,
    }


def request_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "policy": parse_policy(args.policy),
        "routing": args.routing,
        "accelerator_id": args.accelerator_id,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
    }
    return {k: v for k, v in out.items() if v is not None}


def fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}s"
