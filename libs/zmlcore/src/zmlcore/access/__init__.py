"""Who may do what: NATS identities and TLS options (identity), the per-role bus permissions (permissions) and the gateway's API keys (apikeys)."""
