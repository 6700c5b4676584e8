"""Prometheus ``/metrics`` of a simulated node, in the imitated engine's metric names.

The llama.cpp names are those of llama-server (build 11434, recorded in
tests/data/engines/llamacpp/metrics.txt); vLLM, SGLang and TGI follow their releases' names.
"""

from __future__ import annotations

from typing import Any, Callable

from zml_sim.nodeview import NodeView


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    inner = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in pairs.items())
    return "{" + inner + "}"


def _fmt(value: float) -> str:
    return repr(float(value))


class _Prom:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_fmt(value)}")

    def histogram(self, name: str, help_text: str, series: list[tuple[dict[str, str], Any]]) -> None:
        self.family(name, "histogram", help_text)
        for labels, hist in series:
            for bound, count in zip(hist.buckets, hist.counts):
                self.sample(f"{name}_bucket", {**labels, "le": _fmt(bound)}, count)
            self.sample(f"{name}_bucket", {**labels, "le": "+Inf"}, hist.count)
            self.sample(f"{name}_sum", labels, hist.sum)
            self.sample(f"{name}_count", labels, hist.count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def render_metrics(node: NodeView) -> str:
    """Prometheus exposition in the imitated engine's metric names."""
    eng = node.engine
    models = list(dict.fromkeys([*eng.models, *eng.stats]))
    stats = [eng.stats_for(m) for m in models]
    p = _Prom()
    kind = node.engine_kind
    if kind in ("vllm", "openai", "sglang"):
        pre = "sglang:" if kind == "sglang" else "vllm:"
        lab = [{"model_name": m} for m in models]
        gauges: list[tuple[str, str, Callable[[str], float]]]
        if kind == "sglang":
            gauges = [
                ("num_running_reqs", "The number of running requests.", eng.running_for),
                ("num_queue_reqs", "The number of requests in the waiting queue.", eng.waiting_for),
                ("token_usage", "The token usage.", lambda m: eng.kv_cache_usage),
            ]
        else:
            gauges = [
                ("num_requests_running", "Number of requests currently running on GPU.", eng.running_for),
                ("num_requests_waiting", "Number of requests waiting to be processed.", eng.waiting_for),
                ("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 lambda m: eng.kv_cache_usage),
                ("gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage.",
                 lambda m: eng.kv_cache_usage),
            ]
        for name, help_text, fn in gauges:
            p.family(pre + name, "gauge", help_text)
            for m, labels in zip(models, lab):
                p.sample(pre + name, labels, fn(m))
        p.family(pre + "prompt_tokens_total", "counter", "Number of prefill tokens processed.")
        for labels, s in zip(lab, stats):
            p.sample(pre + "prompt_tokens_total", labels, s.prompt_tokens)
        if kind != "sglang" and eng.prefix_cache is not None:
            _vllm_prefix_cache(p, node, lab, stats)
        elif kind == "sglang" and eng.prefix_cache is not None:
            p.family("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.")
            for labels, s in zip(lab, stats):
                p.sample("sglang:cache_hit_rate", labels, s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0)
        p.family(pre + "generation_tokens_total", "counter", "Number of generation tokens processed.")
        for labels, s in zip(lab, stats):
            p.sample(pre + "generation_tokens_total", labels, s.generation_tokens)
        if kind == "sglang":
            p.family("sglang:num_requests_total", "counter", "Number of requests processed.")
            for labels, s in zip(lab, stats):
                p.sample("sglang:num_requests_total", labels, sum(s.success.values()))
        else:
            p.family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
            for labels, s in zip(lab, stats):
                for reason, count in sorted(s.success.items()):
                    p.sample("vllm:request_success_total", {**labels, "finished_reason": reason}, count)
        p.histogram(pre + "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                    [(labels, s.ttft) for labels, s in zip(lab, stats)])
        p.histogram(pre + "e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                    [(labels, s.e2e) for labels, s in zip(lab, stats)])
        if kind != "sglang":
            p.histogram("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
                        [(labels, s.prefill) for labels, s in zip(lab, stats)])
            p.histogram("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
                        [(labels, s.decode) for labels, s in zip(lab, stats)])
            p.histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                        [(labels, s.gen_tokens) for labels, s in zip(lab, stats)])
    elif kind == "llamacpp":
        _llamacpp(p, node, stats)
    else:  # tgi
        p.family("tgi_queue_size", "gauge", "Number of requests waiting in the internal queue.")
        p.sample("tgi_queue_size", {}, len(eng.waiting))
        p.family("tgi_batch_current_size", "gauge", "Current batch size.")
        p.sample("tgi_batch_current_size", {}, eng.running)
        p.family("tgi_request_success", "counter", "Number of successful requests.")
        p.sample("tgi_request_success", {}, sum(sum(s.success.values()) for s in stats))
        p.family("tgi_request_failure", "counter", "Number of failed requests.")
        p.sample("tgi_request_failure", {}, sum(s.failed for s in stats))
        p.family("tgi_request_input_count", "counter", "Number of prompt tokens.")
        p.sample("tgi_request_input_count", {}, sum(s.prompt_tokens for s in stats))
        p.family("tgi_request_generated_tokens_count", "counter", "Number of generated tokens.")
        p.sample("tgi_request_generated_tokens_count", {}, sum(s.generation_tokens for s in stats))
        if stats:
            merged = stats[0].e2e.__class__(stats[0].e2e.buckets)
            for s in stats:
                merged.sum += s.e2e.sum
                merged.count += s.e2e.count
                merged.counts = [a + b for a, b in zip(merged.counts, s.e2e.counts)]
            p.histogram("tgi_request_duration", "Request duration in seconds.", [({}, merged)])
    return p.text()


def _vllm_prefix_cache(p: _Prom, node: NodeView, lab: list[dict[str, str]], stats: list[Any]) -> None:
    """vLLM's prefix-cache counters (tokens) and ``cache_config_info`` (an info gauge whose labels
    are the cache config: block_size and num_gpu_blocks are what ZML reads)."""
    eng = node.engine
    for name, help_text, attr in (
            ("prompt_tokens_cached_total", "Number of cached prompt tokens (local + external).", "cached_tokens"),
            ("prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.",
             "prefix_queries"),
            ("prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", "prefix_hits")):
        p.family("vllm:" + name, "counter", help_text)
        for labels, s in zip(lab, stats):
            p.sample("vllm:" + name, {**labels, "engine": "0"}, getattr(s, attr))
    cache = eng.prefix_cache
    assert cache is not None
    p.family("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
    p.sample("vllm:cache_config_info", {
        "block_size": str(cache.block_size), "cache_dtype": "auto", "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9", "num_cpu_blocks": "None", "num_gpu_blocks": str(eng.cache_capacity_blocks),
        "prefix_caching_hash_algo": "sha256", "engine": "0"}, 1.0)


def _llamacpp(p: _Prom, node: NodeView, stats: list[Any]) -> None:
    """llama-server's counters then gauges, unlabelled, in its order (no KV-cache gauge)."""
    eng = node.engine
    cached = sum(s.cached_tokens for s in stats)
    prompt = sum(s.prompt_tokens for s in stats) - cached  # llama-server counts computed tokens only
    prompt_s = sum(s.prefill.sum for s in stats)
    predicted = sum(s.generation_tokens for s in stats)
    steps = eng.decode_steps
    counters = [
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", prompt),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cached),
        ("prompt_seconds_total", "Total time spent processing prompts", prompt_s),
        ("tokens_predicted_total", "Number of generation tokens processed", predicted),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", eng.decode_slot_seconds),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and "
                           "multimodal decoding", steps),
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", 0),
    ]
    gauges = [
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s", prompt / prompt_s if prompt_s else 0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         predicted / eng.decode_slot_seconds if eng.decode_slot_seconds else 0),
        ("requests_processing", "Number of requests processing", eng.running),
        ("requests_deferred", "Number of requests deferred", len(eng.waiting)),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         eng.busy_slot_steps / max(steps, 1)),
    ]
    for kind, items in (("counter", counters), ("gauge", gauges)):
        for name, help_text, value in items:
            p.family("llamacpp:" + name, kind, help_text)
            p.sample("llamacpp:" + name, {}, value)
