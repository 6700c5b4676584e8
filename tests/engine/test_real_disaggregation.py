"""Disaggregated prefill/decode on two real llama-servers of one model (issue 31): llama-server's
slot save and restore (``--slot-save-path`` on one shared directory, ``POST /slots/N?action=
save|restore``) move a prompt's KV from the prefill node to the decode node, through ZML's
router:

* the decode leg finds >= 95% of the prompt cached (``timings.cache_n``, OpenAI's
  ``prompt_tokens_details.cached_tokens``), and its answer is the one the decode node gives the
  prompt un-split (greedy sampling);
* streamed to the ``openai`` client as one answer;
* the prefill server lost mid-leg (stopped as it took the leg, then killed): the leg goes to the
  second prefill server, whose KV the decode leg finds cached; with no prefill server left, the
  request is served whole on the decode node; each reply says which.

``[disaggregation] always``: two llama-servers of the same speed would never be split by the
estimate (moving KV only adds time), so the test asks for every request with a pair to be.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from conftest import MODEL, Stack, launch_stack
from enginefleet import SIM_FLEET, Llama, RealNode, llama, real_node_toml  # noqa: F401  (llama: a fixture)
from zmlcore.runtime.launch import free_port

pytestmark = pytest.mark.engine

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa".split()
POLICY = '[policies.cpu-only]\naccelerator_chain = ["CPU"]\nlatency_target_ms = 60000\n'


def prompt(seed: int, n: int = 900) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


class Pair:
    def __init__(self, stack: Stack, p: RealNode, d: RealNode, p2: RealNode) -> None:
        self.stack, self.p, self.d, self.p2 = stack, p, d, p2

    def chat(self, content: str, **kw: object) -> httpx.Response:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 12,
                "temperature": 0, "policy": "cpu-only", **kw}
        return httpx.post(self.stack.gateway_url + "/v1/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def pair(llama: Llama, own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:  # noqa: F811
    slots = tmp_path_factory.mktemp("slots")
    p = RealNode("llama-p", free_port(), ("--slot-save-path", str(slots)))
    d = RealNode("llama-d", free_port(), ("--slot-save-path", str(slots)))
    # a second prefill server, behind a slower link: chosen only when llama-p cannot take the leg
    p2 = RealNode("llama-p2", free_port(), ("--slot-save-path", str(slots)))
    for node in (p, d, p2):
        node.start(llama)
    stack = None
    try:
        roles = {"llama-p": 'roles = ["prefill"]\n', "llama-d": 'roles = ["decode"]\n',
                 "llama-p2": 'roles = ["prefill"]\n'}
        extra = POLICY + "[disaggregation]\nenabled = true\nalways = true\nmin_uncached_tokens = 256\n"
        for node in (p, d, p2):
            # kv_group and roles go before the served_names table
            toml = real_node_toml(node)
            head, tail = toml.split("[nodes.served_names]")
            gbps = 1 if node is p2 else 10
            extra += (head + roles[node.node_id] + f'kv_group = "cpu"\nkv_gbps = {gbps}\n' + "[nodes.served_names]"
                      + tail)
        stack = launch_stack(own_nats, tmp_path_factory.mktemp("pd"), fleet=SIM_FLEET, extra=extra, poll_s=0.5,
                             routers=1)
        for node_id in ("llama-p", "llama-d", "llama-p2"):
            _wait_up(stack.gateway_url, node_id)
        yield Pair(stack, p, d, p2)
    finally:
        if stack is not None:
            stack.stop()
        for node in (p, d, p2):
            node.stop()


def _wait_up(url: str, node_id: str) -> None:
    import time
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = {n["node_id"]: n for n in httpx.get(url + "/v1/nodes", timeout=10).json()["nodes"]}
        if rows.get(node_id, {}).get("status") == "up" and rows[node_id].get("models"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{node_id} never up")


def test_prefilled_on_one_decoded_on_the_other_same_answer(pair: Pair) -> None:
    text = prompt(1)
    r = pair.chat(text)
    assert r.status_code == 200, r.text
    body = r.json()
    z = body["zml"]
    assert z["prefill_node"] == "llama-p" and z["node_id"] == "llama-d", z
    usage = body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * usage["prompt_tokens"], usage
    print(f"decode leg: {cached} of {usage['prompt_tokens']} prompt tokens cached "
          f"({cached / usage['prompt_tokens']:.1%}); prefill leg {z['prefill_ms']:.0f} ms")
    split_answer = body["choices"][0]["message"]["content"]
    # The same prompt un-split on the decode node (its slot emptied first): the same answer.
    assert httpx.post(pair.d.url + "/slots/0?action=erase", timeout=10).status_code == 200
    whole = httpx.post(pair.d.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny-llama", "messages": [{"role": "user", "content": text}], "max_tokens": 12,
        "temperature": 0}).json()
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] < 0.05 * usage["prompt_tokens"]
    assert whole["choices"][0]["message"]["content"] == split_answer


def test_streamed_to_the_openai_client_as_one_answer(pair: Pair) -> None:
    import openai

    client = openai.OpenAI(base_url=pair.stack.gateway_url + "/v1", api_key="none")
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt(2)}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"policy": "cpu-only"})
    text, usage = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None and usage.completion_tokens == 12 and "".join(text)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens >= 0.95 * usage.prompt_tokens


def test_the_prefill_server_lost_mid_leg_the_other_one_prefills(pair: Pair) -> None:
    import signal
    import threading
    import time

    assert pair.p.proc is not None
    pair.p.proc.popen.send_signal(signal.SIGSTOP)  # it takes the leg and never answers...
    box: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: box.setdefault("r", pair.chat(prompt(3))))
    t.start()
    time.sleep(1.0)
    pair.p.kill()  # ... then dies with the leg in flight: its connection reset
    t.join(120)
    r = box["r"]
    assert r.status_code == 200, r.text
    body = r.json()
    z = body["zml"]
    assert z["node_id"] == "llama-d" and z["prefill_node"] == "llama-p2" and z["prefill_failed"] == "llama-p:network", z
    usage = body["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 0.95 * usage["prompt_tokens"], usage
    print(f"after llama-p was lost mid-leg: llama-p2 prefilled, the decode leg found {cached} of "
          f"{usage['prompt_tokens']} prompt tokens cached")


def test_with_no_prefill_server_left_the_request_is_served_whole(pair: Pair) -> None:
    import time

    deadline = time.monotonic() + 30  # llama-p (killed above) down as the fleet sees it
    while any(n["node_id"] == "llama-p" and n["status"] == "up"
              for n in httpx.get(pair.stack.gateway_url + "/v1/nodes", timeout=10).json()["nodes"]):
        assert time.monotonic() < deadline
        time.sleep(0.3)
    pair.p2.kill()
    r = pair.chat(prompt(4))
    assert r.status_code == 200, r.text
    z = r.json()["zml"]
    assert z["node_id"] == "llama-d" and not z.get("prefill_node")
    assert z["prefill_failed"] == "llama-p2:network"
    assert r.json()["usage"]["completion_tokens"] == 12
