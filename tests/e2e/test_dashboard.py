"""GET /dashboard in a real headless Chromium (Debian's `chromium`, driven by Playwright): loads
with no console errors, shows every node of the fleet, reacts to a node going down and to load;
/dashboard/state wants a key when the gateway has keys."""

from __future__ import annotations

import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import FLEET, MODEL, Stack, launch_stack
from zmlcore.runtime.launch import Proc, free_port, service_argv, spawn, wait_port

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
KEY = "dash-admin-key"
#: Set ZML_SCREENSHOT_DIR=docs/img to refresh the picture in docs/observability.md.
SCREENSHOT_DIR = os.environ.get("ZML_SCREENSHOT_DIR")


def _browser_or_skip() -> None:
    if not os.path.exists(CHROMIUM) and not shutil.which("chromium"):
        print("SKIP reason: no chromium (apt-get install -y chromium; .ci/run does)")
        pytest.skip("no Chromium at /usr/bin/chromium (Debian package `chromium`; .ci/run installs it)")
    pytest.importorskip("playwright.sync_api", reason="playwright (the test extra) is not installed")


@pytest.fixture(scope="module")
def dash_stack(own_nats: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, str]]:
    """A fleet of its own (a node gets crashed) plus a second gateway with API keys on."""
    stack = launch_stack(own_nats, tmp_path_factory.mktemp("dash"), routers=1)
    port = free_port()
    gw: Proc = spawn("gateway-keys", service_argv("gateway", stack.config_path, own_nats, "--port", str(port)),
                     env={"ZML_API_KEYS": KEY})
    stack.procs["gateway-keys"] = gw
    try:
        assert wait_port("127.0.0.1", port, 30), gw.tail()
        yield stack, f"http://127.0.0.1:{port}"
    finally:
        stack.stop()


def _rows(page: Any) -> dict[str, str]:
    return dict(page.eval_on_selector_all(
        "#nodes tbody tr", "rows => rows.map(r => [r.dataset.node, r.dataset.status])"))


def _wait(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.25)
    raise AssertionError(f"dashboard: {what} not seen within {timeout:g} s (last: {last!r})")


def test_state_wants_an_operator_key_when_keys_are_on(dash_stack: tuple[Stack, str]) -> None:
    stack, keyed = dash_stack
    assert httpx.get(keyed + "/dashboard/state", timeout=10).status_code == 401
    assert httpx.get(keyed + "/dashboard/state", headers={"authorization": "Bearer wrong"}, timeout=10).status_code == 401
    r = httpx.get(keyed + "/dashboard/state", headers={"authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200
    assert {n["node_id"] for n in r.json()["nodes"]} == {n for n, _, _ in FLEET}
    page = httpx.get(keyed + "/dashboard", timeout=10)  # the static page carries no data
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "default-src 'self'" in page.headers["content-security-policy"]
    assert httpx.post(keyed + "/dashboard/state", timeout=10).status_code == 405
    # A customer's run-time key (zml keys create) works on the API, not on the fleet's state.
    import asyncio

    import nats

    from zmlcore.access.apikeys import create_key
    from zmlcore.access.plans import PlanLimits

    async def make() -> str:
        nc = await nats.connect(stack.nats_url)
        try:
            return (await create_key(nc, plan="custom", limits=PlanLimits(), label="team-a"))[0]
        finally:
            await nc.close()

    customer = asyncio.run(make())
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the gateway follows the keys bucket
        r = httpx.get(keyed + "/dashboard/state", headers={"authorization": f"Bearer {customer}"}, timeout=10)
        if r.status_code != 401:
            break
        time.sleep(0.2)
    assert r.status_code == 403, r.text
    assert httpx.get(keyed + "/dashboard/nope", timeout=10).status_code == 404


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dashboard_in_chromium_shows_the_fleet_and_reacts(dash_stack: tuple[Stack, str], tmp_path: Path) -> None:
    _browser_or_skip()
    from playwright.sync_api import sync_playwright

    stack, keyed = dash_stack
    errors: list[str] = []
    stop_load = threading.Event()

    def load() -> None:
        # Through the keyed gateway: once a run-time key exists (the test above makes one), every
        # gateway on the bus wants keys.
        with httpx.Client(base_url=keyed, timeout=30, headers={"authorization": f"Bearer {KEY}"}) as http:
            while not stop_load.is_set():
                http.post("/v1/chat/completions",
                          json={"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})

    workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{keyed}/dashboard#key={KEY}")
            # Every node of the fleet, up.
            rows = _wait("every node up", lambda: (r := _rows(page)) and len(r) == len(FLEET)
                         and all(s == "up" for s in r.values()) and r)
            assert set(rows) == {n for n, _, _ in FLEET}
            assert page.inner_text("#status") == "live"
            # Each node's speeds with where they come from (issue 27 item 2): the type's profile
            # until the engine's counters, a calibration request or the routers' observations
            # teach the estimate, then where it came from, how long ago it moved and how sure it is.
            speeds = page.eval_on_selector_all("#nodes td.speeds", "tds => tds.map(td => td.textContent)")
            assert len(speeds) == len(FLEET) and all(
                re.fullmatch(r"[\d.]+k? / [\d.]+k?(default|(measured|learned) \d+ [smh] ago)( \(\d+%\))?", t)
                for t in speeds), speeds
            assert "in flight: what the routers have sent it" in page.inner_text("#legend")
            # The saturation queue by the running config's model names, not hashed keys.
            queue = _wait("queue rows", lambda: page.eval_on_selector_all(
                "#queue td:first-child", "tds => tds.map(td => td.textContent)"))
            assert MODEL in queue and not any(re.search(r"-[0-9a-f]{8}$", q) for q in queue), queue
            assert "#key" not in page.url  # the key left the address bar
            # Load starts: decisions per second show up within a few seconds.
            t0 = time.monotonic()
            for w in workers:
                w.start()
            _wait("decisions/s > 0", lambda: float(page.inner_text("#rate") or 0) > 0, timeout=15)
            _wait("a node's decisions/s", lambda: page.eval_on_selector_all(
                "#nodes td.rate", "tds => tds.some(td => parseFloat(td.textContent) > 0)"), timeout=15)
            _wait("TTFT percentiles", lambda: page.inner_text("#ttft") != "–", timeout=15)
            # The sims report cached tokens (vLLM's usage details): routers know their caches that way.
            _wait("prefix cache column", lambda: page.eval_on_selector_all(
                "#nodes td.cache", "tds => tds.length > 0 && tds.every(td => td.textContent.startsWith('reported'))"),
                timeout=15)
            load_seen_s = time.monotonic() - t0
            time.sleep(2)
            shot = Path(SCREENSHOT_DIR or tmp_path) / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            # A node is killed: its row leaves "up" within a few seconds (health polls every 0.5 s).
            victim = "mi300x-2"
            stack.faults(victim, crash=True)
            t1 = time.monotonic()
            _wait(f"{victim} down", lambda: _rows(page).get(victim) not in (None, "up"), timeout=20)
            down_seen_s = time.monotonic() - t1
            # and why, in plain sight (issue 27 item 4): the health service's probe error
            why = _wait(f"{victim}'s reason", lambda: page.eval_on_selector_all(
                f"#nodes tr[data-node='{victim}'] .why", "els => els.map(e => e.textContent).join('')"), timeout=20)
            print(f"{victim}: {why}")
            assert "connect" in why.lower() or "refused" in why.lower() or "answered" in why, why
            print(f"dashboard saw the load after {load_seen_s:.1f} s and {victim} down after {down_seen_s:.1f} s")
        finally:
            stop_load.set()
            browser.close()
    for w in workers:
        w.join(timeout=30)
    assert not errors, errors
