"""SDK 0.3 post (seed 001): a routing failure carries routing_context, also in str(e)."""

import zml

client = zml.Client(max_retries=0)

try:
    response = client.infer(
        model="meta-llama/llama-3-8b-instruct",
        messages=[{"role": "user", "content": "Hello"}],
        policy="llama3-production",
        accelerator_id="no-such-node",   # forces a routing failure for the demo
    )
except zml.RoutingError as e:
    print(e.routing_context)
    print(e)           # the context is part of the message, so logging shows it
except zml.ZMLError as e:
    print(e.code, e)

# Policies are validated when created, not at the first call.
try:
    zml.Policy(name="typo", accelerator_chain=["H1OO"])
except zml.PolicyConfigError as e:
    print(e)
