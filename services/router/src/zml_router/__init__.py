"""ZML router service."""
