"""What a request asks of flow control: its band, its tenant and weight, its latency targets.
Pure: read from the request's NATS headers (the gateway turns ``x-zml-*`` HTTP headers and gRPC
metadata into them; the SDK and raw NATS clients set them), its API key's options and the config.

    ask = ask_of(headers, tenant="key-42", flow=cfg.flow, model=cfg.models.get(name))
    if ask.plain: ...nothing to do beyond today's routing...

Trust: ``Zml-Priority`` and the SLO headers only concern the sender's own request; the band
claimed is bounded by ``Zml-Priority-Max``, which only a front door sets from the API key (on
``zml.infer`` it is dropped: zml_router.request.intake.FRONT_DOOR_ONLY), else by [flow] max_priority.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from zmlcore import subjects
from zmlcore.config import FlowConfig, ModelConfig
from zmlcore.errors import BadRequestError
from zmlcore.flowctl.bands import STANDARD, band_of, claim, name_of
from zmlcore.flowctl.slo import Slo

#: Largest latency target accepted (ms): beyond it a target says nothing a timeout does not.
MAX_SLO_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class Ask:
    band: int
    #: The request claimed a higher band than allowed and got this one.
    lowered: bool
    tenant: str
    weight: float
    slo: Slo | None

    @property
    def plain(self) -> bool:
        """A standard-band request without targets: routed exactly as without flow control."""
        return self.band == STANDARD and self.slo is None

    @property
    def band_name(self) -> str:
        return name_of(self.band)


def _ms(value: str | None, name: str) -> float | None:
    if value is None or value == "":
        return None
    try:
        ms = float(value)
    except ValueError:
        raise BadRequestError(f"{name} must be a number of milliseconds, got {value!r}", param=name) from None
    if not 0 < ms <= MAX_SLO_MS:
        raise BadRequestError(f"{name} must be in (0, {MAX_SLO_MS:g}] ms, got {value!r}", param=name)
    return ms


def _weight(value: str | None) -> float:
    if not value:
        return 1.0
    try:
        w = float(value)
    except ValueError:
        return 1.0
    return w if 0 < w <= 1e6 else 1.0


def ask_of(headers: Mapping[str, str], *, tenant: str, flow: FlowConfig, model: ModelConfig | None) -> Ask:
    """The request's :class:`Ask` (BadRequestError for a malformed band or target)."""
    default = headers.get(subjects.H_PRIORITY_DEFAULT) or (model.priority if model and model.priority else None) \
        or flow.default_priority
    ceiling = headers.get(subjects.H_PRIORITY_MAX) or flow.max_priority
    band, lowered = claim(headers.get(subjects.H_PRIORITY), default=band_of(default), ceiling=band_of(ceiling))
    ttft = _ms(headers.get(subjects.H_TTFT_SLO_MS), "x-zml-ttft-slo-ms")
    tpot = _ms(headers.get(subjects.H_TPOT_SLO_MS), "x-zml-tpot-slo-ms")
    if ttft is None:
        ttft = model.ttft_slo_ms if model and model.ttft_slo_ms else flow.ttft_slo_ms
    if tpot is None:
        tpot = model.tpot_slo_ms if model and model.tpot_slo_ms else flow.tpot_slo_ms
    slo = None if ttft is None and tpot is None else Slo(None if ttft is None else ttft / 1000.0,
                                                           None if tpot is None else tpot / 1000.0)
    return Ask(band, lowered, tenant, _weight(headers.get(subjects.H_TENANT_WEIGHT)), slo)


#: Headers whose presence means a request may be other than plain (the router's fast path
#: checks these and the config once: see :func:`needs_ask`).
ASK_HEADERS = (subjects.H_PRIORITY, subjects.H_TTFT_SLO_MS, subjects.H_TPOT_SLO_MS, subjects.H_PRIORITY_DEFAULT)


def config_plain(flow: FlowConfig, models: Mapping[str, ModelConfig]) -> bool:
    """No default in the config makes any request other than plain (then only a request's own
    headers can)."""
    return (flow.default_priority == "standard" and flow.ttft_slo_ms is None and flow.tpot_slo_ms is None
            and all(m.priority in (None, "standard") and m.ttft_slo_ms is None and m.tpot_slo_ms is None
                    for m in models.values()))
