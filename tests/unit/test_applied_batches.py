"""A pserver applies each stream batch's gradients once (fluidps.executor.ps.applied_batches)."""

from __future__ import annotations

import pytest

from fluidps.errors import WireError
from fluidps.executor.ps.applied_batches import AppliedBatches, batch_tag, parse_tag


def test_a_batch_sent_again_is_dropped_gradient_by_gradient():
    book = AppliedBatches()
    assert book.fresh((128, 0), ["w@GRAD", "b@GRAD"]) == (["w@GRAD", "b@GRAD"], [])
    assert book.fresh((128, 1), ["w@GRAD"]) == (["w@GRAD"], [])  # (a bucket: part of batch 1)
    # Another trainer reads the window again from its start: what was applied is dropped.
    assert book.fresh((128, 0), ["w@GRAD", "b@GRAD"]) == ([], ["w@GRAD", "b@GRAD"])
    assert book.fresh((128, 1), ["w@GRAD", "b@GRAD"]) == (["b@GRAD"], ["w@GRAD"])  # the rest of batch 1
    assert book.fresh((256, 0), ["w@GRAD"]) == (["w@GRAD"], [])  # another window
    assert book.dropped == 3


def test_only_the_latest_windows_are_kept():
    book = AppliedBatches(windows_kept=2)
    for start in (0, 10, 20):
        book.fresh((start, 0), ["g"])
    assert book.fresh((10, 0), ["g"]) == ([], ["g"])
    assert book.fresh((0, 0), ["g"]) == (["g"], [])  # forgotten: the oldest went first


def test_tags_round_trip_and_a_bad_one_is_refused():
    assert parse_tag(batch_tag(12345678901234, 7)) == (12345678901234, 7)
    assert parse_tag("") is None
    for text in ("stream-batch 1", "stream-batch -1 2", "stream-batch 1 2 3", "hello", "stream-batch 1 x"):
        with pytest.raises(WireError, match="stream-batch START INDEX"):
            parse_tag(text)
