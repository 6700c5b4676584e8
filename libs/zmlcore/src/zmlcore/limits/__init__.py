"""Plan limits: the plans and their arithmetic (plans), per-replica leases on a shared budget (leases) and the limiter every gateway and router replica shares over KV (limiter)."""
