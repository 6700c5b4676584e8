"""The fleet's static and run-time facts: accelerator types and families (accelerators), each
type's performance model (perfmodel), run-time prices (costs), run-time node registration
(registry), and what the nodes' engines say about their KV caches (kvevents: vLLM's wire format)."""
