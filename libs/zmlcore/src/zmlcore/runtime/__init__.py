"""Running ZML's processes: a service's life (runner), liveness (alive), GC pacing (gcpace), one active replica among several (lease), and starting processes and sizing them (launch, sizing)."""
