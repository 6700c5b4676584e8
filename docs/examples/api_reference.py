"""The API reference (seed 000): zml.Client, client.infer(), InferResult/InferMeta, error codes.

Run with a ZML endpoint in ZML_ENDPOINT (or a zml.toml here or in a parent folder).
"""

import zml

client = zml.Client(
    endpoint=None,        # str, defaults to ZML_ENDPOINT env var
    api_key=None,         # str, defaults to ZML_API_KEY env var
    timeout=30,           # int, seconds per request
    max_connections=10,  # int, connection pool size
    config_path=None       # str, path to zml.toml (auto-discovered if None)
)

result = client.infer(
    "meta-llama/llama-3-8b-instruct",  # str, required: model identifier
    "Explain tensor parallelism",      # str, required: input text
    max_tokens=512,      # int, max output tokens
    temperature=0.7,     # float, sampling temperature
    routing=None,        # str, override default policy for this call
    accelerator_id=None, # str, pin to a specific node (bypasses routing)
    stream=False          # bool, if True returns a stream of chunks
)

print(result.text)
meta = result.metadata
print(meta.accelerator_id, meta.routing_policy, meta.time_to_first_token,
      meta.queue_depth_at_dispatch, meta.total_tokens)

# Built-in policies by name, per call.
for policy in ("latency", "cost", "availability", "round_robin"):
    r = client.infer("meta-llama/llama-3-8b-instruct", "Hello", max_tokens=8, routing=policy)
    print(policy, "->", r.metadata.accelerator_id)

# A custom policy from zml.toml ([policy.custom_cost_latency]).
r = client.infer("meta-llama/llama-3-8b-instruct", "Hello", max_tokens=8, routing="custom_cost_latency")
print("custom_cost_latency ->", r.metadata.accelerator_id)

# Error codes: every failure is a zml.ZMLError with a code attribute.
try:
    client.infer("a-model-nobody-serves", "Hello", max_tokens=8)
except zml.ZMLError as e:
    print(e.code)  # MODEL_NOT_LOADED

client.close()
