"""Which endpoint of a node a request goes to, and whether its model can answer that kind.

Chat, completions and embeddings share ``zml.infer``; the request's fields say its kind
(``messages``, ``prompt`` or ``input``) and ``[models."X"] embedding`` says what a configured
model is, so a chat request for an embedding model (or the reverse) is a clear 400 here
instead of whatever the engine makes of it.
"""

from __future__ import annotations

from zmlcore.config import ZMLConfig
from zmlcore.errors import BadRequestError
from zmlcore.messages import InferRequest

PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions", "embedding": "/v1/embeddings"}


def check_kind(cfg: ZMLConfig, model: str, req: InferRequest) -> None:
    """Raise BadRequestError when a configured model cannot answer this kind of request."""
    mc = cfg.models.get(model)
    if mc is None:
        return  # not configured: the node decides
    embedding = req.input is not None
    if embedding and not mc.embedding:
        raise BadRequestError(f"model {model!r} is not an embedding model (zml.toml: [models] embedding = false)")
    if mc.embedding and not embedding:
        raise BadRequestError(f"model {model!r} is an embedding model: use POST /v1/embeddings (`input`)")
