"""The inference routes (POST /v1/chat/completions, /v1/completions, /v1/embeddings), one
module per step: :mod:`~zml_gateway.infer.handler` (the steps in order), ``intake`` (body,
checks, the headers for the routers), ``upstream`` (the NATS exchange, cancels, aborts),
``once`` (one whole reply) and ``stream`` (a streamed reply relayed as SSE)."""
