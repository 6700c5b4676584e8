"""nats-py's optional aiohttp import is deferred (zmlcore._lazyimports): not run when nats loads,
run in full at its first use, whichever way it is imported."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import sys
import zmlcore, nats, nats.aio.transport as transport
assert "yarl" not in sys.modules and "aiohttp.client" not in sys.modules, "aiohttp ran at nats' import"
import zml_router.service, zml_gateway.service, zml_health.service
assert "aiohttp.client" not in sys.modules, "a service imports aiohttp"
from aiohttp import web
import aiohttp
assert type(aiohttp) is type(sys) and aiohttp is transport.aiohttp is sys.modules["aiohttp"]
assert web.Response is aiohttp.web.Response and aiohttp.ClientSession.__module__ == "aiohttp.client"
assert transport.aiohttp.WSMsgType.BINARY == 2
print("ok")
"""


def test_aiohttp_loads_at_first_use_not_at_nats_import() -> None:
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_a_submodule_import_runs_the_package_first() -> None:
    code = "import zmlcore, sys, aiohttp.web as w; assert sys.modules['aiohttp'].ClientSession; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
