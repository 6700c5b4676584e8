"""One request's way through the router, as sans-I/O steps: no NATS, no HTTP, time passed in.

The service (``zml_router.service``) does the I/O; every rule of what happens to a request is
here, unit-tested without a broker or a node, one module per step:

1. ``intake.intake`` reads an arriving request: the headers its sender may not set dropped
   (``intake.drop_untrusted``), its body and id, whose it is, its timeout, and what to do about
   the requests already in flight here: a second request with an id its owner has in flight is
   DUPLICATE_REQUEST_ID, unless its requester sent it again because this router looked dead
   (``Zml-Resend``: it takes the first one's place), and a request whose cancel overtook it is
   answered CANCELLED. ``intake.cancel`` is the other half: a cancel for a request in flight
   here, or one to remember (``zml_router.request.cancels``).
2. ``prepare.prepare`` resolves the request's policy and what the policies see of it
   (``RouteRequest``); ``split`` whether a decision splits it into prefill and decode legs.
3. ``route.route`` decides, dispatches, fails over to another node or queues. Its model is
   httpx's ``auth_flow``: a generator that yields what should happen next and receives how it
   went:

   - ``Decide`` -> the :class:`~zmlcore.policy.Decision` (``zmlcore.policy.admit``: choose_node
     under the admission bound), or the ZMLError it raised;
   - ``Prefill`` -> a split request's prefill leg: the ``Handoff`` for its decode leg, or the
     AttemptError (the request is then served whole on the decode node);
   - ``Dispatch`` -> the :class:`~zml_router.node.result.AttemptResult` of one attempt (its
     routing metadata, the node's token counts, or how it failed). A node that fails part-way
     through the answer: ``route.ending`` is the one rule for how that answer ends (the
     requester has it all: ended as the node would have; every token: ended here; else
     continued on another node where ``zml_router.answer.continuation.refusal`` allows it, or
     failed). A node that refuses a non-streamed request asked as a stream is asked again as
     the caller asked (``Dispatch.whole``), on the same attempt;
   - ``Penalise`` -> ``None`` (the node was marked here and for the peers);
   - ``Enqueue`` -> nothing: the request waits in the saturation queue, the flow is over;
   - ``Close`` -> the AttemptResult of ending the stream here (nothing is asked of a node).

   It returns once the answer is out (``out.ok``) or the request queued (``out.queued``); an
   error the requester gets is raised as the ZMLError to reply with. ``route`` writes the
   request's :class:`~zml_router.outcome.Outcome`; the I/O that executes an action only reports.

       flow = route(plan, out)
       action = next(flow)
       while True:                 # see RouterService._route
           result = do(action)     # decide / prefill / dispatch / penalise / close / enqueue
           action = flow.send(result)

4. ``finish.completion`` is the event of a finished request, ``finish.penalty`` how a failed
   attempt marks its node, ``finish.deadline_passed`` and ``finish.queue_expired`` the errors of
   a deadline.

Which node serves is policy (``zmlcore.policy``: choose_node, the admission bound); what an
attempt on that node sends and gets is ``zml_router.node.attempt``.
"""
