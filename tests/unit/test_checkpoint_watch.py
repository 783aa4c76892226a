"""CheckpointWatch: which stream windows the pservers' checkpoints hold, and which a
restored pserver lost (fluidps.executor.tasks.checkpoint_watch).

A window's note is what the trainer's last acknowledgements from each pserver said:
[its newest checkpoint's count, the books' incarnation]."""

from __future__ import annotations

import pytest
import stream_books
from stream_books import GRADS

from fluidps.errors import Error
from fluidps.executor.ps.applied_batches import AppliedBatches, stream_id
from fluidps.executor.tasks.checkpoint_watch import CheckpointWatch, Verdict
from fluidps.executor.tasks.window_queue import Awaiting

CLICKS = stream_id("log:clicks", "trainers")


def checkpoint(directory, pserver: int, windows: list[int] | None, books=None, gradients=GRADS):
    return stream_books.checkpoint(directory, pserver, CLICKS, windows, gradients, books)


def judged(watch: CheckpointWatch, windows: dict[int, Awaiting]) -> Verdict:
    watch.refresh()
    return watch.judge(windows)


def test_a_window_is_saved_by_checkpoints_that_hold_it_and_lost_by_a_pserver_that_came_back(tmp_path):
    watch = CheckpointWatch(tmp_path, 2, CLICKS)
    zero, one = checkpoint(tmp_path, 0, []), checkpoint(tmp_path, 1, [])  # (as they start serving)
    note = {0: [1, zero.incarnation], 1: [1, one.incarnation]}  # acknowledged after checkpoint 1 each
    assert judged(watch, {0: Awaiting(note, True)}) == Verdict([], {})  # no checkpoint holds it yet: it waits
    checkpoint(tmp_path, 0, [0], zero)
    assert judged(watch, {0: Awaiting(note, True)}) == Verdict([], {})  # pserver 1 has not saved it yet
    checkpoint(tmp_path, 1, [0], one)
    assert judged(watch, {0: Awaiting(note, True)}) == Verdict([0], {})

    later = {0: [2, zero.incarnation], 1: [2, one.incarnation]}  # window 10, acknowledged after those
    checkpoint(tmp_path, 0, [10], zero)
    checkpoint(tmp_path, 1, [0], AppliedBatches())  # pserver 1 came back from a checkpoint without window 10
    assert judged(watch, {10: Awaiting(later, True)}) == Verdict([], {10: [1]})


def test_a_checkpoint_that_holds_the_window_saves_it_even_if_it_came_before_the_report(tmp_path):
    # The last gradients acknowledged, then a checkpoint, then the trainer's report: the
    # checkpoint's count is the one the acknowledgement said, or newer.
    watch = CheckpointWatch(tmp_path, 1, CLICKS)
    books = checkpoint(tmp_path, 0, [])
    checkpoint(tmp_path, 0, [0], books)
    assert judged(watch, {0: Awaiting({0: [1, books.incarnation]}, True)}) == Verdict([0], {})


def test_a_newer_checkpoint_of_the_same_incarnation_saves_what_the_pserver_got(tmp_path):
    # A window whose batches were not named (merged over steps) is not in the books; a
    # checkpoint newer than its acknowledgements still holds all the pserver got of it.
    watch = CheckpointWatch(tmp_path, 1, CLICKS)
    books = checkpoint(tmp_path, 0, [])
    merged = {0: [1, books.incarnation]}
    assert judged(watch, {10: Awaiting(merged, False)}) == Verdict([], {})
    checkpoint(tmp_path, 0, [], books)
    assert judged(watch, {10: Awaiting(merged, False)}) == Verdict([10], {})
    checkpoint(tmp_path, 0, [10], AppliedBatches())  # restarted: a window not named is lost, though held
    assert judged(watch, {10: Awaiting(merged, False)}) == Verdict([], {10: [0]})


def test_pservers_sent_nothing_keeping_no_books_or_applying_no_gradient_are_not_asked(tmp_path):
    watch = CheckpointWatch(tmp_path, 4, CLICKS)
    zero = checkpoint(tmp_path, 0, [0])
    checkpoint(tmp_path, 1, None)  # sync: applied at least once
    two = checkpoint(tmp_path, 2, [], gradients=[])  # holds no gradient of this job
    note = {0: [1, zero.incarnation], 1: [1, "0" * 16], 2: [1, two.incarnation]}  # (pserver 3: sent nothing)
    assert judged(watch, {0: Awaiting(note, True)}) == Verdict([0], {})


def test_a_damaged_manifest_is_skipped_and_said(tmp_path):
    watch = CheckpointWatch(tmp_path, 1, CLICKS)
    (tmp_path / "pserver-0-000001.json").write_text('{"format": "nope"}')
    note = {0: [1, "0" * 16]}
    assert judged(watch, {0: Awaiting(note, True)}) == Verdict([], {})
    assert watch.problems and "pserver-0-000001.json" in watch.problems[0]
    watch.refresh()
    assert len(watch.problems) == 1  # (said once)
    with pytest.raises(Error, match="pserver count"):
        CheckpointWatch(tmp_path, 0, CLICKS)
