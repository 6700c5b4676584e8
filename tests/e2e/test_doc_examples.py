"""Every example in README.md and docs/ marked runnable runs as written, against `zml up`.

A block is marked with the HTML comment ``<!-- zml:run -->`` on the line before its opening
fence (``<!-- zml:run background -->``: started, and the page's next blocks run once it has
printed its first line). The blocks of a page run in order, each as its own process; a page
without a `zml` command runs beside the others (``after``). All run against
one `zml up` started here on free ports, in the shell environment the docs assume: ``HOME`` a
fresh home whose default data folder is that `zml up`'s, ``zml`` on ``PATH``, ``ZML_ENDPOINT``
its gateway, and ``127.0.0.1:8080`` / ``127.0.0.1:4222`` in the block replaced by its ports.
docs/nats-api.md, "Runnable examples", says the same for writers.

JavaScript blocks get nats.js from npm (installed once into a cache; skipped, with the reason,
only when npm cannot reach its registry); Go blocks need Debian's Go and nats.go (``.ci/run``
installs them; skipped with the reason where they are missing).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import zml
from zmlcore.runtime.launch import Proc, free_port, spawn

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = re.compile(r"^<!--\s*zml:run(?P<opts>[^>]*?)\s*-->[ \t]*\n```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^```",
                  re.M | re.S)
ANY_MARK = re.compile(r"^<!--\s*zml:run", re.M)
LANGS = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell",
         "javascript": "js", "js": "js", "go": "go"}
NATS_JS = "nats@2.29"
#: Where Debian's golang-github-nats-io-* packages put their sources (GOPATH mode).
DEBIAN_GOPATH = "/usr/share/gocode"


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str
    body: str
    background: bool
    #: ``expect=TEXT``: its output must contain TEXT (a block whose point is what it prints).
    expect: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def collect(path: Path) -> list[Block]:
    text = path.read_text()
    rel = str(path.relative_to(ROOT))
    blocks = []
    for m in MARK.finditer(text):
        lang = LANGS.get(m.group("lang"))
        line = text[:m.start()].count("\n") + 2  # the fence's line
        assert lang is not None, f"{rel}:{line}: runnable block in unknown language {m.group('lang')!r}"
        opts = m.group("opts").split()
        expect = [o.partition("=")[2] for o in opts if o.startswith("expect=")]
        assert all(o == "background" or o.startswith("expect=") for o in opts), f"{rel}:{line}: unknown options {opts}"
        blocks.append(Block(rel, line, lang, m.group("body"), "background" in opts, expect[0] if expect else ""))
    # every marker belongs to a block: a typo must not silently drop an example
    assert len(ANY_MARK.findall(text)) == len(blocks), f"{rel}: a zml:run marker is not followed by a fence"
    return blocks


BLOCKS = [b for page in PAGES for b in collect(page)]


def test_examples_are_marked() -> None:
    """The pages that integrators read first have runnable examples in every language."""
    langs = {b.lang for b in BLOCKS}
    assert langs >= {"python", "shell", "js", "go"}, langs
    pages = {b.page for b in BLOCKS}
    assert {"README.md", "docs/nats-api.md", "docs/sdk.md", "docs/security.md"} <= pages, pages


@dataclass
class Up:
    home: Path
    gateway_port: int
    nats_port: int
    proc: Proc
    env: dict[str, str] = field(default_factory=dict)
    sim_ports: dict[str, str] = field(default_factory=dict)  # the demo's "127.0.0.1:91NN" -> this run's

    def text(self, body: str) -> str:
        body = (body.replace("127.0.0.1:8080", f"127.0.0.1:{self.gateway_port}")
                .replace("127.0.0.1:4222", f"127.0.0.1:{self.nats_port}"))
        return re.sub(r"127\.0\.0\.1:91\d\d", lambda m: self.sim_ports.get(m.group(0), m.group(0)), body)


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    home = tmp_path_factory.mktemp("doc-home")
    gw, np = free_port(), free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ZML_", "XDG_"))}
    env = {**base, "HOME": str(home), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "ZML_ENDPOINT": f"http://127.0.0.1:{gw}", "GOCACHE": str(home / ".cache" / "go-build")}
    # The shipped demo fleet, its simulated engines 10x faster than real time: the examples'
    # answers are the same, and the pages that send hundreds of requests (docs/sdk.md's
    # batches) take seconds, not minutes. Outside the home folder, so no example finds it as
    # its zml.toml.
    demo = (Path(zml.__file__).parent / "data" / "demo.toml").read_text()
    assert demo.count("[nodes.sim]\n") >= 7 and "time_scale" not in demo
    fast = tmp_path_factory.mktemp("doc-config") / "demo-fast.toml"
    # A config file's endpoints are bound as written: the demo's 9101-9107 would collide with any
    # other `zml up` or suite on the machine (seen in a full run on a shared box: "port 9101 ...
    # already in use", every example errored).
    sim_ports = {a: f"127.0.0.1:{free_port()}" for a in sorted(set(re.findall(r"127\.0\.0\.1:91\d\d", demo)))}
    demo = re.sub(r"127\.0\.0\.1:91\d\d", lambda m: sim_ports[m.group(0)], demo)
    fast.write_text(demo.replace("[nodes.sim]\n", "[nodes.sim]\ntime_scale = 10.0\n"))
    proc = spawn("zml-up", [sys.executable, "-m", "zml.cli", "up", "--gateway-port", str(gw), "--nats-port", str(np),
                            "--standby", "0", "--config", str(fast)], env=env, cwd=str(home))
    try:
        assert proc.wait_for("zml ready", 120), proc.tail()
        yield Up(home, gw, np, proc, env, sim_ports)
    finally:
        proc.stop()


def _npm_nats() -> tuple[Path | None, str]:
    """nats.js in a cache folder shared by runs: (its node_modules, "") or (None, why not)."""
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        return None, "node/npm not installed"
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zml" / "npm"
    modules = cache / "node_modules"
    if (modules / "nats" / "package.json").is_file():
        return modules, ""
    cache.mkdir(parents=True, exist_ok=True)
    out = subprocess.run([npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", NATS_JS],
                         capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        tail = (out.stderr or out.stdout).strip().splitlines()[-3:]
        return None, f"npm could not install {NATS_JS}: {' '.join(tail)}"
    return modules, ""


def _go() -> tuple[str | None, str]:
    go = shutil.which("go")
    if go is None:
        return None, "go is not installed (.ci/run installs Debian's golang-go and golang-github-nats-io-go-nats-dev)"
    if not (Path(DEBIAN_GOPATH) / "src" / "github.com" / "nats-io" / "nats.go").is_dir():
        return None, f"nats.go is not in {DEBIAN_GOPATH} (apt-get install golang-github-nats-io-go-nats-dev)"
    return go, ""


@dataclass
class Result:
    outcome: str  # "ok", "failed", "skipped"
    detail: str = ""


#: A shell block running a `zml` command: it may change what `zml up` holds for every page after
#: it (identities and the broker's config, API keys, which turn the gateway's key check on,
#: prices, placement, batches).
ZML_COMMAND = re.compile(r"(^|[;&|(]|\$\()\s*zml\s", re.M)


def after(blocks: list[Block]) -> dict[str, list[str]]:
    """Page -> the pages it starts after. A page with a `zml` command starts once every page
    before it has ended, so what it changes is met by the pages after it only, as in page order;
    a page of clients only starts at once (its blocks use nothing another page made). The pages
    mostly wait on the fleet: side by side they take ~25 s less a run than one after another."""
    pages = list(dict.fromkeys(b.page for b in blocks))
    admin = {b.page for b in blocks if b.lang == "shell" and ZML_COMMAND.search(b.body)}
    return {p: pages[:i] if p in admin else [] for i, p in enumerate(pages)}


class Runner:
    """Runs each page's blocks once, in order, and keeps each block's result; each page in a
    thread of its own, started (in the order of :func:`after`) when the first result is asked."""

    def __init__(self, up: Up, work: Path, blocks: list[Block]) -> None:
        self.up = up
        self.work = work
        self.blocks = blocks  # those whose tests run (their pages' blocks all run)
        self.results: dict[str, Result] = {}
        self._lock = threading.Lock()
        self._done: dict[str, threading.Event] = {}

    def result(self, block: Block) -> Result:
        with self._lock:
            if not self._done:
                order = after(self.blocks)
                self._done = {page: threading.Event() for page in order}
                for page, before in order.items():
                    threading.Thread(target=self._run_after, args=(page, before), name=f"doc-{page}",
                                     daemon=True).start()
        self._done[block.page].wait()
        return self.results.get(block.id) or Result("failed", "its page's run broke off: see the page's first block")

    def _run_after(self, page: str, before: list[str]) -> None:
        try:
            for earlier in before:
                self._done[earlier].wait()
            self._run_page(page)
        except BaseException as exc:  # said by the page's first block without a result, not lost in a thread
            first = next((b for b in BLOCKS if b.page == page and b.id not in self.results), None)
            if first is not None:
                self.results[first.id] = Result("failed", f"{type(exc).__name__}: {exc}")
        finally:
            self._done[page].set()

    def _argv(self, block: Block, folder: Path) -> tuple[list[str] | None, str, dict[str, str]]:
        text = self.up.text(block.body)
        env = dict(self.up.env)
        if block.lang == "python":
            (folder / "example.py").write_text(text)
            return [sys.executable, "example.py"], "", env
        if block.lang == "shell":
            return ["bash", "-e", "-o", "pipefail", "-c", text], "", env
        if block.lang == "js":
            modules, why = _npm_nats()
            if modules is None:
                return None, why, env
            link = folder / "node_modules"
            if not link.exists():
                link.symlink_to(modules)
            (folder / "example.mjs").write_text(text)
            return ["node", "example.mjs"], "", env
        go, why = _go()
        if go is None:
            return None, why, env
        gofolder = folder / "go-example"
        gofolder.mkdir(exist_ok=True)
        (gofolder / "main.go").write_text(text)
        env.update(GOPATH=DEBIAN_GOPATH, GO111MODULE="off", GOFLAGS="")
        return [go, "run", "main.go"], "", {**env, "ZML_GO_DIR": str(gofolder)}

    def _run_page(self, page: str) -> None:
        folder = self.work / page.replace("/", "_")
        folder.mkdir(parents=True, exist_ok=True)
        background: list[tuple[Block, subprocess.Popen[str]]] = []
        for block in [b for b in BLOCKS if b.page == page]:
            argv, why, env = self._argv(block, folder)
            if argv is None:
                self.results[block.id] = Result("skipped", why)
                continue
            cwd = env.pop("ZML_GO_DIR", str(folder))
            if block.background:
                proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True)
                first = proc.stdout.readline() if proc.stdout else ""  # it is ready for what follows
                if not first:
                    _, err = proc.communicate(timeout=30)
                    self.results[block.id] = Result("failed", f"exited before printing a line:\n{err[-3000:]}")
                    continue
                background.append((block, proc))
                continue
            t0 = time.monotonic()
            out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)
            self.results[block.id] = self._judge(block, out.returncode, out.stdout, out.stderr, time.monotonic() - t0)
        for block, proc in background:
            try:
                stdout, stderr = proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                self.results[block.id] = Result("failed", f"did not end within 90 s\n{stdout[-2000:]}{stderr[-2000:]}")
                continue
            self.results[block.id] = self._judge(block, proc.returncode, stdout, stderr, 0.0)

    @staticmethod
    def _judge(block: Block, rc: int, stdout: str, stderr: str, took: float) -> Result:
        if rc != 0 or "Traceback (most recent call last)" in stderr or block.expect not in stdout:
            why = f"exit {rc} after {took:.1f} s" + (f", output without {block.expect!r}" if block.expect else "")
            return Result("failed", f"{why}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n{stderr[-3000:]}")
        return Result("ok", stdout)


@pytest.fixture(scope="module")
def runner(up: Up, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Runner:
    selected = [item.callspec.params["block"] for item in request.session.items
                if getattr(item, "originalname", "") == "test_example_runs" and hasattr(item, "callspec")]
    return Runner(up, tmp_path_factory.mktemp("doc-work"), selected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_example_runs(runner: Runner, block: Block) -> None:
    result = runner.result(block)
    if result.outcome == "skipped":
        pytest.skip(f"{block.id} ({block.lang}): {result.detail}")
    assert result.outcome == "ok", f"{block.id} ({block.lang}) failed: {result.detail}"
