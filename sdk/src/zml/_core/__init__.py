"""The sans-I/O core shared by ``Client`` and ``AsyncClient`` and by every transport.

It builds requests, decodes replies, stream events and errors, and decides retries. No sockets,
no clocks, no sleeping here: the clients and transports do the I/O and pass time and randomness
in, so every decision is unit-testable without a server. One module per concern:

- :mod:`.request`: call arguments -> :class:`InferCall` (body, headers, timeouts, token estimate);
- :mod:`.reply`: :class:`RawReply` -> results, or the ZMLError of an error reply;
- :mod:`.stream`: SSE lines, NATS stream messages and frames -> :class:`StreamEvent`;
- :mod:`.retry`: what a timeout or "no responders" means, and whether and when to try again;
- :mod:`.batches`: the Batch API's requests and replies (``client.batches``, ``client.files``);
- :mod:`.audio`: transcriptions and translations (the multipart form, every reply format).

Layering: request < reply < stream (retry beside them); all of them sit above ``zml._models``
and below the transports and clients, and import none of those.
"""

from zml._core.audio import AUDIO_DEFAULTS, AudioFile, build_audio, decode_transcription, read_audio
from zml._core.batches import ApiCall
from zml._core.reply import (
    RawReply,
    decode_embeddings,
    decode_error,
    decode_models,
    decode_nodes,
    decode_reply,
    lower_headers,
    metadata_for,
    nats_status,
    node_states,
    parse_output,
    routing_from_dict,
    routing_from_headers,
)
from zml._core.request import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_TEMPERATURE,
    EMBED_DEFAULTS,
    H_HTTP_ID_GENERATED,
    TIMEOUT_GRACE_S,
    InferCall,
    Kind,
    build_embed,
    build_infer,
    estimate_tokens,
    grace_s,
    new_request_id,
    response_format_wire,
    trace_headers,
)
from zml._core.retry import MAX_BACKOFF_S, MAX_JITTER_S, is_retryable, no_router_error, retry_delay, timeout_error
from zml._core.stream import SSEDecoder, StreamEvent, decode_chunk, decode_nats_frame, decode_nats_stream

__all__ = [
    "AUDIO_DEFAULTS",
    "ApiCall",
    "AudioFile",
    "build_audio",
    "decode_transcription",
    "read_audio",
    "DEFAULT_MAX_TOKENS",
    "DEFAULT_TEMPERATURE",
    "EMBED_DEFAULTS",
    "H_HTTP_ID_GENERATED",
    "MAX_BACKOFF_S",
    "MAX_JITTER_S",
    "TIMEOUT_GRACE_S",
    "InferCall",
    "Kind",
    "RawReply",
    "SSEDecoder",
    "StreamEvent",
    "build_embed",
    "build_infer",
    "decode_chunk",
    "decode_embeddings",
    "decode_error",
    "decode_models",
    "decode_nats_frame",
    "decode_nats_stream",
    "decode_nodes",
    "decode_reply",
    "estimate_tokens",
    "grace_s",
    "is_retryable",
    "lower_headers",
    "metadata_for",
    "nats_status",
    "new_request_id",
    "no_router_error",
    "node_states",
    "parse_output",
    "response_format_wire",
    "retry_delay",
    "routing_from_dict",
    "routing_from_headers",
    "timeout_error",
    "trace_headers",
]
