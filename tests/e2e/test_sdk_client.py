"""The SDK against the real stack: every behaviour, sync and async, over HTTP, gRPC and NATS."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import zml
from conftest import MODEL, Stack

CHAT = [{"role": "user", "content": "Explain tensor parallelism in two sentences."}]


@pytest.fixture(params=["http", "grpc", "nats"])
def endpoint(request: pytest.FixtureRequest, zml_stack: Stack) -> str:
    return {"http": zml_stack.gateway_url, "grpc": f"grpc://{zml_stack.grpc_target}",
            "nats": zml_stack.nats_url}[request.param]


@pytest.fixture()
def client(endpoint: str) -> Iterator[zml.Client]:
    with zml.Client(endpoint, timeout=20, max_retries=0) as c:
        yield c


def sim_state(stack: Stack, node_id: str) -> dict[str, Any]:
    return httpx.get(stack.sim_url(node_id) + "/sim/state", timeout=5).json()  # type: ignore[no-any-return]


def set_faults(stack: Stack, node_id: str, **faults: Any) -> None:
    r = httpx.post(stack.sim_url(node_id) + "/sim/faults", json=faults, timeout=5)
    assert r.status_code == 200, r.text


def running(stack: Stack, node_id: str) -> int:
    st = sim_state(stack, node_id)
    return int(st["batch"]["running"]) + int(st["queue"]["waiting"])


def wait_idle(stack: Stack, node_id: str, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running(stack, node_id) == 0:
            return True
        time.sleep(0.05)
    return False


def check_result(r: zml.InferResult, stack: Stack) -> None:
    assert r.text
    assert r.choices[0].message.content == r.text
    assert r.routing.node_id in stack.node_ids
    assert r.routing.family and r.routing.policy and r.routing.decision_id
    assert r.metadata.accelerator_id == r.routing.node_id
    assert r.metadata.routing_policy == r.routing.policy
    assert r.metadata.queue_depth_at_dispatch == r.routing.queue_depth >= 0
    assert r.metadata.time_to_first_token is not None and r.metadata.time_to_first_token > 0
    assert r.metadata.total_tokens == r.usage.total_tokens > 0
    assert r.metrics.retries == 0


# --- infer ---------------------------------------------------------------------------------------


def test_infer_prompt_and_messages_sync(client: zml.Client, zml_stack: Stack) -> None:
    r = client.infer(MODEL, "Once upon a time", max_tokens=5)
    check_result(r, zml_stack)
    assert r.usage.completion_tokens == 5
    r = client.infer(model=MODEL, messages=CHAT, max_tokens=4)
    check_result(r, zml_stack)
    assert f"[{r.routing.node_id}]" in r.text


async def test_infer_async(endpoint: str, zml_stack: Stack) -> None:
    async with zml.AsyncClient(endpoint, timeout=20, max_retries=0) as client:
        r = await client.infer(MODEL, "Once upon a time", max_tokens=5)
        check_result(r, zml_stack)
        r = await client.infer(model=MODEL, messages=CHAT, max_tokens=4)
        check_result(r, zml_stack)


def test_pin_policy_by_name_inline_and_routing(client: zml.Client) -> None:
    assert client.infer(MODEL, "hi", max_tokens=1, accelerator_id="a100-1").routing.node_id == "a100-1"
    assert client.infer(MODEL, "hi", max_tokens=1, policy="llama3-production").routing.policy == "llama3-production"
    assert client.infer(MODEL, "hi", max_tokens=1, routing="round_robin").routing.policy == "round_robin"
    pol = zml.Policy(name="mi300x-only", accelerator_chain=["MI300X"], cost_priority="cost")
    r = client.infer(MODEL, "hi", max_tokens=1, policy=pol)
    assert (r.routing.family, r.routing.policy) == ("MI300X", "mi300x-only")


def test_default_request_kwargs_and_per_call_override(endpoint: str) -> None:
    with zml.Client(endpoint, default_request_kwargs={"max_tokens": 3, "temperature": 0.0}) as client:
        assert client.infer(MODEL, "hi").usage.completion_tokens == 3
        assert client.infer(MODEL, "hi", max_tokens=2).usage.completion_tokens == 2
    with zml.Client(endpoint, model=MODEL) as client:  # a default model
        assert client.infer(prompt="hi", max_tokens=1).text


def test_response_format_unparseable_gives_none_and_a_warning(
    client: zml.Client, caplog: pytest.LogCaptureFixture
) -> None:
    pydantic = pytest.importorskip("pydantic")

    class Answer(pydantic.BaseModel):  # type: ignore[name-defined,misc]
        value: int

    with caplog.at_level(logging.WARNING, logger="zml"):
        r = client.infer(MODEL, "What is 2 + 2? Respond in JSON.", max_tokens=4, response_format=Answer)
    assert r.text and r.output_parsed is None
    assert any("could not parse" in rec.message for rec in caplog.records)


# --- streaming ------------------------------------------------------------------------------------


def test_stream_sync(client: zml.Client, zml_stack: Stack) -> None:
    with client.infer_stream(MODEL, messages=CHAT, max_tokens=6) as stream:
        chunks = [c.text for c in stream]
    assert len(chunks) >= 2 and "".join(chunks) == stream.text
    assert stream.routing is not None and stream.routing.node_id in zml_stack.node_ids
    assert stream.metadata.accelerator_id == stream.routing.node_id
    assert stream.done
    s2 = client.infer(MODEL, "hi", max_tokens=3, stream=True)
    assert isinstance(s2, zml.Stream) and "".join(c.text for c in s2) == s2.text != ""


async def test_stream_async(endpoint: str, zml_stack: Stack) -> None:
    async with zml.AsyncClient(endpoint) as client:
        stream = client.infer_stream(MODEL, messages=CHAT, max_tokens=6)
        chunks = [c.text async for c in stream]
        assert len(chunks) >= 2 and "".join(chunks) == stream.text
        assert stream.routing is not None and stream.routing.node_id in zml_stack.node_ids
        s2 = await client.infer(MODEL, "hi", max_tokens=3, stream=True)
        assert "".join([c.text async for c in s2]) == s2.text != ""


# --- cancellation reaches the node --------------------------------------------------------------


def test_closing_a_stream_cancels_on_the_node(client: zml.Client, zml_stack: Stack) -> None:
    node = "gaudi2-1"
    assert wait_idle(zml_stack, node)
    stream = client.infer_stream(MODEL, "write a long story", max_tokens=4000, accelerator_id=node)
    first = next(iter(stream))
    assert first.text and running(zml_stack, node) == 1
    stream.close()
    assert wait_idle(zml_stack, node), "the node still runs the closed stream"


async def test_cancelling_the_awaitable_cancels_on_the_node(endpoint: str, zml_stack: Stack) -> None:
    node = "a100-1"
    assert wait_idle(zml_stack, node)
    async with zml.AsyncClient(endpoint) as client:
        task = asyncio.ensure_future(client.infer(MODEL, "write a long story", max_tokens=4000, accelerator_id=node))
        for _ in range(100):
            await asyncio.sleep(0.02)
            if running(zml_stack, node):
                break
        assert running(zml_stack, node) == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(wait_idle, zml_stack, node), "the node still runs the cancelled request"
        # Same for an async stream cancelled mid-way.
        stream = client.infer_stream(MODEL, "write a long story", max_tokens=4000, accelerator_id=node)
        async for _chunk in stream:
            break
        await stream.aclose()
        assert await asyncio.to_thread(wait_idle, zml_stack, node)


# --- errors ---------------------------------------------------------------------------------------


def test_errors_have_codes_and_classes(client: zml.Client) -> None:
    with pytest.raises(zml.ModelNotLoadedError) as ei:
        client.infer("no-such-model", "hi", max_tokens=1)
    assert ei.value.code == "MODEL_NOT_LOADED" and isinstance(ei.value, zml.RoutingError)
    assert "[MODEL_NOT_LOADED]" in str(ei.value)
    with pytest.raises(zml.PolicyConfigError) as pe:
        client.infer(MODEL, "hi", max_tokens=1, policy="no-such-policy")
    assert pe.value.code == "POLICY_CONFIG"
    with pytest.raises(zml.BadRequestError):
        client.infer(MODEL, "hi", max_tokens=1, temperature=-1)


def test_routing_error_context_is_in_str(endpoint: str, zml_stack: Stack) -> None:
    # Every H100 overloaded, a chain of H100 only: the router says what it evaluated.
    nodes = ["h100-1", "h100-2"]
    for n in nodes:
        set_faults(zml_stack, n, overload=True)
    try:
        with zml.Client(endpoint, max_retries=0) as client:
            with pytest.raises(zml.ZMLError) as ei:
                client.infer(MODEL, "hi", max_tokens=1,
                             policy=zml.Policy(name="h100-only", accelerator_chain=["H100"]))
        err = ei.value
        assert isinstance(err, zml.QueueFullError) and isinstance(err, zml.RoutingError), err
        assert err.routing_context and err.routing_context.get("final_error")
        assert "routing_context=" in str(err) and "recommendation" in str(err)
    finally:
        for n in nodes:
            set_faults(zml_stack, n, overload=False)


def test_non_transient_errors_are_not_retried(endpoint: str) -> None:
    with zml.Client(endpoint, max_retries=3) as client:
        t0 = time.monotonic()
        with pytest.raises(zml.PolicyConfigError):
            client.infer(MODEL, "hi", max_tokens=1, policy="no-such-policy")
        assert time.monotonic() - t0 < 0.9  # no backoff sleep happened


def test_unreachable_endpoint_is_a_zml_error() -> None:
    for url in ("http://127.0.0.1:9", "grpc://127.0.0.1:9", "nats://127.0.0.1:9"):
        with zml.Client(url, max_retries=0, timeout=2) as client:
            with pytest.raises(zml.ConnectionError) as ei:
                client.infer(MODEL, "hi", max_tokens=1)
        assert ei.value.code == "CONNECTION_FAILED" and "zml up" in str(ei.value)

    async def go() -> None:
        for url in ("http://127.0.0.1:9", "grpc://127.0.0.1:9", "nats://127.0.0.1:9"):
            async with zml.AsyncClient(url, max_retries=0, timeout=2) as client:
                with pytest.raises(zml.ConnectionError):
                    await client.infer(MODEL, "hi", max_tokens=1)
                with pytest.raises(zml.ConnectionError):
                    async for _ in client.infer_stream(MODEL, "hi", max_tokens=1):
                        pass
    asyncio.run(go())


def test_wrong_api_key(zml_stack: Stack) -> None:
    # The test stack has no api_keys, so any key passes; the class mapping is unit-tested.
    with zml.Client(zml_stack.gateway_url, api_key="whatever") as client:
        assert client.infer(MODEL, "hi", max_tokens=1).text


# --- retries --------------------------------------------------------------------------------------


def test_retry_honours_retry_after_on_a_pinned_node(endpoint: str, zml_stack: Stack) -> None:
    node = "mi300x-2"
    set_faults(zml_stack, node, error_rate=1.0, error_status=429, retry_after_s=1)
    heal = threading.Timer(1.5, set_faults, args=(zml_stack, node), kwargs={"error_rate": 0.0, "retry_after_s": None})
    heal.start()
    try:
        with zml.Client(endpoint, max_retries=3) as client:
            t0 = time.monotonic()
            r = client.infer(MODEL, "hi", max_tokens=1, accelerator_id=node)
            elapsed = time.monotonic() - t0
        assert r.routing.node_id == node
        assert r.metrics.retries >= 1
        assert 0.9 <= elapsed < 1.0 * r.metrics.retries + 2.5  # waited Retry-After (1 s), not 2**n
    finally:
        heal.cancel()
        set_faults(zml_stack, node, error_rate=0.0, retry_after_s=None)


def test_retry_until_the_fleet_recovers(endpoint: str, zml_stack: Stack) -> None:
    nodes = zml_stack.node_ids
    for n in nodes:
        set_faults(zml_stack, n, error_rate=1.0, error_status=429, retry_after_s=1)
    heal = threading.Timer(1.2, lambda: [set_faults(zml_stack, n, error_rate=0.0, retry_after_s=None) for n in nodes])
    heal.start()
    try:
        with zml.Client(endpoint, max_retries=3) as client:
            t0 = time.monotonic()
            r = client.infer(MODEL, "hi", max_tokens=1)
            elapsed = time.monotonic() - t0
        assert r.text and 1 <= r.metrics.retries <= 3
        assert elapsed >= 0.9 * r.metrics.retries  # each retry waited the server's Retry-After
    finally:
        heal.join()


# --- rate limiting --------------------------------------------------------------------------------


# The client-side limiter paces calls before any transport sees them (2 s a run): over HTTP and
# NATS only, to keep the suite's time; the gateway's rate-limit metadata over gRPC is in
# test_grpc_front_door.py.
@pytest.fixture(params=["http", "nats"])
def paced_endpoint(request: pytest.FixtureRequest, zml_stack: Stack) -> str:
    return zml_stack.gateway_url if request.param == "http" else zml_stack.nats_url


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_rate_limiter_holds_the_rate(paced_endpoint: str, kind: str) -> None:
    endpoint = paced_endpoint
    rpm, n = 240.0, 9  # 4 requests/s with a burst of one: the 9 starts span >= 2 s
    starts: list[float] = []

    def note(i: int, r: zml.InferResult | None, e: BaseException | None) -> None:
        assert e is None, e
        assert r is not None
        starts.append(time.monotonic() - r.metrics.service_s)

    t0 = time.monotonic()
    if kind == "sync":
        with zml.Client(endpoint, rpm=rpm, max_request_burst=1) as client:
            client.infer_batch(["hi"] * n, on_result=note, max_parallel_requests=n, model=MODEL, max_tokens=1)
    else:
        async def go() -> None:
            async with zml.AsyncClient(endpoint, rpm=rpm, max_request_burst=1) as client:
                await client.infer_batch(["hi"] * n, on_result=note, max_parallel_requests=n, model=MODEL, max_tokens=1)
        asyncio.run(go())
    span = max(starts) - t0
    achieved = (n - 1) / span * 60.0  # first request free (burst of one), then the rate
    assert achieved <= rpm * 1.1, (achieved, starts)
    assert achieved >= rpm * 0.7, (achieved, starts)


# --- batches --------------------------------------------------------------------------------------


def test_batch_sync_order_callback_and_isolated_failure(client: zml.Client) -> None:
    items: list[Any] = [f"prompt {i}" for i in range(10)]
    items[4] = {"prompt": "bad", "model": "no-such-model"}
    items[7] = CHAT
    seen: list[int] = []
    out = client.infer_batch(items, on_result=lambda i, r, e: seen.append(i), max_parallel_requests=4,
                             model=MODEL, max_tokens=2)
    assert sorted(seen) == list(range(10))
    assert isinstance(out.errors[4], zml.ModelNotLoadedError) and out.results[4] is None
    assert out.failed == 1 and out.succeeded == 9
    assert all(out[i] is not None for i in range(10) if i != 4)


async def test_batch_async(endpoint: str) -> None:
    async with zml.AsyncClient(endpoint, model=MODEL) as client:
        seen: list[int] = []
        out = await client.infer_batch(["a", {"messages": CHAT, "max_tokens": 1}, {"prompt": "x", "model": "nope"}],
                                       on_result=lambda i, r, e: seen.append(i), max_tokens=2)
    assert sorted(seen) == [0, 1, 2]
    assert out.results[0] is not None and out.results[1] is not None and out.errors[2] is not None


# --- fleet ----------------------------------------------------------------------------------------


def test_nodes_and_models(client: zml.Client, zml_stack: Stack) -> None:
    nodes = client.nodes()
    assert {n.node_id for n in nodes} == set(zml_stack.node_ids)
    assert all(isinstance(n, zml.NodeState) for n in nodes)
    assert MODEL in client.models()
