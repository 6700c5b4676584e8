"""The batch runner service (docs/batches.md)."""
