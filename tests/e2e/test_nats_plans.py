"""Plans for raw NATS clients (issue 9): a client identity with a plan (`zml creds issue NAME
--plan ...`) is limited by the routers as an API key is by the gateways, with one budget shared by
every router replica, and by HTTP and NATS when the identity shares an API key's plan.

A secure broker of the module's own (identities and permissions as `zml up` runs them) with two
routers; the clients connect with their own nkey seeds, exactly as an external system would.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import nats
import pytest
from nats.aio.client import Client as NATS

from conftest import MODEL, SecureBus, Stack, launch_stack
from zmlcore import subjects
from zmlcore.config import NatsConfig
from zmlcore.access.identity import connect_options

OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
RPM = 10


@pytest.fixture(scope="module")
def stack(secure_bus: SecureBus, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = launch_stack(secure_bus.url, tmp_path_factory.mktemp("plans"), routers=2, identities=secure_bus.seeds)
    try:
        yield s
    finally:
        s.stop()


def _creds(bus: SecureBus, stack: Stack, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "zml.cli", "creds", *args, "--data-dir", str(bus.data_dir),
                          "--nats-url", bus.url, "--config", stack.config_path],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def _issue(bus: SecureBus, stack: Stack, name: str, *plan: str) -> None:
    _creds(bus, stack, "issue", name, *plan)
    bus.seeds[name] = str(bus.data_dir / "creds" / f"{name}.nk")


async def _connect(bus: SecureBus, name: str) -> NATS:
    # `zml creds issue` returns once the server has confirmed the reload: no retry needed.
    return await nats.connect(bus.url, allow_reconnect=False, connect_timeout=5,
                              **connect_options(NatsConfig(url=bus.url), seed_file=bus.seeds[name]))


async def _ask(nc: NATS) -> tuple[str, dict[str, str], dict]:  # type: ignore[type-arg]
    """(error code or "", headers, body) of one chat request over raw NATS."""
    msg = await nc.request(subjects.INFER, json.dumps(OK).encode(), timeout=30)
    headers = dict(msg.headers or {})
    return headers.get(subjects.H_ERROR_CODE, ""), headers, json.loads(msg.data)


async def _until(check, timeout: float = 10.0) -> float:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    while not await check():
        assert time.monotonic() - t0 < timeout, "condition not reached"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def test_plan_limits_a_client_identity_across_two_routers(secure_bus: SecureBus, stack: Stack) -> None:
    _issue(secure_bus, stack, "metered", "--plan", "custom", "--rpm", str(RPM))
    _issue(secure_bus, stack, "unplanned")
    metered, free = await _connect(secure_bus, "metered"), await _connect(secure_bus, "unplanned")
    try:
        results = [await _ask(metered) for _ in range(3 * RPM)]
        served = [body for code, _, body in results if not code]
        refused = [(code, h) for code, h, _ in results if code]
        # One budget for both replicas: per-replica counting would admit up to twice the rate.
        assert len(served) == RPM, [c for c, _, _ in results]
        assert {b["zml"]["router_id"] for b in served} == {"router-1", "router-2"}, "one router took every request"
        assert all(code == "RATE_LIMITED" for code, _ in refused)
        _, h = refused[-1]
        assert h["x-ratelimit-limit-requests"] == str(RPM)
        assert h["x-ratelimit-remaining-requests"] == "0"
        assert float(h[subjects.H_RETRY_AFTER]) > 0 and int(h["retry-after"]) >= 1
        assert h["x-ratelimit-reset-requests"].endswith("s")
        # An identity without a plan is not limited on raw NATS.
        assert [(await _ask(free))[0] for _ in range(3 * RPM)] == [""] * (3 * RPM)

        # Changing the plan applies on every router within a second (both must let it through).
        _creds(secure_bus, stack, "plan", "metered", "--plan", "team")
        t0 = time.monotonic()

        async def admitted() -> bool:
            codes = [(await _ask(metered))[0] for _ in range(4)]
            return codes == [""] * 4
        await _until(admitted, 10.0)
        assert time.monotonic() - t0 < 1.5
        # Back to a small plan, then removed: no limit at all.
        _creds(secure_bus, stack, "plan", "metered", "--plan", "custom", "--rpm", "1")

        async def limited() -> bool:
            return (await _ask(metered))[0] == "RATE_LIMITED"
        await _until(limited, 10.0)
        _creds(secure_bus, stack, "plan", "metered", "--none")
        t0 = time.monotonic()
        await _until(admitted, 10.0)
        assert time.monotonic() - t0 < 1.5
    finally:
        await metered.close()
        await free.close()


async def test_concurrency_of_a_plan_over_nats(secure_bus: SecureBus, stack: Stack) -> None:
    _issue(secure_bus, stack, "narrow", "--plan", "custom", "--concurrent", "2")
    nc = await _connect(secure_bus, "narrow")
    try:
        slow = {**OK, "max_tokens": 200}  # the sim takes a while over 200 tokens
        replies = await asyncio.gather(*(nc.request(subjects.INFER, json.dumps(slow).encode(), timeout=60)
                                         for _ in range(6)))
        codes = [(m.headers or {}).get(subjects.H_ERROR_CODE, "") for m in replies]
        assert codes.count("") >= 2 and "RATE_LIMITED" in codes, codes
        assert codes.count("") < 6
        # The leases are released: the identity is served again.
        assert (await _ask(nc))[0] == ""
    finally:
        await nc.close()


async def test_a_sequential_client_never_meets_its_own_concurrency_limit(secure_bus: SecureBus, stack: Stack) -> None:
    """One request at a time, each sent the moment the last reply arrived, at concurrency 1,
    across two routers: never RATE_LIMITED. The slot used to be given back after the reply had
    gone out (and to the shared entry in a background task), so the next request, on either
    router, could still find it held."""
    _issue(secure_bus, stack, "serial", "--plan", "custom", "--concurrent", "1")
    nc = await _connect(secure_bus, "serial")
    try:
        results = [await _ask(nc) for _ in range(60)]
        codes = [code for code, _, _ in results]
        assert codes == [""] * 60, codes
        assert {body["zml"]["router_id"] for _, _, body in results} == {"router-1", "router-2"}
        # An error reply frees the slot before it goes out too (here: a model nobody serves).
        bad = {**OK, "model": "no-such-model"}
        for _ in range(30):
            msg = await nc.request(subjects.INFER, json.dumps(bad).encode(), timeout=30)
            assert (msg.headers or {}).get(subjects.H_ERROR_CODE) not in (None, "RATE_LIMITED"), msg.headers
            assert (await _ask(nc))[0] == ""
    finally:
        await nc.close()


async def test_identity_shares_an_api_keys_plan_with_http(secure_bus: SecureBus, stack: Stack) -> None:
    admin = await nats.connect(secure_bus.url, **connect_options(NatsConfig(url=secure_bus.url),
                                                                 seed_file=secure_bus.seeds["admin"]))
    try:
        from zmlcore.access.apikeys import create_key
        from zmlcore.messages.keys import PlanLimits

        key, rec = await create_key(admin, plan="custom", limits=PlanLimits(requests_per_minute=6), label="billing")
    finally:
        await admin.close()
    _issue(secure_bus, stack, "partner", "--key", rec.id)
    nc = await _connect(secure_bus, "partner")
    try:
        async with httpx.AsyncClient(timeout=30) as c:
            async def http_ok() -> bool:  # the gateway knows the new key once its watch delivers it
                r = await c.post(stack.gateway_url + "/v1/chat/completions", json=OK,
                                 headers={"authorization": f"Bearer {key}"})
                return r.status_code == 200
            await _until(http_ok, 10.0)
            for _ in range(2):
                assert await http_ok()
        results = [await _ask(nc) for _ in range(5)]
        codes = [code for code, _, _ in results]
        assert codes == ["", "", "", "RATE_LIMITED", "RATE_LIMITED"], codes  # 3 over HTTP + 3 over NATS = 6
        assert results[0][2]["zml"]["label"] == "billing"  # the key's options come with its plan
        # Identity plans live beside the keys but are not keys: `zml keys list` and revoke skip them.
        admin = await nats.connect(secure_bus.url, **connect_options(NatsConfig(url=secure_bus.url),
                                                                     seed_file=secure_bus.seeds["admin"]))
        try:
            from zmlcore.access.apikeys import IDENTITY_PREFIX, list_keys, revoke_key

            assert [r.id for r in await list_keys(admin)] == [rec.id]
            assert not await revoke_key(admin, IDENTITY_PREFIX + "x")
            # Revoking the shared key refuses the identity too (its plan went with the key).
            assert await revoke_key(admin, rec.id)

            async def refused() -> bool:
                code, _, body = await _ask(nc)
                return code == "RATE_LIMITED" and "revoked" in body["error"]["message"]
            await _until(refused, 5.0)
        finally:
            await admin.close()
    finally:
        await nc.close()


async def test_http_and_nats_together_hold_the_plan_under_a_burst(secure_bus: SecureBus, stack: Stack) -> None:
    """One budget spent at once by a gateway and two routers (an identity sharing an API key's
    plan), each with leases of several requests: together they admit the plan's rate, not more."""
    from zmlcore.access.apikeys import create_key
    from zmlcore.access.shares import SHARE
    from zmlcore.access.limiter import limit_key
    from zmlcore.messages.keys import PlanLimits, limit_state_decoder

    rpm = 120
    admin = await nats.connect(secure_bus.url, **connect_options(NatsConfig(url=secure_bus.url),
                                                                 seed_file=secure_bus.seeds["admin"]))
    try:
        key, rec = await create_key(admin, plan="custom", limits=PlanLimits(requests_per_minute=rpm))
        _issue(secure_bus, stack, "burst", "--key", rec.id)
        nc = await _connect(secure_bus, "burst")
        sem = asyncio.Semaphore(12)
        try:
            async with httpx.AsyncClient(timeout=60) as c:
                async def http_ok() -> bool:  # the gateway knows the new key once its watch delivers it
                    r = await c.get(stack.gateway_url + "/v1/models", headers={"authorization": f"Bearer {key}"})
                    return r.status_code == 200
                await _until(http_ok, 10.0)

                async def over_http() -> str:
                    async with sem:
                        r = await c.post(stack.gateway_url + "/v1/chat/completions", json=OK,
                                         headers={"authorization": f"Bearer {key}"})
                        return "" if r.status_code == 200 else r.json()["error"]["code"]

                async def over_nats() -> str:
                    async with sem:
                        return (await _ask(nc))[0]
                codes = await asyncio.gather(*(over_http() if i % 2 else over_nats() for i in range(2 * rpm)))
        finally:
            await nc.close()
        served = codes.count("")
        assert set(codes) == {"", "RATE_LIMITED"}, codes
        # A window edge during the burst frees ~2/s; three replicas' unspent leases are at most
        # 1/SHARE of what was left each when one of them is refused.
        assert rpm - 3 * SHARE <= served <= rpm + rpm // 10, served
        assert codes[1::2].count("") > 0 and codes[0::2].count("") > 0  # both ways in were served
        router = await nats.connect(secure_bus.url, **connect_options(NatsConfig(url=secure_bus.url),
                                                                      seed_file=secure_bus.seeds["router"]))
        try:  # the limits bucket is the services' (admin may not read it)
            kv = await router.jetstream().key_value(subjects.LIMITS_BUCKET)

            async def settled() -> bool:  # unspent leases given back: the entry counts what was served
                s = limit_state_decoder.decode((await kv.get(limit_key(f"key:{rec.id}"))).value)
                return s.requests + s.prev_requests == served
            await _until(settled, 10.0)
        finally:
            await router.close()
    finally:
        await admin.close()
