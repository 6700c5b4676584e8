"""Who may do what, and how much: NATS identities and TLS options (identity), the per-role bus
permissions (permissions), the gateway's API keys (apikeys), plans and the arithmetic of their
limits (plans), per-replica shares of a plan's budget (shares) and the limiter every gateway and
router replica shares over KV (limiter)."""
