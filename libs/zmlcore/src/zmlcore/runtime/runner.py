"""Run a service until SIGTERM/SIGINT: connect, start, wait, stop, drain (uvicorn-style).

    asyncio.run(run_service(RouterService(cfg), cfg.nats.url, "zml-router"))
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from nats.aio.client import Client as NATS

from zmlcore.runtime import gcpace
from zmlcore.runtime.alive import beat
from zmlcore.config import ZMLConfig, load_config
from zmlcore.errors import AuthError, ConfigError
from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.runtime.lease import Lease
from zmlcore.access.identity import connect_options
from zmlcore.bus import natsinternals
from zmlcore.bus.link import link_of
from zmlcore.telemetry.metrics import MetricsServer, serve_metrics
from zmlcore.bus.cancel import cancel_and_wait as cancel_and_wait  # re-exported: the services import it here
from zmlcore.bus.connect import connect
from zmlcore.telemetry.otlp import setup_otlp_metrics
from zmlcore.telemetry.setup import setup_logging, setup_tracing
from zmlcore.bus.publish import flush

log = logging.getLogger("zml.runner")


class Service(Protocol):
    async def start(self, nc: NATS) -> None: ...

    async def stop(self) -> None: ...


def install_uvloop() -> None:
    """uvloop where available: it roughly halves the event loop's cost per message."""
    if sys.platform == "win32":
        return
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


class ConnectionClosed(Exception):
    """The NATS connection closed for good (nats-py does not reconnect after some server
    errors): the service exits non-zero so that its supervisor restarts it."""


class LeaseLost(Exception):
    """Another replica took over this one's role: it exits and is restarted as a standby."""


async def run_service(
    service: Service, nats_url: str, name: str, *, ready_line: str | None = None, no_echo: bool = False,
    replicas: int = 1, alive_file: str | None = None, lease_role: str | None = None, lease_ttl_s: float = 1.0,
    connect_options: dict[str, Any] | None = None,
) -> None:
    """``nats_url``: one URL or several, comma-separated. ``no_echo``: the broker does not send
    this connection its own messages back (routers publish in-flight counts they already applied).
    ``connect_options``: identity and TLS (zmlcore.access.identity.connect_options).

    Raises :class:`ConnectionClosed` if the connection closes for good before SIGTERM/SIGINT.
    ``alive_file``: touched while the service runs connected (:mod:`zmlcore.runtime.alive`).
    ``lease_role``: run as one of several replicas with one active (:mod:`zmlcore.runtime.lease`): wait as
    a standby until this replica holds the lease; raises :class:`LeaseLost` if it is taken over.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    on_signal = StopSignals(stop, name)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    role = name.removeprefix("zml-")
    nc = await connect(nats_url, name, no_echo=no_echo, replicas=replicas, identity_hint=(
        f"set ZML_NATS_NKEY (or [nats] nkey_file) to the {role} identity's seed file, creds/{role}.nk in the `zml up` "
        "data folder (`zml creds init --data-dir DIR` writes the service identities)"), **(connect_options or {}))
    link = link_of(nc)
    closed = asyncio.ensure_future(link.closed.wait())
    stopped = asyncio.ensure_future(stop.wait())
    beating = asyncio.ensure_future(beat(alive_file, lambda: nc.is_connected)) if alive_file else None
    lease = Lease(nc, lease_role, ttl_s=lease_ttl_s) if lease_role else None
    holding: asyncio.Future[None] | None = None
    collecting: asyncio.Future[None] | None = None
    try:
        if lease is not None:
            acquiring = asyncio.ensure_future(lease.acquire())
            await asyncio.wait({acquiring, closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not acquiring.done():  # stopped (or closed) while standing by
                acquiring.cancel()
                if link.closed.is_set() and not stop.is_set():
                    raise ConnectionClosed(str(nc.last_error))
                return
            holding = asyncio.ensure_future(lease.hold())
        await service.start(nc)
        # nats-py sends SUB without waiting for the broker: one PING/PONG makes "started" (and
        # `zml up`'s "ready") mean the subscriptions are at the broker, so a request sent on that
        # signal does not meet "no responders".
        # A connection closed meanwhile answers no PING: that wait ends with it, not 5 s later.
        confirming = asyncio.ensure_future(flush(nc, 5))
        await asyncio.wait({confirming, closed, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if not confirming.done():
            confirming.cancel()
        elif confirming.exception() is not None:  # broker gone: the reconnect re-sends the subscriptions
            log.warning("%s: subscriptions not confirmed by the broker at start", name)
        gcpace.settle()  # start-up objects frozen; collections paced by time (zmlcore.runtime.gcpace)
        collecting = asyncio.ensure_future(gcpace.collect_every())
        log.info("%s started (nats %s)", name, nats_url)
        if ready_line:
            print(ready_line, flush=True)
        ends: set[asyncio.Future[Any]] = {closed, stopped, *([holding] if holding else [])}
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        if link.closed.is_set() and not stop.is_set():
            log.error("%s: NATS connection closed for good (%s); exiting", name, nc.last_error)
            await _stop_quietly(service)
            raise ConnectionClosed(str(nc.last_error))
        if holding is not None and holding.done() and not stop.is_set():
            log.error("%s: lease lost; exiting to restart as a standby", name)
            await _stop_quietly(service)
            raise LeaseLost(name)
        log.info("%s stopping", name)
        await service.stop()
        if lease is not None:
            await lease.release()  # a standby takes over now, not after the lease's TTL
    finally:
        if holding is not None:
            holding.cancel()
        if collecting is not None:
            collecting.cancel()
        link.closing = True
        closed.cancel()
        stopped.cancel()
        if beating is not None:
            beating.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        # The service has already unsubscribed and finished its in-flight work in stop(), so
        # flushing what is buffered is enough; drain() would also wait on JetStream consumers'
        # subscriptions (KV watchers, pull fetches) for seconds.
        try:
            await flush(nc, 1)
        except Exception:  # broker gone: nothing can be flushed
            pass
        await nc.close()


#: Exit status of a service made to quit at once by a second Ctrl-C (128 + SIGINT, as a shell
#: reports a process ended by it).
FORCED_EXIT = 130


class StopSignals:
    """SIGTERM or a first SIGINT: stop gracefully (in-flight work finishes, bounded by each
    service's stop). A second SIGINT (Ctrl-C again, as uvicorn has it): exit now. Only SIGINTs
    count towards forcing, in whatever order the signals come: ``zml up`` sends SIGTERM right
    after the terminal's SIGINT reached the whole group, and that is still one Ctrl-C. What
    was in flight is resent or continued by its requester, as after a crash."""

    def __init__(self, stop: asyncio.Event, name: str) -> None:
        self.stop = stop
        self.name = name
        self.interrupts = 0

    def __call__(self, sig: int) -> None:
        if sig == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts > 1:
                log.warning("%s: interrupted again while stopping; exiting now", self.name)
                logging.shutdown()
                os._exit(FORCED_EXIT)
        self.stop.set()


async def _stop_quietly(service: Service) -> None:
    """Stop what can be stopped without a broker; bounded, as the supervisor is waiting."""
    try:
        await asyncio.wait_for(service.stop(), 5.0)
    except Exception:
        log.debug("stop after a closed connection failed", exc_info=True)


def service_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The arguments every service takes; services add their own."""
    p = argparse.ArgumentParser(prog=f"zml {name}", description=description)
    p.add_argument("--config", help="path to zml.toml")
    p.add_argument("--nats-url", help="NATS URL, or several comma-separated (servers of one cluster); "
                                      "overrides zml.toml and ZML_NATS_URL")
    p.add_argument("--log-format", choices=("text", "json"), default=None,
                   help="log lines as text (default) or one JSON object each (env ZML_LOG_FORMAT)")
    if name != "gateway":  # the gateway serves /metrics on its own port
        p.add_argument("--metrics-port", type=int, default=None,
                       help=f"serve Prometheus /metrics on this port (0: a free one; default [metrics] {name}_port)")
    p.add_argument("--alive-file", help="touch this file every 2 s while running and connected, for "
                                        "healthchecks: python -m zmlcore.runtime.alive FILE")
    return p


def service_main(
    name: str,
    args: argparse.Namespace,
    make: Callable[[ZMLConfig, argparse.Namespace], Service],
    *,
    no_echo: bool = False,
    lease_ttl: Callable[[ZMLConfig], float] | None = None,
) -> int:
    """Load and validate config, build the service, run it until SIGTERM/SIGINT.

    A bad config (or ``make`` raising ConfigError, e.g. a port in use, or a nats-py that lacks
    what ZML relies on: zmlcore.bus.natsinternals) is one line and exit 2;
    a connection closed for good (or JetStream not answering at start) exits 3; ``lease_ttl``
    given and ``--ha`` on the command line: one active replica at a time (lease TTL from the
    config), and a replica whose lease was taken over exits 4.
    """
    setup_logging(name, fmt=getattr(args, "log_format", None))
    try:
        natsinternals.check()
        cfg = load_config(args.config)
        options = connect_options(cfg.nats)
        service = make(cfg, args)
        metrics = start_metrics(name, cfg, getattr(args, "metrics_port", None))
    except ConfigError as exc:
        print(f"zml {name}: {exc}", file=sys.stderr)
        return 2
    setup_tracing(f"zml-{name}")
    otlp_metrics = setup_otlp_metrics(f"zml-{name}")  # None unless OTEL_* ask for it
    install_uvloop()
    if not getattr(args, "ha", False):
        lease_ttl = None
    try:
        asyncio.run(run_service(service, args.nats_url or cfg.nats.url, f"zml-{name}", no_echo=no_echo,
                                replicas=cfg.nats.replicas, alive_file=getattr(args, "alive_file", None),
                                lease_role=name if lease_ttl else None,
                                lease_ttl_s=lease_ttl(cfg) if lease_ttl else 1.0, connect_options=options))
    except (AuthError, ConfigError) as exc:  # the broker refused this identity or TLS: no retry cures it
        print(f"zml {name}: {exc.message}", file=sys.stderr, flush=True)
        return 2
    except ConnectionClosed as exc:
        print(f"zml {name}: NATS connection closed for good ({exc}); exiting so that a supervisor "
              "restarts it", file=sys.stderr, flush=True)
        return 3
    except ZMLConnectionError as exc:  # e.g. JetStream not answering at start (zmlcore.bus.ensure)
        print(f"zml {name}: {exc.message}; exiting so that a supervisor restarts it", file=sys.stderr, flush=True)
        return 3
    except LeaseLost:
        print(f"zml {name}: another replica took over; exiting to restart as a standby", file=sys.stderr, flush=True)
        return 4
    finally:
        if otlp_metrics is not None:
            otlp_metrics.close()  # the final flush
        if metrics is not None:
            metrics.close()
    return 0


def start_metrics(name: str, cfg: ZMLConfig, port: int | None) -> "MetricsServer | None":
    """The service's /metrics port: the flag, else ``[metrics] <name>_port``, else none."""
    if port is None:
        port = getattr(cfg.metrics, f"{name}_port", None)
    if port is None:
        return None
    try:
        return serve_metrics(cfg.metrics.host, port)
    except OSError as exc:
        raise ConfigError(f"metrics port {port} on {cfg.metrics.host}: {exc.strerror or exc}") from exc
