"""Each stream batch's gradients applied once by a pserver, whoever sends them again.

A streaming job's window goes to another trainer when its trainer dies or stalls
(fluidps.executor.tasks.window_queue). The new trainer reads the window from its first
record, so the batches the old one had pushed would be applied twice. Each SEND of a
step that trained on one stream batch names it in its text, `stream-batch START INDEX`
(the window's first offset, the batch's index in it: the same records whoever reads
the window); the pserver keeps, per window, which batches' gradients it applied, by
gradient, and drops a gradient it already applied for that batch. A batch's gradients
may come in several SENDs (buckets): it is the gradient, not the message, that is
counted. What a SEND of several steps' gradients merged carries (the communicator,
send_interval > 1) names no batch and is applied as it comes.

Windows are few at a time (a handful cut ahead of the trainers), so the latest
WINDOWS_KEPT windows are kept and older ones forgotten, committed long before.
"""

from __future__ import annotations

import re
from collections import OrderedDict

from fluidps.errors import WireError

TAG = re.compile(r"stream-batch ([0-9]{1,19}) ([0-9]{1,9})")
WINDOWS_KEPT = 1024


def batch_tag(window_start: int, index: int) -> str:
    """What a SEND of the step that trained on batch `index` of the window at `window_start` says."""
    return f"stream-batch {window_start} {index}"


def parse_tag(text: str) -> tuple[int, int] | None:
    """(window start, batch index) a SEND's text names, None when it names none; a text
    that is neither is refused."""
    if not text:
        return None
    match = TAG.fullmatch(text)
    if match is None:
        raise WireError(
            f"a SEND's text names a stream batch as 'stream-batch START INDEX', got {text[:80]!r}"
        )
    return int(match[1]), int(match[2])


class AppliedBatches:
    """Per window (its start offset): per gradient, the batches whose value was applied."""

    def __init__(self, windows_kept: int = WINDOWS_KEPT):
        self.windows_kept = windows_kept
        self._windows: OrderedDict[int, dict[str, set[int]]] = OrderedDict()
        self.dropped = 0  # gradients dropped as already applied

    def fresh(self, tag: tuple[int, int], names: list[str]) -> tuple[list[str], list[str]]:
        """(names to apply, names already applied) of a SEND of batch `tag`; counts the
        first as applied (call once the SEND is accepted)."""
        start, index = tag
        window = self._windows.get(start)
        if window is None:
            window = self._windows[start] = {}
            while len(self._windows) > self.windows_kept:  # (the oldest start first: committed long ago)
                del self._windows[min(self._windows)]
        applied = [n for n in names if index in window.get(n, ())]
        for name in names:
            window.setdefault(name, set()).add(index)
        self.dropped += len(applied)
        return [n for n in names if n not in applied], applied
