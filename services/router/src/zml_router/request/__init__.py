"""One request's way through the router, as sans-I/O steps: no NATS, no HTTP, time passed in.

The service (``zml_router.service``) does the I/O; every rule of what happens to a request is
here, unit-tested without a broker or a node:

1. :func:`intake` reads an arriving request: the headers its sender may not set dropped
   (:func:`drop_untrusted`), its body and id, whose it is, its timeout, and what to do about the
   requests already in flight here: a second request with an id its owner
   has in flight is DUPLICATE_REQUEST_ID, unless its requester sent it again because this
   router looked dead (``Zml-Resend``: it takes the first one's place), and a request whose
   cancel overtook it is answered CANCELLED. :func:`cancel` is the other half: a cancel for a
   request in flight here, or one to remember (``zml_router.request.cancels``).
2. :func:`prepare` resolves the request's policy and what the policies see of it (``RouteRequest``).
3. :func:`route` decides, dispatches, fails over to another node or queues. Its model is httpx's
   ``auth_flow``: a generator that yields what should happen next and receives how it went:

   - :class:`Decide` -> the :class:`~zmlcore.policy.Decision` (``zmlcore.policy.admit``: choose_node
     under the admission bound), or the ZMLError it raised;
   - :class:`Dispatch` -> ``None`` once the node's answer went out to the requester, or the
     :class:`~zml_router.node.attempt.AttemptError` of a failed attempt; a node that fails part-way
     through the answer is followed by a *continuation* on another node where
     ``zml_router.answer.continuation.refusal`` allows it (``Decide``/``Dispatch`` with
     ``continuation``: only nodes whose engine can continue an answer, and the rest of it);
   - :class:`Penalise` -> ``None`` (the node was marked here and for the peers);
   - :class:`Enqueue` -> nothing: the request waits in the saturation queue, the flow is over;
   - :class:`Close` -> ``None``: the requester has every token of the answer and lost only its
     end (its node failed, or its router died, after the last one): the stream is ended here.

   It returns once the answer is out (``out.ok``) or the request queued (``out.queued``); an
   error the requester gets is raised as the ZMLError to reply with.

       flow = route(plan, out)
       action = next(flow)
       while True:                 # see RouterService._route
           result = do(action)     # decide / dispatch / penalise / enqueue
           action = flow.send(result)

4. :func:`completion` is the event of a finished request, :func:`penalty` how a failed attempt
   marks its node.

Which node serves is policy (``zmlcore.policy``: choose_node, the admission bound); what an
attempt on that node sends and gets is ``zml_router.node.attempt``.
"""
