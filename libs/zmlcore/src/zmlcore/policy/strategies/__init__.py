"""One module per routing strategy. Each ``select(ctx)`` returns the chosen candidate or None
(no routable node); :func:`zmlcore.policy.choose_node` turns None into the right error."""

from zmlcore.policy.strategies import availability, chain, cost, latency, round_robin, weighted

__all__ = ["availability", "chain", "cost", "latency", "round_robin", "weighted"]
