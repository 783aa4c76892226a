"""A pserver's checkpoint whose applied-batch books hold some windows of a stream, as a
streaming job's pserver writes it (for the coordinator's checkpoint watch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fluidps.executor.ps.applied_batches import AppliedBatches, BatchKey
from fluidps.io.checkpoints import CheckpointStore

GRADS = ["w@GRAD"]


def checkpoint(
    directory: Path,
    pserver: int,
    stream: str,
    windows: list[int] | None,
    gradients=GRADS,
    books: AppliedBatches | None = None,
) -> AppliedBatches | None:
    """A checkpoint of `pserver` whose books (`books`, else new ones: a new incarnation)
    hold `windows` of `stream` too (by start; one batch each); None: a pserver that keeps
    no books (sync mode). Returns the books."""
    manifest = None
    if windows is not None:
        books = books or AppliedBatches()
        for start in windows:
            books.fresh(BatchKey(stream, start, start, 1, start), GRADS)
        manifest = books.to_manifest(gradients)
    CheckpointStore(directory, pserver).save(
        {"w": np.zeros(1, np.float32)}, {}, 1, "test", applied_batches=manifest
    )
    return books
