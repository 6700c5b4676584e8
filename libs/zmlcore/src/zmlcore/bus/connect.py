"""Connecting to NATS: one connect for every service and client, with refusals told apart."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from nats.aio.client import Client as NATS

from zmlcore import subjects
from zmlcore.bus.refusal import Attempt, classify, refusal_error, require_tls
from zmlcore.errors import ConnectionError as ZMLConnectionError
from zmlcore.errors import ZMLError
from zmlcore.bus.cancel import cancel_and_wait
from zmlcore.bus import natsinternals
from zmlcore.bus.link import Link, register, split_urls

log = logging.getLogger("zml.nats")


async def connect(urls: str | Sequence[str], name: str, *, connect_timeout: float = 2.0, replicas: int = 1,
                  give_up_s: float | None = None, attempt: Attempt | None = None,
                  on_error: Callable[[Exception], Awaitable[None]] | None = None, quiet: bool = False,
                  identity_hint: str = "", **kwargs: Any) -> NATS:
    """Connect to any of ``urls`` (a list, or one comma-separated string) and reconnect forever:
    a broker restart must not kill a service. The client's :class:`~zmlcore.bus.link.Link` tells
    JetStream users about reconnects and the service about a close for good.

    A refusal while connecting (identity not accepted, TLS certificate not trusted or missing,
    a server without TLS when TLS is configured: :mod:`zmlcore.bus.refusal`) raises AuthError /
    ConfigError at once with one line saying what to set; nats-py alone would retry it forever
    (and, for the last, go on in plaintext). On reconnects a server without TLS is skipped. An unreachable server is waited for
    (services may start before the broker), for at most ``give_up_s`` when given (commands,
    the SDK: then ConnectionError). ``kwargs`` go to nats-py's ``connect`` and override the
    defaults here (``max_reconnect_attempts``, ...). ``on_error``: also told of every error.
    ``quiet``: connection events are logged at debug level only (a library, the SDK).
    ``identity_hint``: what to set when the server wants an identity and none was given
    (when ``attempt`` is not given).

    nats-py's fast paths (zmlcore.bus.natsinternals) are decided here, once per process, before
    the first publish; a missing piece is logged there. (What ZML cannot do without is checked
    by service_main and by a KVFollower being built: the SDK connects here too, and needs none.)
    """
    natsinternals.support()
    servers = split_urls(urls)
    link = Link(replicas=replicas)
    loop = asyncio.get_running_loop()
    refused: asyncio.Future[ZMLError] = loop.create_future()
    connecting = True
    last: list[BaseException] = []
    tls = "tls" in kwargs or any(u.startswith("tls://") for u in servers)
    at = attempt or Attempt(url=",".join(servers), seed_file=kwargs.get("nkeys_seed"),
                            public_key=subjects.reply_owner(str(kwargs.get("inbox_prefix") or "") + ".x"),
                            tls=tls, identity_hint=identity_hint)

    warn = logging.DEBUG if quiet else logging.WARNING
    started = loop.time()

    async def _on_error(exc: Exception) -> None:
        if connecting:
            last[:] = [exc]
            kind = classify(exc)
            if kind is not None:  # raised with its explanation: not logged as well
                if not refused.done():
                    refused.set_result(refusal_error(kind, at, exc))
            else:
                # A command says it once, when it gives up. A service waiting for its broker logs
                # it, after a second: a server closing the socket after a refusal is often read
                # as a reset before the refusal itself, which then says everything.
                quiet_now = give_up_s is not None or loop.time() - started < 1.0
                log.log(logging.DEBUG if quiet_now else warn, "nats error: %s", exc)
        else:
            log.log(warn, "nats error: %s", exc)
        if on_error is not None:
            await on_error(exc)

    async def _on_disconnect() -> None:
        if not connecting and not nc.is_closed:  # not our own close()
            log.log(warn, "nats disconnected")

    async def _on_reconnect() -> None:
        log.info("nats reconnected to %s", nc.connected_url.netloc if nc.connected_url else "?")
        link.bump()

    async def _on_closed() -> None:
        if not link.closing and nc.last_error is not None:
            log.log(logging.DEBUG if quiet else logging.ERROR, "nats connection closed for good: %s", nc.last_error)
        link.mark_closed()

    options: dict[str, Any] = dict(
        servers=servers, name=name, connect_timeout=connect_timeout, max_reconnect_attempts=-1,
        reconnect_time_wait=0.25, allow_reconnect=True, error_cb=_on_error, disconnected_cb=_on_disconnect,
        reconnected_cb=_on_reconnect, closed_cb=_on_closed)
    options.update(kwargs)
    nc = NATS()
    natsinternals.forgive_abandoned_pongs(nc)
    natsinternals.fast_headers(nc)  # every message with headers: the router's requests, the replies
    if tls:  # never on in plaintext when TLS was asked for: refused before CONNECT
        natsinternals.before_connect(nc, require_tls)
    task = asyncio.ensure_future(nc.connect(**options))
    try:
        waiting: set[asyncio.Future[Any]] = {task, refused}
        done, _ = await asyncio.wait(waiting, timeout=give_up_s, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (Ctrl-C) while waiting: leave nothing running
        await _abandon(nc, task, link)
        raise
    failure: BaseException | None = None
    if task in done:  # connected (to some server, even if another refused) or gave up
        failure = task.exception()
        if failure is None:
            connecting = False
            register(nc, link)
            return nc
    await _abandon(nc, task, link)
    if refused.done():
        raise refused.result()
    cause = last[0] if last else failure
    kind = classify(cause) if cause is not None else None
    if kind is not None:
        raise refusal_error(kind, at, cause) from cause
    why = f" ({type(cause).__name__}: {cause})" if cause is not None and str(cause) else ""
    waited = f" within {give_up_s:g} s" if give_up_s is not None else ""
    hint = f": {at.unreachable_hint}" if at.unreachable_hint else ""
    raise ZMLConnectionError(f"cannot reach NATS at {at.url}{waited}{why}{hint}") from cause


async def _abandon(nc: NATS, task: asyncio.Future[Any], link: Link) -> None:
    """Stop a connect that is still trying (or failed) and close what it opened."""
    link.closing = True
    await cancel_and_wait({task}, timeout=2.0, every=0.05)  # one cancel can be swallowed (3.11)
    if task.done() and not task.cancelled():
        task.exception()  # retrieved: the failure is reported by the caller
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 2.0)
