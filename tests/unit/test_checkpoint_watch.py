"""CheckpointWatch: which stream windows the pservers' checkpoints hold, and which a
restored pserver lost (fluidps.executor.tasks.checkpoint_watch)."""

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


def test_a_window_is_saved_by_checkpoints_that_hold_it_and_lost_by_a_pserver_that_came_back(tmp_path):
    watch = CheckpointWatch(tmp_path, 2, CLICKS)
    zero, one = checkpoint(tmp_path, 0, []), checkpoint(tmp_path, 1, [])  # (as they start serving)
    note = watch.note()  # window 0 done now
    assert note == {0: [1, zero.incarnation], 1: [1, one.incarnation]}
    assert watch.judge({0: Awaiting(note, True)}) == Verdict([], {})  # no checkpoint holds it yet: it waits
    checkpoint(tmp_path, 0, [0], zero)
    watch.refresh()
    assert watch.judge({0: Awaiting(note, True)}) == Verdict([], {})  # pserver 1 has not saved it yet
    checkpoint(tmp_path, 1, [0], one)
    watch.refresh()
    assert watch.judge({0: Awaiting(note, True)}) == Verdict([0], {})

    later = watch.note()  # window 10 done now
    checkpoint(tmp_path, 0, [10], zero)
    checkpoint(tmp_path, 1, [0], AppliedBatches())  # pserver 1 came back from a checkpoint without window 10
    watch.refresh()
    assert watch.judge({10: Awaiting(later, True)}) == Verdict([], {10: [1]})


def test_a_newer_checkpoint_of_the_same_incarnation_saves_what_the_pserver_got(tmp_path):
    # A window whose batches sent this pserver nothing (or were not named: merged over
    # steps) is not in its books; a checkpoint taken after it was done still holds all it got.
    watch = CheckpointWatch(tmp_path, 1, CLICKS)
    books = checkpoint(tmp_path, 0, [])
    exact, merged = watch.note(), watch.note()
    assert watch.judge({0: Awaiting(exact, True), 10: Awaiting(merged, False)}) == Verdict([], {})
    checkpoint(tmp_path, 0, [], books)
    watch.refresh()
    assert watch.judge({0: Awaiting(exact, True), 10: Awaiting(merged, False)}) == Verdict([0, 10], {})
    checkpoint(tmp_path, 0, [10], AppliedBatches())  # restarted: a window not named is lost, though held
    watch.refresh()
    assert watch.judge({10: Awaiting(merged, False)}) == Verdict([], {10: [0]})


def test_pservers_that_keep_no_books_or_apply_no_gradient_are_not_asked(tmp_path):
    watch = CheckpointWatch(tmp_path, 3, CLICKS)
    note = watch.note()
    checkpoint(tmp_path, 0, [0])
    checkpoint(tmp_path, 1, None)  # sync: applied at least once
    checkpoint(tmp_path, 2, [], gradients=[])  # holds no gradient of this job
    watch.refresh()
    assert watch.judge({0: Awaiting(note, True)}) == Verdict([0], {})


def test_a_damaged_manifest_is_skipped_and_said(tmp_path):
    watch = CheckpointWatch(tmp_path, 1, CLICKS)
    note = watch.note()
    (tmp_path / "pserver-0-000001.json").write_text('{"format": "nope"}')
    watch.refresh()
    assert watch.problems and "pserver-0-000001.json" in watch.problems[0]
    assert watch.judge({0: Awaiting(note, True)}) == Verdict([], {})
    watch.refresh()
    assert len(watch.problems) == 1  # (said once)
    with pytest.raises(Error, match="pserver count"):
        CheckpointWatch(tmp_path, 0, CLICKS)
