"""The reorder buffer (``_reorder``): release by task id, duplicates dropped, early releases
recorded when ``in_order=False``."""

from __future__ import annotations

from resumable_loader.pipeline.reorder import ReorderBuffer


def test_reorder_in_order_releases_strictly_by_id_and_drops_duplicates() -> None:
    rb = ReorderBuffer(in_order=True)
    assert rb.put(2, "c") and rb.put(0, "a")
    assert rb.ready() and rb.pop() == (0, "a")
    assert not rb.ready(), "id 1 is missing: nothing may be released"
    assert not rb.put(0, "a again"), "an id already released is a duplicate"
    assert not rb.put(2, "c again"), "an id already buffered is a duplicate"
    rb.put(1, "b")
    assert [rb.pop(), rb.pop()] == [(1, "b"), (2, "c")]
    assert rb.statistics().duplicates == 2
    rb.check_invariants()


def test_reorder_unordered_records_what_went_out_early() -> None:
    rb = ReorderBuffer(in_order=False)
    rb.put(3, "d")
    rb.put(1, "b")
    assert rb.pop() == (3, "d") and rb.pop() == (1, "b")  # as they arrived, like torch
    assert rb.rcvd == 0 and rb.ahead == frozenset({1, 3})
    rb.put(0, "a")
    rb.pop()
    assert rb.rcvd == 2 and rb.ahead == frozenset({3})
    rb.check_invariants()
    resumed = ReorderBuffer(in_order=False, start=2, ahead=frozenset({3}))
    assert resumed.seen(3) and not resumed.seen(2)
