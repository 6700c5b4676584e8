"""Priority bands: ``critical`` > ``standard`` > ``sheddable`` > ``batch``.

A request names its band (``x-zml-priority``, ``Zml-Priority``, the SDK's ``priority=``); an
API key (or the config) gives the band a request gets when it names none and the highest one
its requests may claim. A claim above that ceiling is lowered to it and the reply says so.
Bands are numbers, 0 the highest, so that "higher band first" is ``min``.

    >>> claim("critical", default=STANDARD, ceiling=STANDARD)
    Claim(band=1, lowered=True)
    >>> claim(None, default=SHEDDABLE, ceiling=CRITICAL)
    Claim(band=2, lowered=False)
"""

from __future__ import annotations

from typing import NamedTuple

from zmlcore.errors import BadRequestError

CRITICAL, STANDARD, SHEDDABLE, BATCH = 0, 1, 2, 3
NAMES = ("critical", "standard", "sheddable", "batch")
_BY_NAME = {n: i for i, n in enumerate(NAMES)}


def band_of(name: str) -> int:
    """The band called ``name`` (case-insensitive); BadRequestError naming the bands if unknown."""
    band = _BY_NAME.get(name.strip().lower())
    if band is None:
        raise BadRequestError(f"unknown priority {name!r}: one of {', '.join(NAMES)}", param="priority")
    return band


def name_of(band: int) -> str:
    return NAMES[band]


class Claim(NamedTuple):
    band: int
    #: The request asked for a higher band than its key allows and got the ceiling.
    lowered: bool


def claim(asked: str | None, *, default: int, ceiling: int) -> Claim:
    """The band of a request that asked for ``asked`` (None: nothing), given its key's default
    and ceiling. The default is itself bounded by the ceiling (a key's default above its own
    ceiling is a configuration the key's plan never granted)."""
    if not asked:
        return Claim(max(default, ceiling), False)
    band = band_of(asked)
    if band < ceiling:
        return Claim(ceiling, True)
    return Claim(band, False)
