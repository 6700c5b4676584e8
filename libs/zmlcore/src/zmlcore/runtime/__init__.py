"""Running ZML's processes: a service's life (runner), liveness (alive), GC pacing (gcpace), one
active replica among several (lease), starting processes and sizing them (launch, sizing), and a
process's bound on the bytes it holds at once (bytebudget)."""
