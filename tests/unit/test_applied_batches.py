"""A pserver applies each stream batch's gradients once (fluidps.executor.ps.applied_batches)."""

from __future__ import annotations

import pytest

from fluidps.errors import WireError
from fluidps.executor.ps.applied_batches import AppliedBatches, batch_tag, parse_tag, stream_id

CLICKS = stream_id("log:/data/clicks", "trainers")


def test_a_batch_sent_again_is_dropped_gradient_by_gradient():
    book = AppliedBatches()
    assert book.fresh((CLICKS, 128, 128), ["w@GRAD", "b@GRAD"]) == (["w@GRAD", "b@GRAD"], [])
    assert book.fresh((CLICKS, 128, 144), ["w@GRAD"]) == (["w@GRAD"], [])  # (a bucket: part of a batch)
    # Another trainer reads the window again from its start: what was applied is dropped.
    assert book.fresh((CLICKS, 128, 128), ["w@GRAD", "b@GRAD"]) == ([], ["w@GRAD", "b@GRAD"])
    assert book.fresh((CLICKS, 128, 144), ["w@GRAD", "b@GRAD"]) == (["b@GRAD"], ["w@GRAD"])  # the rest
    assert book.fresh((CLICKS, 256, 256), ["w@GRAD"]) == (["w@GRAD"], [])  # another window
    other = stream_id("log:/data/clicks", "evaluators")  # another group: its own batches
    assert book.fresh((other, 128, 128), ["w@GRAD"]) == (["w@GRAD"], [])
    assert book.dropped == 3


def test_only_the_latest_windows_are_kept():
    book = AppliedBatches(windows_kept=2)
    for start in (0, 10, 20):
        book.fresh((CLICKS, start, start), ["g"])
    assert book.fresh((CLICKS, 10, 10), ["g"]) == ([], ["g"])
    assert book.fresh((CLICKS, 0, 0), ["g"]) == (["g"], [])  # forgotten: the least recently started went


def test_tags_round_trip_and_a_bad_one_is_refused():
    assert parse_tag(batch_tag(CLICKS, 12345678901234, 12345678901250)) == (
        CLICKS,
        12345678901234,
        12345678901250,
    )
    assert parse_tag("") is None
    for text in ("stream-batch 1 2", f"stream-batch {CLICKS} -1 2", f"stream-batch {CLICKS} 1 2 3", "hello",
                 f"stream-batch {CLICKS.upper()} 1 2"):  # fmt: skip
        with pytest.raises(WireError, match="stream-batch STREAM START FIRST"):
            parse_tag(text)
