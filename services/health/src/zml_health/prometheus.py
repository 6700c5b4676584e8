"""A small Prometheus text-format parser: enough for engines' /metrics (pure)."""

from __future__ import annotations


def parse_metrics(text: str) -> dict[str, float]:
    """Sum samples by metric name, across label sets (one model per engine in practice).

    >>> parse_metrics('vllm:num_requests_running{model_name="m"} 3.0\\n')["vllm:num_requests_running"]
    3.0
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        if brace >= 0:
            name = line[:brace]
            rest = line[line.rfind("}") + 1 :].split()
        else:
            name, _, tail = line.partition(" ")
            rest = tail.split()
        if not rest:
            continue
        try:
            value = float(rest[0])
        except ValueError:
            continue
        out[name] = out.get(name, 0.0) + value
    return out
