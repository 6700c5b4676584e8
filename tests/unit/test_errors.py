from __future__ import annotations

import msgspec
import pytest

from zmlcore import errors


def test_every_seed_code_has_a_class() -> None:
    for code in ("NO_HEALTHY_NODES", "MODEL_NOT_LOADED", "QUEUE_FULL", "AUTH_FAILED", "TIMEOUT", "BAD_REQUEST", "INTERNAL"):
        assert errors.error_class(code).code == code


def test_codes_are_unique() -> None:
    classes = errors._all_subclasses(errors.ZMLError)
    assert len({c.code for c in classes}) == len(classes)


@pytest.mark.parametrize("cls", errors._all_subclasses(errors.ZMLError))
def test_wire_round_trip(cls: type[errors.ZMLError]) -> None:
    exc = cls("boom", routing_context={"policy": "p", "evaluated": []}, retry_after=2.0)
    raw = msgspec.json.encode(exc.to_body())
    back = errors.from_wire(msgspec.json.decode(raw, type=errors.ErrorBody).error)
    assert type(back) is cls and back.code == cls.code and back.message == "boom"
    assert back.routing_context == {"policy": "p", "evaluated": []} and back.retry_after == 2.0


def test_routing_context_is_in_str() -> None:
    exc = errors.QueueFullError("full", routing_context={"final_error": "no_viable_node"})
    assert "QUEUE_FULL" in str(exc) and "no_viable_node" in str(exc)
    assert isinstance(exc, errors.RoutingError) and exc.retryable


def test_unknown_code_is_kept() -> None:
    exc = errors.from_wire(errors.ErrorDetail(message="x", code="SOMETHING_NEW"))
    assert type(exc) is errors.ZMLError and exc.code == "SOMETHING_NEW"
