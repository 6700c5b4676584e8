"""Pure helpers of the SDK's CLI commands: bench statistics, batch files and progress, the
nodes table, argument parsing."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

import zml
from zml.cli import build_parser
from zml.cli._common import parse_policy
from zml.cli._batchio import Progress, read_items
from zml.cli.batch import load_done
from zml.cli.bench import Level, percentile, recommend
from zml.cli.nodes import after_add, render


def test_percentile_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 95), percentile(values, 99)) == (50, 95, 99)
    assert percentile([], 50) == 0.0 and percentile([3.0], 99) == 3.0


def level(c: int, rps: float, errors: int = 0) -> Level:
    return Level(c=c, requests=50, errors=errors, elapsed_s=1, rps=rps, p50_s=0.1, p95_s=0.2, p99_s=0.3,
                 svc_p95_s=0.2, q_p95_s=0.01)


def test_recommend_smallest_level_near_the_best_clean_throughput() -> None:
    assert recommend([level(1, 3), level(2, 6), level(4, 11), level(8, 11.5), level(16, 11.8)]) == 4
    assert recommend([level(1, 3), level(2, 6), level(4, 30, errors=5)]) == 2
    line = level(1, 3.14).line()
    assert line.startswith("c=1    rps=3.14  p50=0.100s  p95=0.200s  p99=0.300s  svc_p95=0.200s  q_p95=0.010s  err=0/50")


def test_read_items_forms(tmp_path: Path) -> None:
    f = tmp_path / "in.jsonl"
    f.write_text('{"prompt": "a", "id": 1}\n\n"b"\nplain text\n{"messages": [{"role": "user", "content": "c"}]}\n')
    items = read_items(str(f), chat=False)
    assert [i.get("prompt") for i in items] == ["a", "b", "plain text", None]
    assert read_items(str(f), chat=True)[1] == {"messages": [{"role": "user", "content": "b"}]}
    f.write_text('{"text": "no prompt"}\n')
    with pytest.raises(zml.BadRequestError, match="in.jsonl:1"):
        read_items(str(f), chat=False)


def test_load_done_keeps_first_successes_and_flags_anything_else(tmp_path: Path) -> None:
    f = tmp_path / "out.jsonl"
    rows = [{"index": 2, "output_text": "x"}, {"index": 0, "error": "boom"}, {"index": 2, "output_text": "dup"},
            {"index": 1, "output_text": "y"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"index": 3, "outp')
    done, dirty = load_done(str(f))
    assert list(done) == [2, 1] and json.loads(done[2])["output_text"] == "x" and dirty
    f.write_text(done[2] + done[1])
    assert load_done(str(f)) == ({2: done[2], 1: done[1]}, False)
    assert load_done(str(tmp_path / "missing")) == ({}, False)


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_tty_and_plain() -> None:
    tty = FakeTTY()
    p = Progress(10, 2, stream=tty)
    p.started -= 2.0
    p.ok, p.err = 3, 1
    line = p.line(p.started + 2.0)
    assert line.startswith("\r[") and "6/10 (60%) ok=5 err=1 2.0 req/s ETA 2s" in line
    plain = Progress(4, 0, stream=io.StringIO())
    plain.ok = 4
    assert plain.line(plain.started + 1).startswith("zml batch: 4/4 (100%)") and "ETA 0s" in plain.line(plain.started + 1)


def test_nodes_table() -> None:
    nodes = [{"node_id": "h100-1", "accelerator_type": "nvidia_h100", "family": "H100", "models": ["m"],
              "status": "up", "health_score": 97.4, "queue_running": 2, "queue_waiting": 1,
              "endpoint": "http://127.0.0.1:40123", "cache_fidelity": "precise", "kv_block_size": 64,
              "kv_blocks": 8192, "prefix_cache_hit_rate": 0.423, "kv_events": "live",
              "prefill_tps": 9812.4, "decode_tps": 58.2, "speeds_measured": True, "speeds_source": "measured",
              "speeds_at": 96.0, "roles": ["prefill"], "kv_group": "g1", "kv_gbps": 400.0},
             {"node_id": "mi300x-1", "accelerator_type": "amd_mi300x", "family": "MI300X", "models": [],
              "loading_models": ["m"], "status": "down", "reason": "driver too old", "cooldown_until": 105.0,
              "last_ok": 65.0, "prefill_tps": 12000.0, "decode_tps": 72.0,
              "note": "no node probe (GET /zml/v1/node): hardware not validated"}]
    lines = render(nodes, now=100.0).splitlines()
    assert lines[0].split() == ["NODE", "TYPE", "FAMILY", "MODELS", "HEALTH", "QUEUE", "STATE", "COOLDOWN", "SPEED",
                                "CACHE", "ROLES", "ENDPOINT", "NOTE"]
    assert lines[1].split() == ["h100-1", "nvidia_h100", "H100", "m", "97", "3", "up", "-", "9812/58:measured:4s",
                                "precise:8192x64:42%", "prefill@g1:400", "http://127.0.0.1:40123", "-"]
    # down for 35 s (its last good probe) and why; speeds from an older health service (no
    # speeds_source): the type's profile; the note in plain sight
    assert "(loading: m)" in lines[2] and "down 35s (driver too old)" in lines[2]
    assert lines[2].split()[-13:-7] == ["5.0s", "12.0k/72:default", "-", "both", "-", "no"]
    assert lines[2].endswith("no node probe (GET /zml/v1/node): hardware not validated")
    asleep = {"node_id": "cpu-1", "accelerator_type": "cpu", "family": "CPU", "models": ["m"], "status": "up",
              "sleeping": True, "health_score": 100.0, "speeds_source": "learned", "speeds_at": 40.0,
              "speeds_confidence": 0.62, "prefill_tps": 450.0, "decode_tps": 7.25,
              "missing_models": ["acme/tiny-chat"]}
    row = render([asleep], now=100.0).splitlines()[1]
    assert "up (asleep)" in row and "450/7.2:learned:60s:62%" in row and "m (missing: acme/tiny-chat)" in row


def test_nodes_help_explains_every_column(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["nodes", "--help"])
    text = capsys.readouterr().out
    for column in ("MODELS", "HEALTH", "QUEUE", "STATE", "COOLDOWN", "SPEED", "CACHE", "ROLES", "NOTE"):
        assert f"\n  {column} " in text, column
    flat = " ".join(text.split())  # argparse wraps to the terminal width
    assert "reported:32768x1:65%" in flat and "measured (the engine's counters, its per-request timings" in flat
    assert "the chance both speeds are within 25%" in flat


def test_after_add_says_what_the_first_poll_found() -> None:
    code, out, err = after_add("cpu-mid", "cpu at http://h:1", {
        "status": "up", "models": [], "missing_models": ["acme/tiny-chat"], "unknown_models": ["mid"]}, 10)
    assert code == 1 and out == "cpu-mid: added (cpu at http://h:1); serving nothing yet"
    assert "--served-name acme/tiny-chat=mid --replace" in err and "'mid'" in err
    assert after_add("n", "x", {"status": "up", "models": ["m"]}, 10) == (0, "n: added (x); serving m", "")
    code, out, err = after_add("n", "x", {"status": "up", "models": [], "missing_models": ["m"]}, 10)
    assert code == 0 and "`zml serve m --nodes n`" in err
    assert after_add("n", "x", {"status": "invalid", "reason": "declared nvidia_h100 but"}, 10)[0] == 1
    assert after_add("n", "x", None, 2.5)[1] == "n: added (x); not polled within 2.5 s: `zml nodes` shows it after its first poll"


def test_parsers_and_inline_policy() -> None:
    parser = build_parser()
    args = parser.parse_args(["bench", "--model", "m", "--concurrency", "1,2", "--requests", "5"])
    assert (args.concurrency, args.requests, args.max_retries, args.max_tokens) == ("1,2", 5, 0, 64)
    args = parser.parse_args(["batch", "--input", "i", "--output", "o", "--resume", "--rpm", "60"])
    assert args.resume and args.rpm == 60 and args.max_retries == 3
    pol = parse_policy('{"accelerator_chain": ["H100"], "cost_priority": "cost"}')
    assert isinstance(pol, zml.Policy) and pol.name == "inline"
    assert parse_policy("cost") == "cost"
    with pytest.raises(zml.PolicyConfigError):
        parse_policy('{"cost_priority": "free"}')
    with pytest.raises(zml.PolicyConfigError):
        parse_policy('{"bogus": 1}')


def test_nodes_add_backend_takes_common_spellings_and_lists_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    args = parser.parse_args(["nodes", "add", "n1", "--backend", "llama.cpp"])
    assert args.backend == "llamacpp"
    with pytest.raises(SystemExit):
        parser.parse_args(["nodes", "add", "n1", "--backend", "trt"])
    assert "unknown engine 'trt' (one of: vllm, tgi, sglang, llamacpp, openai)" in capsys.readouterr().err
    with pytest.raises(zml.PolicyConfigError, match=r"\(one of: cost, balanced, latency\)"):
        parse_policy('{"cost_priority": "free"}')
