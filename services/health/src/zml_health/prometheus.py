"""A small Prometheus text-format parser: enough for engines' /metrics (pure)."""

from __future__ import annotations


def info_labels(text: str, name: str) -> dict[str, str]:
    """The labels of the first sample of an info-style metric (``vllm:cache_config_info``).

    >>> info_labels('vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0', "vllm:cache_config_info")
    {'block_size': '16', 'num_gpu_blocks': '100'}
    """
    start = text.find(name + "{")
    while start > 0 and text[start - 1] != "\n":  # a longer name ending with this one
        start = text.find(name + "{", start + 1)
    if start < 0:
        return {}
    i = start + len(name) + 1
    out: dict[str, str] = {}
    while i < len(text) and text[i] != "}":
        eq = text.find("=", i)
        if eq < 0 or text[eq + 1:eq + 2] != '"':
            break
        key = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\" and j + 1 < len(text):
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1
    return out


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
