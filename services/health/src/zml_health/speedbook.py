"""Every node's learned speeds, per model: the health service is the one learner (pure: time is
passed in). It folds the routers' per-attempt samples (``RequestCompleted.speed``), its own
counter windows (zml_health.speed) and its calibration requests into
:mod:`zmlcore.fleet.learn` filters, and says what each node's state publishes, so every router
replica routes on the same estimates (docs/routing.md "Learned speeds").

>>> b = SpeedBook()
>>> b.prior("n", "cpu")
>>> b.sample("n", "m", SpeedSample(ttft_s=0.05, prefill_tokens=700, engine_decode_tps=480), now=10.0)
True
>>> pub = b.publish("n", ["m"], now=10.0)
>>> pub.main.source, round(pub.main.decode_tps)
('measured', 477)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zmlcore.fleet import learn
from zmlcore.messages.speeds import LearnedSpeeds, ModelSpeeds, SpeedSample

#: Below this confidence a served model is calibrated (one short real request), at most once
#: per CALIBRATE_EVERY_S per (node, model).
CALIBRATE_BELOW = 0.5
#: A calibration is confirmed this many times after it, CONFIRM_AFTER_S apart. A measurement
#: taken while the node or its host was busy reads slow (contention only ever slows it: a real
#: llama-server timed itself at 3,713 prompt tok/s while a stack started beside it, 20,000-29,000
#: before and after), and a node believed slower than it is gets no traffic to correct it; so a
#: confirmation can only raise the estimate (a lower bound), never lower it: the routers' samples
#: lower a node that truly slowed, as it is believed fast enough to get traffic.
CONFIRMATIONS = 2
CONFIRM_AFTER_S = 10.0
#: A node's estimate that moved by more than this factor since it was last published (a speed,
#: or a full node's decode time) is published at once, not at the next poll up to
#: ``[health] poll_interval_s`` later: a conversation burst on a cold fleet is over in a few
#: seconds, and it was routed start to end on what the warm-up had shown (benches/real_fleet.py).
#: The 25% band of "confident" (zmlcore.fleet.learn.BAND).
REPUBLISH_MOVED = 1.25


@dataclass(frozen=True, slots=True)
class Published:
    #: The node's estimate (its busiest model's: routers score a node per request with one set
    #: of speeds), and each model's.
    main: ModelSpeeds
    models: dict[str, ModelSpeeds]


@dataclass(slots=True)
class SpeedBook:
    #: node -> model -> belief
    beliefs: dict[str, dict[str, LearnedSpeeds]] = field(default_factory=dict)
    #: node -> the prior of a model not seen yet
    priors: dict[str, LearnedSpeeds] = field(default_factory=dict)
    #: (node, model) -> unix time of the last calibration request sent
    calibrated_at: dict[tuple[str, str], float] = field(default_factory=dict)
    #: (node, model) -> confirmations still owed to its last full calibration
    unconfirmed: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (node, model) -> the estimate as last published (publish)
    shown: dict[tuple[str, str], ModelSpeeds] = field(default_factory=dict)

    def prior(self, node: str, accelerator: str, prefill_tps: float = 0.0, decode_tps: float = 0.0) -> None:
        """What is believed of ``node`` before anything is seen: its type's speeds, or the ones
        its config gives."""
        self.priors[node] = learn.prior_speeds(accelerator, prefill_tps=prefill_tps, decode_tps=decode_tps)

    def forget(self, node: str) -> None:
        """A node removed (or re-registered) starts again from its prior; so does one whose
        engine restarted, whose model may have changed."""
        self.beliefs.pop(node, None)
        self.priors.pop(node, None)
        for key in [k for k in self.shown if k[0] == node]:
            del self.shown[key]
        for key in [k for k in self.calibrated_at if k[0] == node]:
            del self.calibrated_at[key]
            self.unconfirmed.pop(key, None)

    def adopt(self, node: str, models: dict[str, ModelSpeeds]) -> None:
        """Start from what the previous health service published of ``node`` (its last state
        in the bucket) instead of the prior: a restart or a takeover changes no estimate."""
        prior = self.priors.get(node) or learn.prior_speeds("")
        per = self.beliefs.setdefault(node, {})
        for model, published in models.items():
            if published.source != "default":
                per[model] = learn.restored(published, prior)

    def reset(self, node: str) -> None:
        self.beliefs.pop(node, None)

    def _get(self, node: str, model: str) -> LearnedSpeeds:
        per = self.beliefs.setdefault(node, {})
        s = per.get(model)
        if s is None:
            s = per[model] = self.priors.get(node) or learn.prior_speeds("")
        return s

    def sample(self, node: str, model: str, sample: SpeedSample, now: float, maxc: int = 0) -> bool:
        """A router's observation of one attempt; True when it moved the node's estimate enough to
        publish it now (moved)."""
        if node not in self.priors:
            return False  # not a node of ours (removed, or another fleet's)
        self.beliefs[node][model] = learn.observe_sample(self._get(node, model), sample, now, maxc)
        return self.moved(node, model, now)

    def moved(self, node: str, model: str, now: float) -> bool:
        """Whether ``node``'s estimate for ``model`` is REPUBLISH_MOVED away from what was last
        published of it (a speed, or a full node's decode time, first learned included).

        >>> b = SpeedBook()
        >>> b.prior("n", "cpu")
        >>> b.calibration("n", "m", 1.0, prefill_tps=14_000, decode_tps=600, engine=True)
        True
        >>> b.moved("n", "m", 1.0), b.publish("n", ["m"], 1.0) is not None, b.moved("n", "m", 1.0)
        (True, True, False)
        >>> b.sample("n", "m", SpeedSample(ttft_s=0.4, prefill_tokens=100, inflight=6, decode_s=0.6,
        ...                                 decode_tokens=23), now=2.0, maxc=4)
        True
        """
        s = self.beliefs.get(node, {}).get(model)
        if s is None:
            return False
        was = self.shown.get((node, model))
        if was is None:
            return True
        prefill_tps, decode_tps, full_decode_s = learn.published_moving(s, now)  # (per completion event)
        return (_apart(prefill_tps, was.prefill_tps) or _apart(decode_tps, was.decode_tps)
                or _apart(full_decode_s, was.full_decode_s))

    def counters(self, node: str, models: list[str], now: float, *, prefill_tps: float | None,
                 prefill_c: float, decode_tps: float | None, decode_c: float) -> None:
        """A counter window (node-wide: it goes to each model the node serves).

        A lower bound of each speed, not a measurement: the engines count prefill and decode
        seconds per sequence (llama.cpp per slot, vLLM per request), so two prompts prefilled
        in one batch count its time twice, and a decode's seconds include the prefills that
        paused it. Such a window moves an estimate below it up (a node found faster than
        believed) and nothing else; the routers' samples, the engine's per-request timings of
        a prefill that ran alone and the calibration requests say the rest."""
        for m in models or [""]:
            s = self._get(node, m)
            if prefill_tps:
                s = learn.observe_prefill(s, tps=prefill_tps, inflight=max(prefill_c, 1.0), now=now,
                                          noise=learn.NOISE_ENGINE, measured=True, bound=True)
            if decode_tps:
                s = learn.observe_decode(s, tps=decode_tps, inflight=max(decode_c, 1.0), now=now,
                                         noise=learn.NOISE_ENGINE, measured=True, bound=True)
            self.beliefs[node][m] = s

    def calibration(self, node: str, model: str, now: float, *, prefill_tps: float, decode_tps: float,
                    engine: bool = False, confirm: bool = False) -> bool:
        """What a calibration request measured on an otherwise idle node (the engine's own
        timings when ``engine``); a confirmation (``confirm``) only raises the estimate. True
        when the estimate moved enough to publish it now (moved)."""
        noise = learn.NOISE_ENGINE if engine else learn.NOISE_CALIBRATION
        s = self._get(node, model)
        if confirm:
            prior = self.priors.get(node) or learn.prior_speeds("")
            s = learn.observe_confirmation(s, prior, prefill_tps=prefill_tps, decode_tps=decode_tps, now=now,
                                           noise=noise)
        else:
            if prefill_tps > 0:
                s = learn.observe_prefill(s, tps=prefill_tps, inflight=1, now=now, noise=noise, measured=True,
                                          clean=True)
            if decode_tps > 0:
                s = learn.observe_decode(s, tps=decode_tps, inflight=1, now=now, noise=noise, measured=True,
                                         clean=True)
        self.beliefs[node][model] = s
        return self.moved(node, model, now)

    def needs_calibration(self, node: str, models: list[str], now: float, every_s: float,
                          busy: bool = False) -> tuple[str, bool] | None:
        """The served model to calibrate now and whether it is a confirmation (None: none): one
        whose estimate is too uncertain to route on, not calibrated within ``every_s``; else one
        whose last calibration is owed a confirmation (CONFIRMATIONS, CONFIRM_AFTER_S apart),
        only while the node is idle (not ``busy``: nothing running or waiting on it). A node
        with work on it measures its load, not its speed, and is taught by the routers' samples
        of that work; a confirmation sent anyway competes with it: on the real fleet
        (benches/real_fleet.py) confirmations landed in a 10-20 s workload and added 600-5,000
        prompt tokens (2-18%) to what the engines computed, under ZML only.

        >>> b = SpeedBook()
        >>> b.prior("n", "cpu")
        >>> b.calibrating("n", "m", 0.0)
        >>> b.needs_calibration("n", ["m"], CONFIRM_AFTER_S, 60.0, busy=True) is None
        True
        >>> b.needs_calibration("n", ["m"], CONFIRM_AFTER_S, 60.0)
        ('m', True)
        """
        for m in models:
            if now - self.calibrated_at.get((node, m), -1e18) < every_s:
                continue
            if learn.published(self._get(node, m), now).confidence < CALIBRATE_BELOW:
                return m, False
        if busy:
            return None
        for m in models:
            if self.unconfirmed.get((node, m), 0) > 0 and now - self.calibrated_at[(node, m)] >= CONFIRM_AFTER_S:
                return m, True
        return None

    def calibrating(self, node: str, model: str, now: float, confirm: bool = False) -> None:
        key = (node, model)
        self.calibrated_at[key] = now
        self.unconfirmed[key] = self.unconfirmed.get(key, 0) - 1 if confirm else CONFIRMATIONS

    def publish(self, node: str, models: list[str], now: float) -> Published:
        per = self.beliefs.get(node, {})
        pub = {m: learn.published(per[m], now) for m in models if m in per}
        for m, p in pub.items():
            self.shown[(node, m)] = p
        if pub:
            main = max(pub.values(), key=lambda p: (p.samples, p.confidence))
        elif "" in per:
            main = learn.published(per[""], now)
        else:
            main = learn.published(self.priors.get(node) or learn.prior_speeds(""), now)
        return Published(main=main, models=pub)


def _apart(a: float, b: float) -> bool:
    """a and b more than REPUBLISH_MOVED apart (a first value where there was none included)."""
    if a <= 0 or b <= 0:
        return (a > 0) != (b > 0)
    return max(a / b, b / a) > REPUBLISH_MOVED
