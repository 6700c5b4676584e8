"""ZML health service."""
