"""SDK 0.3 post (seed 001): an inline policy chain, then the same policy by name from zml.toml."""

import zml

client = zml.Client(api_key="...")

# Define a policy inline
policy = zml.Policy(
    name="llama3-production",
    accelerator_chain=["H100", "MI300X", "H100_PCIe"],
    latency_target_ms=500,
    cost_priority="balanced"
)

response = client.infer(
    model="meta-llama/llama-3-8b-instruct",
    messages=[{"role": "user", "content": "Hello"}],
    policy=policy
)
print(response.text, response.routing)

response = client.infer(
    model="meta-llama/llama-3-8b-instruct",
    messages=[{"role": "user", "content": "Hello"}],
    policy="llama3-production"  # references zml.toml entry
)
print(response.routing.node_id, response.routing.family, response.routing.policy,
      response.routing.queue_depth, response.routing.decision_id)
