"""Which stream windows the pservers' checkpoints hold, and which a pserver lost.

In a streaming job whose pservers drop what they applied before (async, SSP), each
checkpoint records the stream batches its values hold, with the books' incarnation:
new for every pserver process, and for every restore (fluidps.executor.ps.
applied_batches). A streaming job's pserver checkpoints once before it serves, so each
incarnation is on disk before it acknowledges anything. A pserver killed and restored
from its newest checkpoint has lost what it applied since, though its trainers were
told it was applied. So the coordinator commits a window's offsets only once every
pserver's checkpoint holds it, and hands a window a pserver lost out again.

Each acknowledgement of gradients from a pserver keeping books says its newest
checkpoint's count and the books' incarnation; a trainer reports, with a window, what
the last acknowledgements of each pserver said (the window's note). Then, per pserver
the trainer sent to (`judge`):

- a checkpoint whose books hold the window (each gradient, each batch) saves it;
- a checkpoint of the same incarnation newer than the note saves it too: a pserver
  acknowledges nothing while it takes a checkpoint, which holds every gradient
  acknowledged before it, so it holds all of the window the pserver got;
- a checkpoint of another incarnation that does not hold it means the pserver came back
  from a checkpoint taken before it: the window goes out again. Batches each named are
  dropped by the pservers that hold them (exactly once); a window whose batches went
  unnamed (merged over steps) is applied again where it was not lost (at least once).

A pserver the trainer sent nothing (no acknowledgement), one whose checkpoints keep no
books (sync mode: batches at least once) and one that applies no gradient are not asked.
Checkpoints are told apart by their count, which a restarted pserver continues.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fluidps.errors import CheckpointError, Error
from fluidps.executor.ps.applied_batches import CheckpointBooks
from fluidps.executor.tasks.window_queue import Awaiting, WindowQueue
from fluidps.io import checkpoints as ckpt


@dataclass(frozen=True)
class _Newest:
    count: int
    incarnation: str | None  # None: no books (not asked)
    held: set[int] | None  # window starts of the stream held; None: this pserver is not asked


@dataclass(frozen=True)
class Verdict:
    saved: list[int]  # windows (by start) every pserver's checkpoint saved
    lost: dict[int, list[int]]  # windows (by start) -> the pservers that came back without them


class CheckpointWatch:
    """The newest checkpoint manifest of each of `pservers` pservers in `directory`, read
    as it changes, for the windows of `stream` (applied_batches.stream_id's)."""

    def __init__(self, directory: str | os.PathLike, pservers: int, stream: str):
        if pservers < 1:
            raise Error(f"a checkpoint watch needs the job's pserver count (>= 1), got {pservers}")
        self.directory = Path(directory)
        self.pservers = pservers
        self.stream = stream
        self._newest: dict[int, _Newest] = {}
        self.problems: list[str] = []  # manifests that could not be read (the next one is)
        self._unreadable: set[Path] = set()  # (said once each)

    def refresh(self) -> None:
        """Read each pserver's newest manifest if it is new."""
        for pserver, (count, path) in ckpt.newest_manifests(self.directory).items():
            if pserver >= self.pservers or (pserver in self._newest and self._newest[pserver].count >= count):
                continue
            if path in self._unreadable:
                continue
            try:
                body = ckpt.read_manifest(path).applied_batches
                books = CheckpointBooks.read(body) if body is not None else None
            except (CheckpointError, Error) as e:  # (a manifest removed or half read: the next one)
                self.problems.append(f"{path.name}: {e}")
                self._unreadable.add(path)
                continue
            held = books.held(self.stream) if books is not None else None
            self._newest[pserver] = _Newest(count, books.incarnation if held is not None else None, held)

    def judge(self, windows: dict[int, Awaiting]) -> Verdict:
        """For windows (by start) waiting on checkpoints: those every pserver saved, and
        those a pserver lost. The others wait."""
        saved, lost = [], {}
        for start, (note, exact) in windows.items():
            pending, lacking = False, []
            for pserver, (count, incarnation) in note.items():
                newest = self._newest.get(pserver)
                if newest is None:
                    pending = True  # (its checkpoint not read yet)
                    continue
                if newest.held is None:
                    continue  # (it keeps no books, or applies no gradient)
                if exact and start in newest.held:
                    continue
                if newest.incarnation != incarnation:
                    lacking.append(pserver)  # (came back from a checkpoint without it)
                elif newest.count <= count:
                    pending = True  # (no checkpoint since the window was done)
            if lacking:
                lost[start] = lacking
            elif not pending:
                saved.append(start)
        return Verdict(saved, lost)

    def settle(self, queue: WindowQueue, log: Callable[[str], None]) -> bool:
        """Read the newest manifests, then in `queue`: mark the windows every pserver saved
        and hand out again those a pserver lost (saying which); whether the books changed."""
        self.refresh()
        for problem in self.problems:
            log(f"checkpoint manifest skipped: {problem}")
        self.problems.clear()
        verdict = self.judge(queue.awaiting())
        lost = queue.reopen(list(verdict.lost))
        for window in lost:
            pservers = ", ".join(map(str, verdict.lost[window.start]))
            log(
                f"window {window.id} ({window.start}..{window.stop - 1}) goes out again: pserver {pservers} came "
                "back from a checkpoint without it (the other pservers drop the batches they hold)"
            )
        queue.saved(verdict.saved)
        return bool(lost or verdict.saved)
