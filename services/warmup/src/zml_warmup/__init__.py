"""ZML warmup service: pre-loads models in quiet periods."""
