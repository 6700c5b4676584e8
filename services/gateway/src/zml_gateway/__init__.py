"""ZML gateway service."""
