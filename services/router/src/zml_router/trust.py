"""Which request headers a sender may set.

A front door (the gateway) authenticates its callers and passes an API key's options to the
router as headers: ``Zml-Label`` (cost attribution, in routing metadata and completion events)
and ``Zml-Default-Policy``. Anyone may publish ``zml.infer``, so there these headers are
dropped: a raw NATS client's label and default policy come from its own record (an identity
sharing an API key's plan gets that key's, zml_router.limits) or are empty. Only the gateway
role may publish :data:`zmlcore.subjects.FRONT_DOOR_INFER` (zmlcore.access.permissions), and only there
are they honoured; so are ``Zml-Body: clean`` and the ZML fields the gateway moved out of a
validated body (``Zml-Policy``, ``Zml-Accelerator-Id``): on ``zml.infer`` the body is decoded and
checked in full, and a header cannot set what the body could not. On an open broker (no identities) anyone can publish there: docs/security.md.

The other request headers need no trust: ``Zml-Owner``, ``Zml-Request-Id`` and
``Zml-Id-Generated`` only narrow or affect the sender's own namespace (owner = the identity of
its reply inbox), and ``Zml-Timeout-Ms`` is bounded like the body's ``timeout_ms``. Router-only
headers (a queued request's claim on its id) are dropped from every sender.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from zmlcore import subjects

#: Honoured only from a front door.
FRONT_DOOR_ONLY = (subjects.H_LABEL, subjects.H_DEFAULT_POLICY,
                   # A body the gateway validated, its ZML fields in headers (zmlcore.messages.frontdoor):
                   # elsewhere they come from the body, checked in full.
                   subjects.H_BODY, subjects.H_POLICY, subjects.H_ACCELERATOR_ID)
#: Set only by routers, on queued requests (zml_router.ids).
ROUTER_ONLY = (subjects.H_ID_CLAIM,)


def front_door_headers(msg: Msg) -> None:
    """Drop from ``msg`` (in place) the headers its sender may not set."""
    headers = msg.headers
    if not headers:
        return
    drop = ROUTER_ONLY if msg.subject == subjects.FRONT_DOOR_INFER else ROUTER_ONLY + FRONT_DOOR_ONLY
    for name in drop:
        headers.pop(name, None)
