"""A pserver applies each stream batch's gradients once (fluidps.executor.ps.applied_batches)."""

from __future__ import annotations

import json

import pytest

from fluidps.errors import Error, WireError
from fluidps.executor.ps.applied_batches import (
    AppliedBatches,
    BatchKey,
    CheckpointBooks,
    batch_tag,
    from_runs,
    in_runs,
    parse_tag,
    stream_id,
    to_runs,
)

CLICKS = stream_id("log:/data/clicks", "trainers")
GRADS = ["w@GRAD", "b@GRAD"]


def batch(start: int, first: int, batches: int = 4, reading: int | None = None) -> BatchKey:
    return BatchKey(CLICKS, start, first, batches, start if reading is None else reading)


def test_a_batch_sent_again_is_dropped_gradient_by_gradient():
    book = AppliedBatches()
    assert book.fresh(batch(128, 128), GRADS) == (GRADS, [])
    assert book.fresh(batch(128, 144), ["w@GRAD"]) == (["w@GRAD"], [])  # (a bucket: part of a batch)
    # The window again, from its first batch: what was applied is dropped, the rest kept.
    assert book.fresh(batch(128, 128), GRADS) == ([], GRADS)
    assert book.fresh(batch(128, 144), GRADS) == (["b@GRAD"], ["w@GRAD"])
    assert book.fresh(batch(256, 256), ["w@GRAD"]) == (["w@GRAD"], [])  # another window
    other = stream_id("log:/data/clicks", "evaluators")  # another group reads the same offsets
    assert book.fresh(BatchKey(other, 128, 128, 4, 128), ["w@GRAD"]) == (["w@GRAD"], [])
    assert book.dropped == 3


def test_only_the_latest_windows_are_kept():
    book = AppliedBatches(windows_kept=2)
    for start in (0, 10, 20):
        book.fresh(batch(start, start, 2), ["g"])
    assert book.fresh(batch(10, 10, 2), ["g"]) == ([], ["g"])
    assert book.fresh(batch(0, 0, 2), ["g"]) == (["g"], [])  # forgotten: the least recently started went


def test_a_window_is_held_once_every_gradient_has_every_batch_and_the_books_survive_a_checkpoint():
    book = AppliedBatches()
    for first in (0, 16, 32):  # window 0..47: three batches
        book.fresh(batch(0, first, 3), GRADS)
    book.fresh(batch(48, 48, 3), GRADS)  # window 48..: one batch of three
    for first in (96, 112, 128):  # window 96..: b@GRAD's last batch missing (a bucket not sent yet)
        book.fresh(batch(96, first, 3), ["w@GRAD"] + (["b@GRAD"] if first < 128 else []))
    manifest = json.loads(json.dumps(book.to_manifest(GRADS)))  # (as a checkpoint keeps it)
    books = CheckpointBooks.read(manifest)
    assert books.incarnation == book.incarnation and books.held(CLICKS) == {0}
    assert books.held(stream_id("log:/other", "trainers")) == set()
    assert CheckpointBooks.read({"incarnation": "x", "gradients": [], "windows": []}).held(CLICKS) is None

    restored = AppliedBatches.from_manifest(manifest)
    assert restored.incarnation != book.incarnation  # (a restore starts a new lineage)
    # What the checkpoint holds is dropped; what it lacks is applied, and then held.
    assert restored.fresh(batch(0, 16, 3), GRADS) == ([], GRADS)
    assert restored.fresh(batch(48, 48, 3), ["w@GRAD"]) == ([], ["w@GRAD"])
    assert restored.fresh(batch(96, 128, 3), GRADS) == (["b@GRAD"], ["w@GRAD"])
    assert CheckpointBooks.read(restored.to_manifest(GRADS)).held(CLICKS) == {0, 96}


def test_a_window_read_again_with_records_retired_counts_its_own_batches():
    # Read from 0 in batches of 16: three of four applied; the trainer dies, retention
    # retires records 0..9, and the window is read again from 10 (its batches start elsewhere).
    book = AppliedBatches()
    for first in (0, 16, 32):
        book.fresh(batch(0, first, 4, reading=0), ["g"])
    for first in (10, 26, 42):
        assert book.fresh(batch(0, first, 4, reading=10), ["g"]) == (["g"], [])
        assert CheckpointBooks.read(book.to_manifest(["g"])).held(CLICKS) == set()  # not all of this reading
    assert book.fresh(batch(0, 58, 4, reading=10), ["g"]) == (["g"], [])
    assert CheckpointBooks.read(book.to_manifest(["g"])).held(CLICKS) == {0}
    assert book.fresh(batch(0, 16, 4, reading=0), ["g"]) == ([], ["g"])  # (the first reading's, still known)


def test_offsets_are_kept_as_runs():
    offsets = [0, 16, 32, 48, 100, 300, 301, 302]
    runs = to_runs(offsets)
    assert runs == [[0, 16, 4], [100, 200, 2], [301, 1, 2]] and from_runs(runs) == set(offsets)
    assert all(in_runs(o, runs) for o in offsets) and not any(in_runs(o, runs) for o in (1, 8, 64, 200, 303))
    assert to_runs([]) == [] and to_runs([7]) == [[7, 0, 1]] and in_runs(7, [[7, 0, 1]])


@pytest.mark.parametrize(
    "books",
    [
        [],
        {"incarnation": "x", "gradients": "w@GRAD", "windows": []},
        {"incarnation": "x", "gradients": ["w@GRAD"]},
        {"gradients": ["w@GRAD"], "windows": []},  # no incarnation
        {"incarnation": "x", "gradients": ["w@GRAD"], "windows": [[CLICKS, 0, 0]]},
        *(
            {"incarnation": "x", "gradients": ["w@GRAD"], "windows": [entry]}
            for entry in (
                {"stream": CLICKS, "start": 0, "reading": 0, "batches": 0, "open": {}, "complete": {}, "earlier": {}},
                {"stream": CLICKS, "start": -1, "reading": 0, "batches": 1, "open": {}, "complete": {}, "earlier": {}},
                {"stream": "nope", "start": 0, "reading": 0, "batches": 1, "open": {}, "complete": {}, "earlier": {}},
                {"stream": CLICKS, "start": 0, "reading": 0, "batches": 1, "open": {"g": [1.5]}, "complete": {},
                 "earlier": {}},
                {"stream": CLICKS, "start": 0, "reading": 0, "batches": 1, "open": {}, "complete": {"g": [[0, 1]]},
                 "earlier": {}},
            )
        ),
    ],
)  # fmt: skip
def test_damaged_books_are_refused(books):
    with pytest.raises(Error, match="applied-batch books"):
        AppliedBatches.from_manifest(books)


def test_tags_round_trip_and_a_bad_one_is_refused():
    assert parse_tag(batch_tag(CLICKS, 12345678901234, 12345678901250, 7, 12345678901240)) == (
        CLICKS,
        12345678901234,
        12345678901250,
        7,
        12345678901240,
    )
    assert parse_tag("") is None
    for text in ("stream-batch 1 2", f"stream-batch {CLICKS} -1 2 1 0", f"stream-batch {CLICKS} 1 2 3",
                 f"stream-batch {CLICKS} 1 2 0 1", "hello", f"stream-batch {CLICKS.upper()} 1 2 3 1",
                 f"stream-batch {CLICKS} 5 8 2 9", f"stream-batch {CLICKS} 5 8 2 4"):  # fmt: skip
        with pytest.raises(WireError, match="stream-batch STREAM START FIRST BATCHES READING"):
            parse_tag(text)
