"""Each stream batch's gradients applied once by a pserver, whoever sends them again.

A streaming job's window goes to another trainer when its trainer dies or stalls
(fluidps.executor.tasks.window_queue). The new trainer reads the window from its first
record, so the batches the old one had pushed would be applied twice. Each SEND of a
step that trained on one stream batch names it in its text, `stream-batch STREAM START
FIRST`: which stream and consumer group (a hash of both), the window's first offset and
the batch's first record's offset (the same records whoever reads the window; should
records vanish between two readings, the batches that start elsewhere are new ones, and
are applied). The pserver keeps, per window, which batches' gradients it applied, by
gradient, and drops a gradient it already applied for that batch. A batch's gradients
may come in several SENDs (buckets): it is the gradient, not the message, that is
counted. A SEND of several steps' gradients merged (the communicator, send_interval >
1) names no batch and is applied as it comes.

Only where a gradient is applied as it arrives (async and SSP) does the pserver drop
what it applied before: a sync pserver applies a round once every trainer's barrier is
in, and a trainer evicted before that leaves its gradients out of the round, so a batch
marked at its arrival could be lost. In sync mode batches are applied at least once.

Windows are few at a time (a handful cut ahead of the trainers), so the latest
WINDOWS_KEPT windows are kept and older ones forgotten, committed long before.
"""

from __future__ import annotations

import hashlib
import re
from collections import OrderedDict

from fluidps.errors import WireError

TAG = re.compile(r"stream-batch ([0-9a-f]{16}) ([0-9]{1,19}) ([0-9]{1,19})")
WINDOWS_KEPT = 1024

# (stream, window start, the batch's first offset)
BatchKey = tuple[str, int, int]


def stream_id(source: str, group: str) -> str:
    """16 hex digits naming a stream and a consumer group in batch tags."""
    return hashlib.sha256(f"{source}\0{group}".encode()).hexdigest()[:16]


def batch_tag(stream: str, window_start: int, first_offset: int) -> str:
    """What a SEND of the step that trained on the batch starting at record `first_offset`
    of the window at `window_start` of `stream` (stream_id's) says."""
    return f"stream-batch {stream} {window_start} {first_offset}"


def parse_tag(text: str) -> BatchKey | None:
    """(stream, window start, first offset) a SEND's text names, None when it names none;
    a text that is neither is refused."""
    if not text:
        return None
    match = TAG.fullmatch(text)
    if match is None:
        raise WireError(
            f"a SEND's text names a stream batch as 'stream-batch STREAM START FIRST', got {text[:80]!r}"
        )
    return match[1], int(match[2]), int(match[3])


class AppliedBatches:
    """Per window (its stream and start offset): per gradient, the batches (by first
    offset) whose value was applied."""

    def __init__(self, windows_kept: int = WINDOWS_KEPT):
        self.windows_kept = windows_kept
        self._windows: OrderedDict[tuple[str, int], dict[str, set[int]]] = OrderedDict()
        self.dropped = 0  # gradients dropped as already applied

    def fresh(self, tag: BatchKey, names: list[str]) -> tuple[list[str], list[str]]:
        """(names to apply, names already applied) of a SEND of batch `tag`; counts the
        first as applied. Call it for a SEND accepted by a pserver that applies what it
        accepts (async, SSP)."""
        stream, start, index = tag
        window = self._windows.get((stream, start))
        if window is None:
            window = self._windows[(stream, start)] = {}
            while len(self._windows) > self.windows_kept:  # (the least recently started first)
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end((stream, start))
        applied = [n for n in names if index in window.get(n, ())]
        for name in names:
            window.setdefault(name, set()).add(index)
        self.dropped += len(applied)
        return [n for n in names if n not in applied], applied
