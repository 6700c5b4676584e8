"""The router's book of cancels for requests it does not hold (pure)."""

from zml_router.request.cancels import CancelBook


def test_a_cancel_is_remembered_then_used_up() -> None:
    book = CancelBook(ttl_s=10)
    book.add("a", now=100.0)
    assert book.seen("a", 105.0) and book.take("a", 105.0)
    assert not book.seen("a", 105.0) and not book.take("a", 105.0)


def test_cancels_expire_and_are_bounded() -> None:
    book = CancelBook(ttl_s=10, max_entries=3)
    book.add("old", now=0.0)
    assert not book.seen("old", 11.0) and not book.take("old", 11.0)
    for i in range(5):
        book.add(str(i), now=20.0)
    assert len(book) == 3 and not book.seen("0", 20.0) and book.seen("4", 20.0)


def test_expired_cancels_are_dropped_so_a_steady_trickle_never_fills_the_book() -> None:
    # A cancel per second for an hour (the gateway cancels every abandoned request, and every
    # replica that does not hold it books it): the book holds one TTL's worth, not 3,600.
    book = CancelBook(ttl_s=60, max_entries=10_000)
    for i in range(3600):
        book.add(f"r{i}", now=float(i))
        assert len(book) <= 61
    assert book.seen("r3599", 3599.0) and not book.seen("r3000", 3599.0)
