"""What ``Client`` and ``AsyncClient`` configure identically: endpoint and key resolution
(:mod:`zml._config`), retry and batch settings, request defaults, the rate limiter, and the NATS
identity for a nats:// endpoint. Reads zml.toml, so it is not part of the sans-I/O core."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from zml import _core
from zml._config import resolve
from zml._errors import ConfigError
from zml._models import Policy
from zml._ratelimit import RateLimiter
from zmlcore.config import NatsConfig, ZMLConfig, load_config

__all__ = ["ClientSettings"]

class ClientSettings:
    """The settings both clients inherit; ``_configure`` is called by their ``__init__``."""

    endpoint: str
    api_key: str | None
    config: ZMLConfig | None

    def _configure(
        self,
        endpoint: str | None,
        api_key: str | None,
        timeout: float,
        max_connections: int,
        config_path: str | os.PathLike[str] | None,
        model: str | None,
        max_retries: int,
        max_parallel_requests: int | None,
        limits: Mapping[str, Any],
        default_output_tokens: int,
        default_request_kwargs: Mapping[str, Any] | None,
    ) -> int:
        """Set the shared attributes; returns the connection pool size for the transport."""
        settings = resolve(endpoint, api_key, config_path)
        self.endpoint = settings.endpoint
        self.api_key = settings.api_key
        self.config = settings.config
        self.timeout = float(timeout)
        self.model = model
        self.max_retries = max(0, int(max_retries))
        self.max_parallel_requests = int(max_parallel_requests or max_connections)
        self.default_output_tokens = int(default_output_tokens)
        self.default_request_kwargs: dict[str, Any] = dict(default_request_kwargs or {})
        self._limiter = RateLimiter(**limits, now=time.monotonic())
        return max(int(max_connections), self.max_parallel_requests)

    def nats_config(self) -> NatsConfig:
        """NATS identity and TLS for a nats:// endpoint: zml.toml's ``[nats]`` (or the defaults)
        with the environment's overrides (ZML_NATS_NKEY, ZML_NATS_TLS_*)."""
        base = self.config.nats if self.config is not None else load_config(None).nats
        return msgspec.structs.replace(base, url=self.endpoint)

    def _audio_call(self, task: _core.Kind, file: _core.AudioFile, model: str | None, response_format: str | None,
                    language: str | None, prompt: str | None, temperature: float | None,
                    granularities: Sequence[str] | None, stream: bool, routing: str | None,
                    policy: str | Policy | Mapping[str, Any] | None, accelerator_id: str | None,
                    kwargs: dict[str, Any]) -> _core.InferCall:
        """The call of a transcription or translation (both clients' ``transcribe``/``translate``)."""
        if self.endpoint.startswith(("grpc://", "grpcs://")):
            raise ConfigError("transcription goes through an http(s):// gateway or straight to nats://; the gRPC "
                              "API (zml.v1, docs/grpc.md) has no audio call")
        return _core.build_audio(
            task=task, file=file, model=model or self.model, response_format=response_format, language=language,
            prompt=prompt, temperature=temperature, timestamp_granularities=granularities, stream=stream,
            routing=routing, policy=policy, accelerator_id=accelerator_id, defaults=self.default_request_kwargs,
            extra=kwargs, client_timeout_s=self.timeout)
