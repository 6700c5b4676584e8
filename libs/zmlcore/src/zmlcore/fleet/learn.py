"""Each node's speeds learned online, per model. Pure: no clocks, no I/O (time is an argument).

A node's prefill speed and per-sequence decode speed are each a function of what is in flight
on it, ``rate(c) = rate1 / (1 + k (c - 1))``, kept in log space as a 2-state Kalman filter over
``(a, g) = (log rate1, log k)`` with its covariance (:class:`~zmlcore.messages.speeds.SpeedFit`):

* **prior**: the accelerator type's (and engine's) speeds with a wide variance
  (``AcceleratorType.prior_sigma``: 0.7 for GPU types, 1.6 for "cpu"), so the first good
  observation moves the estimate almost all the way to it;
* **observations**: a router's per-attempt sample (TTFT over the prompt tokens the node had to
  compute, inter-token time over the tokens decoded, at the concurrency it ran), the engine's
  own per-request timings (llama.cpp ``timings``), a counter window measured by health, and
  health's calibration request. Each has its measurement noise (an estimated prompt length
  is noisier than an engine-reported one);
* **robust**: the innovation is clipped at ``HUBER`` standard deviations, so one request stuck
  behind a long prompt moves the estimate by a bounded step, not to a tenth;
* **decay**: the variance of ``a`` grows with the time since the last observation
  (``DRIFT_PER_S``), up to the prior's: a node left alone becomes uncertain again, and its
  next observations count for more (and the router explores it, zmlcore.policy.estimate);
* **mergeable**: two states of the same node (two health replicas, a restart from a saved
  state) merge by covariance intersection, consistent whatever they share.

>>> prior = prior_speeds("cpu")
>>> round(rate(prior.prefill)), round(rate(prior.decode))
(1500, 75)
>>> s = prior
>>> for _ in range(3):
...     s = observe_prefill(s, tps=14_000, inflight=1, now=1.0, noise=NOISE_REPORTED)
>>> abs(rate(s.prefill) / 14_000 - 1) < 0.25
True
"""

from __future__ import annotations

import math

import msgspec

from zmlcore.fleet.accelerators import ACCELERATORS, BASE_DECODE_TPS, BASE_PREFILL_TPS, DECODE_BATCH_PENALTY
from zmlcore.messages.speeds import LearnedSpeeds, ModelSpeeds, SpeedFit, SpeedSample

#: Measurement noise (standard deviation of log speed) by where an observation comes from.
NOISE_ENGINE = 0.1  #: the engine's own timings or counters
NOISE_CALIBRATION = 0.15  #: health's calibration request (one short request, idle node)
NOISE_REPORTED = 0.25  #: a router's sample whose uncached prompt tokens the engine reported
NOISE_ESTIMATED = 0.45  #: a router's sample with the prompt length estimated from the body
#: Innovations are clipped at this many standard deviations (Huber), tighter on the slow side:
#: what slows an observation down (a prefill queued ahead that the router did not count, a
#: decode paused by another request's prefill) is common and one-sided, while nothing makes a
#: node look faster than it is, so a slow sample moves the estimate less than a fast one.
HUBER = 2.5
HUBER_SLOW = 1.0
#: ... once this many observations have settled the estimate (before, a node slower than its
#: prior must be found as fast as a faster one).
SETTLED = 5
#: ... and then counts for this share of a fast one: the estimate tracks the fast envelope of
#: the samples (the node's speed when nothing holds it back), not their mean.
#: 0.6 chosen on the hidden-speed simulator's tuning seeds (agent, 80%: p90 TTFT 1.10x the
#: told-speeds run at 0.6, 1.16x at 0.3, 1.25x without; decode estimates were 20-45% low
#: from prefills pausing decodes).
SLOW_WEIGHT = 0.6
#: Variance of log speed added per second without an observation: (ln 1.25)^2 in 5 minutes, so
#: an estimate left alone 5 minutes is another 25% (one sigma) less sure.
DRIFT_PER_S = math.log(1.25) ** 2 / 300.0
#: Prior of the slowdown per extra sequence: log-sd of k (0.02 on a GPU may be 0.3 on a CPU).
SLOWDOWN_SIGMA = 1.5
#: Prefill is learned flat in concurrency (slowdown held at ~0): the routers' estimate charges
#: the prefill queued ahead at one speed, so the speed to learn is the one seen at the load the
#: node runs at; and a long TTFT at high concurrency is more often a prefill queued ahead that
#: the router did not count than a slower prefill (a slowdown learned from it raised the speed
#: alone 10-20% above the truth in the hidden-speed simulator).
PREFILL_SLOWDOWN = 1e-4
PREFILL_SLOWDOWN_SIGMA = 0.01
#: Bounds of the slowdown per extra sequence (keeps the filter away from 0 and runaway values).
G_MIN, G_MAX = math.log(1e-4), math.log(4.0)
#: "Confident" is a 25% band: confidence = P(true speed within 25% of the estimate).
BAND = math.log(1.25)
#: Step of the TTFT overhead's EWMA (LearnedSpeeds.overhead_s) per prefill timed alone.
OVERHEAD_STEP = 0.2
#: Fewer prompt tokens than this say more about fixed latencies than about prefill speed.
MIN_PREFILL_TOKENS = 32
#: An engine's timing of a prefill shorter than this, even alone, is a lower bound of the
#: speed, not a measurement: a short prefill after a long cached prefix pays that context's
#: per-token cost (attention over it: a 64-wide llama-server's prompt cost 15-20 us a token up
#: to 600 tokens, 50 at 1,179 and 80 at 1,761, benches/prefill_by_length.py), and a shared
#: CPU's time slice weighs on a short one. A llama-server timed its ~80-token follow-ups
#: at 2,300-4,000 tokens/s and its 1,270-token prompts at 15,800 in the same minute; folded as
#: measurements the follow-ups, which ran alone far more often, put its estimate at a third of
#: the slower node's and ZML sent the long prompts there (benches/real_fleet.py, box load 6).
CLEAN_PREFILL_TOKENS = 512
#: Step of the EWMA of a full node's decode time per request (LearnedSpeeds.full_decode_s).
FULL_DECODE_STEP = 0.2
MIN_DECODE_TOKENS = 8


def prior_fit(tps: float, slowdown: float, sigma: float, slowdown_sigma: float = SLOWDOWN_SIGMA) -> SpeedFit:
    return SpeedFit(a=math.log(tps), g=math.log(slowdown), paa=sigma * sigma, pag=0.0,
                    pgg=slowdown_sigma ** 2)


def prior_speeds(accelerator: str, *, prefill_tps: float = 0.0, decode_tps: float = 0.0,
                 sigma: float | None = None) -> LearnedSpeeds:
    """What is believed of a node before any observation: its type's speeds (or the ones
    given, e.g. zml.toml's), with the type's prior width.

    >>> round(rate(prior_speeds("nvidia_h100").decode))
    60
    """
    a = ACCELERATORS.get(accelerator)
    pf = prefill_tps or (a.default_prefill_tps if a else BASE_PREFILL_TPS)
    dec = decode_tps or (a.default_decode_tps if a else BASE_DECODE_TPS)
    k = a.default_batch_penalty if a else DECODE_BATCH_PENALTY
    s = sigma if sigma is not None else (a.prior_sigma if a else 1.6)
    return LearnedSpeeds(prefill=prior_fit(pf, PREFILL_SLOWDOWN, s, PREFILL_SLOWDOWN_SIGMA),
                         decode=prior_fit(dec, k, s),
                         prior_var=s * s)


def rate(fit: SpeedFit, concurrency: float = 1.0) -> float:
    """Tokens/s at ``concurrency`` sequences in flight (1: alone)."""
    return math.exp(fit.a) / (1.0 + math.exp(fit.g) * max(concurrency - 1.0, 0.0))


def slowdown(fit: SpeedFit) -> float:
    return math.exp(fit.g)


def sigma(fit: SpeedFit) -> float:
    """Standard deviation of log(rate alone)."""
    return math.sqrt(fit.paa)


def aged(fit: SpeedFit, now: float, cap: float) -> SpeedFit:
    """The fit as believed at ``now``: its variance grown by the time since its last
    observation, at most ``cap`` (the prior's variance)."""
    if fit.at <= 0 or now <= fit.at or fit.paa >= cap:
        return fit
    paa = min(cap, fit.paa + DRIFT_PER_S * (now - fit.at))
    return SpeedFit(a=fit.a, g=fit.g, paa=paa, pag=fit.pag, pgg=fit.pgg, at=fit.at, n=fit.n)


def update(fit: SpeedFit, tps: float, concurrency: float, now: float, noise: float, cap: float,
           bound: bool = False, clean: bool = False) -> SpeedFit:
    """Fold one observation of the speed at ``concurrency`` (an extended Kalman step). With
    ``bound`` the observation is a lower bound (the node is at least this fast: a per-request
    speed whose time other requests' work shared): it moves an estimate below it up, and says
    nothing of one above it. A ``clean`` observation (the engine's own timing of work that ran
    alone) is clipped the same way both sides: it is slow only when the node is.

    >>> f = prior_fit(100.0, 0.02, 1.0)
    >>> f = update(f, 400.0, 1, now=5.0, noise=0.1, cap=1.0)
    >>> 350 < rate(f) < 400
    True
    >>> update(f, 100.0, 1, now=6.0, noise=0.1, cap=1.0, bound=True) is f
    True
    """
    if not (tps > 0 and math.isfinite(tps)):
        return fit
    x = math.exp(fit.g) * max(concurrency - 1.0, 0.0)
    h = fit.a - math.log1p(x)
    v = math.log(tps) - h
    if bound and v <= 0:
        return fit
    fit = aged(fit, now, cap)
    hg = -x / (1.0 + x)  # d h / d g; d h / d a = 1
    paa, pag, pgg = fit.paa, fit.pag, fit.pgg
    pa = paa + pag * hg  # P H^T
    pg = pag + pgg * hg
    s = pa + hg * pg + noise * noise
    sd = math.sqrt(s)
    settled = fit.n >= SETTLED and not clean
    v = max(-(HUBER_SLOW if settled else HUBER) * sd, min(HUBER * sd, v))
    if v < 0 and settled:
        v *= SLOW_WEIGHT
    ka, kg = pa / s, pg / s
    a = fit.a + ka * v
    g = min(G_MAX, max(G_MIN, fit.g + kg * v))
    # P - K (H P), symmetric
    paa2 = max(paa - ka * pa, 1e-6)
    pag2 = pag - ka * pg
    pgg2 = max(pgg - kg * pg, 1e-6)
    return SpeedFit(a=a, g=g, paa=paa2, pag=pag2, pgg=pgg2, at=max(now, fit.at), n=fit.n + 1)


def observe_prefill(s: LearnedSpeeds, *, tps: float, inflight: float, now: float, noise: float,
                    measured: bool = False, cap: float | None = None, bound: bool = False,
                   clean: bool = False) -> LearnedSpeeds:
    cap = cap if cap is not None else _cap(s)
    fit = update(s.prefill, tps, inflight, now, noise, cap, bound, clean)
    if fit is s.prefill:
        return s
    return msgspec.structs.replace(s, prefill=fit, measured_at=now if measured else s.measured_at)


def observe_decode(s: LearnedSpeeds, *, tps: float, inflight: float, now: float, noise: float,
                   measured: bool = False, cap: float | None = None, bound: bool = False,
                   clean: bool = False) -> LearnedSpeeds:
    cap = cap if cap is not None else _cap(s)
    fit = update(s.decode, tps, inflight, now, noise, cap, bound, clean)
    if fit is s.decode:
        return s
    return msgspec.structs.replace(s, decode=fit, measured_at=now if measured else s.measured_at)


def observe_confirmation(s: LearnedSpeeds, prior: LearnedSpeeds, *, prefill_tps: float, decode_tps: float,
                         now: float, noise: float) -> LearnedSpeeds:
    """Fold a calibration that confirms an earlier one (zml_health.speedbook.CONFIRMATIONS).

    Contention only slows a measurement, so a confirmation slower than the estimate says
    nothing; one faster says the measurement the estimate stands on was slowed, and that speed
    starts again from ``prior`` and the confirmation, as a first calibration would have made it
    (a Kalman step from the slow estimate, clipped at a few sigma, would move a 6x error ~25%).

    >>> p = prior_speeds("cpu")
    >>> slow = observe_prefill(p, tps=3_700.0, inflight=1, now=1.0, noise=NOISE_ENGINE, measured=True, clean=True)
    >>> s = observe_confirmation(slow, p, prefill_tps=24_000.0, decode_tps=0.0, now=11.0, noise=NOISE_ENGINE)
    >>> 20_000 < rate(s.prefill) < 25_000, s.decode is slow.decode
    (True, True)
    >>> observe_confirmation(s, p, prefill_tps=3_000.0, decode_tps=0.0, now=21.0, noise=NOISE_ENGINE) is s
    True
    """
    if prefill_tps > rate(s.prefill):
        fresh = observe_prefill(prior, tps=prefill_tps, inflight=1, now=now, noise=noise, measured=True, clean=True)
        s = msgspec.structs.replace(s, prefill=fresh.prefill, measured_at=now)
    if decode_tps > rate(s.decode):
        fresh = observe_decode(prior, tps=decode_tps, inflight=1, now=now, noise=noise, measured=True, clean=True)
        s = msgspec.structs.replace(s, decode=fresh.decode, measured_at=now)
    return s


def observe_sample(s: LearnedSpeeds, sample: SpeedSample, now: float, maxc: int = 0) -> LearnedSpeeds:
    """Fold what a router saw of one attempt.

    **Prefill** is the node's prompt throughput. The engine's own prompt speed counts fully only
    when the request's prefill ran alone (``sample.alone``): llama.cpp and vLLM put the prompts
    of several sequences in one batch, so a request that shared its batches reports its own
    tokens over the whole batch's time, a fraction of the throughput (half, with two prompts of
    a size). Shared, it is a lower bound. (Counting the TTFT's throughput beside it, to follow a
    node slowed by its neighbours, let a busy fast llama-server's estimate fall to half the
    engine's speed, and ZML moved its work to the slow one: benches/real_fleet.py.) Without the
    engine's figure it is the prompt tokens the node computed before the first token (those
    pending ahead, counted, and its own) over the TTFT less the node's fixed overhead
    (``overhead_s``), counted only when the request got a sequence slot at once (``inflight <= maxc``:
    a wait for a slot is queueing, not prefill); a lower bound too when other prompts arrived
    during it (``joined_tokens``).

    **Decode** is the per-sequence speed at the concurrency it ran. Its time (the engine's, else
    the router's first-to-last token) less the prefills of the prompts sent to the node during
    it (``decode_prefill_tokens`` at the prefill estimate: they pause the decode) is decode; when
    those prefills took more than half of it, what is left is too small to time, and the speed
    over the whole is a lower bound.

    >>> s = prior_speeds("cpu")
    >>> s = observe_sample(s, SpeedSample(ttft_s=0.1, prefill_tokens=1000, alone=True, engine_prefill_tps=10_000,
    ...                                   engine_decode_tps=500, decode_tokens=31), now=1.0)
    >>> round(rate(s.prefill), -2), round(rate(s.decode), -1)
    (9900.0, 500.0)
    >>> # its prompt in one batch with 1,000 tokens pending ahead (the engine: half the speed),
    >>> # its decode paused by 1,000 prompt tokens sent meanwhile (0.1 s of 0.16 s):
    >>> t = observe_sample(s, SpeedSample(ttft_s=0.2, prefill_tokens=2000, engine_prefill_tps=5_000,
    ...                                   engine_decode_tps=200, decode_tokens=31, decode_prefill_tokens=1000), now=2.0)
    >>> t.prefill is s.prefill, t.decode is s.decode
    (True, True)
    >>> # its TTFT mostly an adapter's load (vLLM's resolver): its decode is learnt, no prefill
    >>> u = observe_sample(s, SpeedSample(ttft_s=1.1, prefill_tokens=1000, alone=True, decode_s=0.1,
    ...                                   decode_tokens=50, adapter_load_s=1.0), now=3.0)
    >>> u.prefill is s.prefill, u.decode is s.decode
    (True, False)
    """
    cap = _cap(s)
    c = max(sample.inflight, 1)
    alone = sample.alone
    if sample.adapter_load_s is not None:  # its TTFT includes an adapter's load: no prefill speed
        sample = msgspec.structs.replace(sample, ttft_s=0.0, engine_prefill_tps=0.0)
    if alone and sample.engine_prefill_tps > 0 and sample.ttft_s > 0 and sample.prefill_tokens > 0:
        # what of the TTFT was not the prefill the engine timed: an EWMA
        o = max(0.0, sample.ttft_s - sample.prefill_tokens / sample.engine_prefill_tps)
        s = msgspec.structs.replace(s, overhead_s=o if s.overhead_s <= 0 else
                                    s.overhead_s + OVERHEAD_STEP * (o - s.overhead_s))
    ttft = sample.ttft_s - s.overhead_s
    if sample.engine_prefill_tps > 0:
        clean = alone and sample.prefill_tokens >= CLEAN_PREFILL_TOKENS
        s = observe_prefill(s, tps=sample.engine_prefill_tps, inflight=c, now=now, noise=NOISE_ENGINE,
                            measured=alone, cap=cap, bound=not clean, clean=clean)
    elif ttft > 0 and sample.prefill_tokens >= MIN_PREFILL_TOKENS and (maxc <= 0 or c <= maxc):
        noise = NOISE_REPORTED if sample.prefill_reported else NOISE_ESTIMATED
        s = observe_prefill(s, tps=sample.prefill_tokens / ttft, inflight=c, now=now, noise=noise, cap=cap,
                            bound=sample.joined_tokens > 0)
    if 0 < maxc <= sample.inflight and sample.decode_s > 0 and sample.decode_tokens > 0:
        # it ran on a full node: how long such a node holds a slot past the first token
        f = s.full_decode_s
        s = msgspec.structs.replace(s, full_decode_s=sample.decode_s if f <= 0 else
                                    f + FULL_DECODE_STEP * (sample.decode_s - f))
    n = sample.decode_tokens
    if n <= 0 and sample.engine_decode_tps > 0:  # the engine's figure, its token count not known
        s = observe_decode(s, tps=sample.engine_decode_tps, inflight=c, now=now, noise=NOISE_ENGINE,
                           measured=True, cap=cap, bound=sample.decode_prefill_tokens > 0)
    elif n >= MIN_DECODE_TOKENS or (sample.engine_decode_tps > 0 and n > 0):
        engine = sample.engine_decode_tps > 0
        t = n / sample.engine_decode_tps if engine else sample.decode_s
        if t > 0:
            paused = sample.decode_prefill_tokens / rate(s.prefill) if sample.decode_prefill_tokens > 0 else 0.0
            own = t - paused
            noise = NOISE_ENGINE if engine else NOISE_REPORTED
            if own >= 0.5 * t:
                s = observe_decode(s, tps=n / own, inflight=c, now=now, noise=noise, measured=engine, cap=cap)
            else:
                s = observe_decode(s, tps=n / t, inflight=c, now=now, noise=noise, cap=cap, bound=True)
    return s


def merge(x: LearnedSpeeds, y: LearnedSpeeds) -> LearnedSpeeds:
    """Two beliefs about the same node merged by covariance intersection (weight 1/2): never
    more confident than the evidence allows, whatever observations they share.

    >>> p = prior_speeds("nvidia_h100")
    >>> m = merge(p, p)
    >>> round(rate(m.prefill)) == round(rate(p.prefill)) and abs(m.prefill.paa - p.prefill.paa) < 1e-9
    True
    """
    return LearnedSpeeds(prefill=_ci(x.prefill, y.prefill), decode=_ci(x.decode, y.decode),
                         measured_at=max(x.measured_at, y.measured_at), prior_var=max(x.prior_var, y.prior_var),
                         overhead_s=_mean(x.overhead_s, y.overhead_s),
                         full_decode_s=_mean(x.full_decode_s, y.full_decode_s))


def _mean(x: float, y: float) -> float:
    """Of two EWMAs, either of which may have none yet (0)."""
    return 0.5 * (x + y) if x and y else x or y


def _ci(x: SpeedFit, y: SpeedFit) -> SpeedFit:
    ix = _inv(x.paa, x.pag, x.pgg)
    iy = _inv(y.paa, y.pag, y.pgg)
    i = tuple(0.5 * (p + q) for p, q in zip(ix, iy))
    paa, pag, pgg = _inv(*i)
    # mean = P (0.5 Ix x + 0.5 Iy y)
    va = 0.5 * (ix[0] * x.a + ix[1] * x.g) + 0.5 * (iy[0] * y.a + iy[1] * y.g)
    vg = 0.5 * (ix[1] * x.a + ix[2] * x.g) + 0.5 * (iy[1] * y.a + iy[2] * y.g)
    return SpeedFit(a=paa * va + pag * vg, g=pag * va + pgg * vg, paa=paa, pag=pag, pgg=pgg,
                    at=max(x.at, y.at), n=max(x.n, y.n))


def _inv(a: float, b: float, c: float) -> tuple[float, float, float]:
    det = a * c - b * b
    return c / det, -b / det, a / det


def _cap(s: LearnedSpeeds) -> float:
    return s.prior_var


def confidence(sig: float) -> float:
    """P(|error of log speed| < ln 1.25) for a log-normal belief of this width.

    >>> round(confidence(0.1), 2), round(confidence(1.6), 2)
    (0.97, 0.11)
    """
    return math.erf(BAND / (max(sig, 1e-9) * math.sqrt(2.0)))


def restored(p: ModelSpeeds, prior: LearnedSpeeds) -> LearnedSpeeds:
    """A published belief (``NodeState.model_speeds``) as a belief again: what a health service
    that takes over (a restart, a standby becoming active) starts from instead of the type's
    prior, so the fleet's estimates survive it and no node is calibrated again for it. The
    slowdown's width and the correlation are not published: the prior's width, no correlation.
    Aging from ``p.at`` goes on as if the service had never stopped.

    >>> p = prior_speeds("cpu")
    >>> s = observe_decode(p, tps=400.0, inflight=1, now=10.0, noise=NOISE_ENGINE, measured=True)
    >>> r = restored(published(s, 10.0), p)
    >>> round(rate(r.decode)) == round(rate(s.decode)) and abs(sigma(r.decode) - sigma(s.decode)) < 1e-3
    True
    """
    def fit(tps: float, slow: float, sig: float, g_var: float, n: int) -> SpeedFit:
        return SpeedFit(a=math.log(tps), g=min(G_MAX, max(G_MIN, math.log(max(slow, 1e-12)))),
                        paa=max(sig * sig, 1e-6), pag=0.0, pgg=g_var, at=p.at, n=n)

    if p.source == "default" or p.prefill_tps <= 0 or p.decode_tps <= 0:
        return prior
    half = p.samples // 2
    return LearnedSpeeds(
        prefill=fit(p.prefill_tps, p.prefill_slowdown, p.prefill_sigma, prior.prefill.pgg, p.samples - half),
        decode=fit(p.decode_tps, p.decode_slowdown, p.decode_sigma, prior.decode.pgg, half),
        measured_at=p.at if p.source == "measured" else 0.0, prior_var=prior.prior_var,
        overhead_s=p.ttft_overhead_s, full_decode_s=p.full_decode_s)


def published_moving(s: LearnedSpeeds, now: float) -> tuple[float, float, float]:
    """:func:`published`'s ``prefill_tps``, ``decode_tps`` and ``full_decode_s``, the values
    whose moves make a new estimate worth publishing, without building the rest (the health
    service asks after every completion event)."""
    cap = _cap(s)
    return (round(rate(aged(s.prefill, now, cap)), 3), round(rate(aged(s.decode, now, cap)), 3),
            round(s.full_decode_s, 4))


def published(s: LearnedSpeeds, now: float, stale_s: float = 600.0) -> ModelSpeeds:
    """The form in ``NodeState.model_speeds``: the belief aged to ``now``.

    Source: "measured" when the engine's own figures (counters, timings, calibration) moved it
    within ``stale_s``; "learned" when observations did; "default" with none.
    """
    cap = _cap(s)
    pf, dec = aged(s.prefill, now, cap), aged(s.decode, now, cap)
    at = max(pf.at, dec.at)
    if s.measured_at and now - s.measured_at <= stale_s:
        source = "measured"
    elif pf.n or dec.n:
        source = "learned"
    else:
        source = "default"
    return ModelSpeeds(
        prefill_tps=round(rate(pf), 3), decode_tps=round(rate(dec), 3),
        prefill_slowdown=round(slowdown(pf), 4), decode_slowdown=round(slowdown(dec), 4),
        prefill_sigma=round(sigma(pf), 4), decode_sigma=round(sigma(dec), 4),
        source=source, at=at, confidence=round(min(confidence(sigma(pf)), confidence(sigma(dec))), 3),
        samples=pf.n + dec.n, ttft_overhead_s=round(s.overhead_s, 4), full_decode_s=round(s.full_decode_s, 4),
    )
