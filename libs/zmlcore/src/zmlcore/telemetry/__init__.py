"""What ZML tells operators: logging and tracing set-up (setup), spans and trace context (tracing), Prometheus metrics (metrics, tally) and their OTLP push (otlp)."""
