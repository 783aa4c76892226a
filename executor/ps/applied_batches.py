"""Each stream batch's gradients applied once by a pserver, whoever sends them again.

A streaming job's window goes to another trainer when its trainer dies or stalls
(fluidps.executor.tasks.window_queue). The new trainer reads the window from its first
record, so the batches the old one had pushed would be applied twice. Each SEND of a
step that trained on one stream batch names it in its text, `stream-batch STREAM START
FIRST BATCHES READING`: which stream and consumer group (a hash of both), the window's
first offset, the batch's first record's offset, and the reading it belongs to (how
many batches it makes, and its first record's offset). Whoever reads a window reads the
same records, in the same batches; should records vanish between two readings
(retention), the batches that start elsewhere are new ones, and are applied. The
pserver keeps, per window, which batches' gradients it applied, by gradient, and drops
a gradient it already applied for that batch. A batch's gradients may come in several
SENDs (buckets): it is the gradient, not the message, that is counted. A SEND of several
steps' gradients merged (the communicator, send_interval > 1) names no batch and is
applied as it comes.

Only where a gradient is applied as it arrives (async and SSP) does the pserver drop
what it applied before: a sync pserver applies a round once every trainer's barrier is
in, and a trainer evicted before that leaves its gradients out of the round, so a batch
marked at its arrival could be lost. In sync mode batches are applied at least once.

Once a gradient was applied for every batch of the latest reading, it is complete for
the window, and its offsets are kept as runs (first, step, count): a window's batches
start at evenly spaced offsets, so a run or two. The books go into each checkpoint,
taken when every gradient accepted is applied (fluidps.executor.ps.checkpointer), so
they say exactly what the checkpoint's values hold, with the books' incarnation (new
for every process, and for every restore): the coordinator commits a window once every
pserver's checkpoint holds it, and hands a window out again when a pserver came back
from a checkpoint without it (fluidps.executor.tasks.checkpoint_watch); the restored
pserver then drops what it holds and applies what it lost.

Windows are few at a time (a handful cut ahead of the trainers, the rest waiting for a
checkpoint), so the latest WINDOWS_KEPT windows are kept and older ones forgotten,
committed long before.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from fluidps.errors import Error, WireError

_OFFSET = r"([0-9]{1,18})"  # (below 2**63, as the books require)
TAG = re.compile(rf"stream-batch ([0-9a-f]{{16}}) {_OFFSET} {_OFFSET} ([0-9]{{1,9}}) {_OFFSET}")
STREAM_ID = re.compile(r"[0-9a-f]{16}")
# What a pserver keeping books says when it acknowledges gradients: its id, its newest
# checkpoint's count and the books' incarnation (fluidps.executor.tasks.checkpoint_watch).
ACK = re.compile(r"checkpoint ([0-9]{1,9}) ([0-9]{1,9}) ([0-9a-f]{16})")
WINDOWS_KEPT = 1024
MAX_RUN = 1 << 20  # batches a run of books read back may hold (a window's are far fewer)

# Offsets as runs: [first, step, count] stands for first, first + step, ... (count of them).
Runs = list[list[int]]


class BatchKey(NamedTuple):
    stream: str  # stream_id's
    start: int  # the window's first offset
    first: int  # the batch's first record's offset
    batches: int  # how many batches this reading of the window makes
    reading: int  # this reading's first record's offset


def stream_id(source: str, group: str) -> str:
    """16 hex digits naming a stream and a consumer group in batch tags."""
    return hashlib.sha256(f"{source}\0{group}".encode()).hexdigest()[:16]


def window_key(stream: str, start: int) -> str:
    """A window, as batch tags name it (the first two of their fields)."""
    return f"{stream} {start}"


def batch_tag(stream: str, window_start: int, first_offset: int, batches: int, reading: int) -> str:
    """What a SEND of the step that trained on the batch starting at record `first_offset`
    of the window at `window_start` of `stream` (stream_id's), one of the `batches`
    batches of a reading whose first record is at `reading`, says."""
    return f"stream-batch {window_key(stream, window_start)} {first_offset} {batches} {reading}"


def tag_window(tag: str) -> str:
    """The window_key of a batch tag."""
    return " ".join(tag.split(" ")[1:3])


def parse_tag(text: str) -> BatchKey | None:
    """The stream batch a SEND's text names, None when it names none; a text that is
    neither is refused."""
    if not text:
        return None
    match = TAG.fullmatch(text)
    if match is None or int(match[4]) < 1 or not int(match[2]) <= int(match[5]) <= int(match[3]):
        raise WireError(
            "a SEND's text names a stream batch as 'stream-batch STREAM START FIRST BATCHES READING' "
            f"(START <= READING <= FIRST), got {text[:80]!r}"
        )
    return BatchKey(match[1], int(match[2]), int(match[3]), int(match[4]), int(match[5]))


@dataclass(frozen=True)
class Delivered:
    """What a trainer's gradients since its last window came to (TrainerClient.deliver_all):
    the windows some of whose batches went unnamed (window_key's), and per pserver keeping
    books, [its newest checkpoint's count, the books' incarnation] as its latest
    acknowledgement said."""

    untagged: frozenset[str] = frozenset()
    acked: dict[int, list] = field(default_factory=dict)


def ack_text(pserver: int, checkpoint: int, incarnation: str) -> str:
    """What a pserver keeping books says in each acknowledgement of gradients."""
    return f"checkpoint {pserver} {checkpoint} {incarnation}"


def parse_ack(text: str) -> tuple[int, list] | None:
    """(pserver, [checkpoint count, incarnation]) of an acknowledgement's text; None
    when it says nothing of the kind."""
    match = ACK.fullmatch(text) if text else None
    return (int(match[1]), [int(match[2]), match[3]]) if match else None


def to_runs(offsets: Iterable[int]) -> Runs:
    runs: Runs = []
    for offset in sorted(set(offsets)):
        if runs:
            first, step, count = runs[-1]
            if count == 1 or offset - (first + step * (count - 1)) == step:
                runs[-1] = [first, offset - first if count == 1 else step, count + 1]
                continue
        runs.append([offset, 0, 1])
    return runs


def in_runs(offset: int, runs: Runs) -> bool:
    for first, step, count in runs:
        if step == 0:
            if offset == first:
                return True
        elif first <= offset <= first + step * (count - 1) and (offset - first) % step == 0:
            return True
    return False


def from_runs(runs: Runs) -> set[int]:
    return {first + step * k for first, step, count in runs for k in range(count)}


@dataclass
class _Window:
    reading: int  # the latest reading's first offset
    batches: int  # and how many batches it makes
    open: dict[str, set[int]] = field(default_factory=dict)  # gradient -> batches applied, not all yet
    complete: dict[str, Runs] = field(default_factory=dict)  # gradient -> every batch of the reading
    earlier: dict[str, Runs] = field(default_factory=dict)  # gradient -> batches of earlier readings

    def applied(self, name: str, first: int) -> bool:
        return (
            first in self.open.get(name, ())
            or in_runs(first, self.complete.get(name, []))
            or in_runs(first, self.earlier.get(name, []))
        )

    def new_reading(self, reading: int, batches: int) -> None:
        """The window read again with other records (some retired): what was applied
        stays applied, and completeness counts this reading's batches."""
        for name in {*self.open, *self.complete}:
            offsets = self.open.get(name, set()) | from_runs(self.complete.get(name, []))
            self.earlier[name] = to_runs(offsets | from_runs(self.earlier.get(name, [])))
        self.reading, self.batches, self.open, self.complete = reading, batches, {}, {}


class AppliedBatches:
    """Per window (its stream and start offset): per gradient, the batches (by first
    offset) whose value was applied."""

    def __init__(self, windows_kept: int = WINDOWS_KEPT):
        self.windows_kept = windows_kept
        self.incarnation = secrets.token_hex(8)  # these books' lineage (a restore starts a new one)
        self._windows: OrderedDict[tuple[str, int], _Window] = OrderedDict()
        self.dropped = 0  # gradients dropped as already applied

    def fresh(self, tag: BatchKey, names: list[str]) -> tuple[list[str], list[str]]:
        """(names to apply, names already applied) of a SEND of batch `tag`, counting the
        first as applied (split, then mark)."""
        keep, applied = self.split(tag, names)
        self.mark(tag, names)
        return keep, applied

    def split(self, tag: BatchKey, names: list[str]) -> tuple[list[str], list[str]]:
        """(names to apply, names already applied) of a SEND of batch `tag`; mark the
        batch's gradients once they are accepted (a pserver that applies what it accepts:
        async, SSP)."""
        window = self._window(tag)
        applied = [n for n in names if window.applied(n, tag.first)]
        self.dropped += len(applied)
        return [n for n in names if n not in applied], applied

    def mark(self, tag: BatchKey, names: list[str]) -> None:
        """Count batch `tag`'s gradients `names` applied (for this reading, also those
        applied in an earlier one)."""
        window = self._window(tag)
        for name in names:
            if in_runs(tag.first, window.complete.get(name, [])):
                continue
            offsets = window.open.setdefault(name, set())
            offsets.add(tag.first)
            if len(offsets) >= window.batches:
                window.complete[name] = to_runs(window.open.pop(name))

    def _window(self, tag: BatchKey) -> _Window:
        key = (tag.stream, tag.start)
        window = self._windows.get(key)
        if window is None:
            window = self._windows[key] = _Window(tag.reading, tag.batches)
            while len(self._windows) > self.windows_kept:  # (the least recently started first)
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(key)
            if (tag.reading, tag.batches) != (window.reading, window.batches):
                window.new_reading(tag.reading, tag.batches)
        return window

    def to_manifest(self, gradients: Iterable[str]) -> dict[str, Any]:
        """What a checkpoint records: the books' incarnation, the `gradients` this pserver
        applies (a window is held once each is complete) and each window's entry."""
        return {
            "incarnation": self.incarnation,
            "gradients": sorted(gradients),
            "windows": [
                {
                    "stream": stream,
                    "start": start,
                    "reading": w.reading,
                    "batches": w.batches,
                    "open": {g: sorted(o) for g, o in w.open.items()},
                    "complete": w.complete,
                    "earlier": w.earlier,
                }
                for (stream, start), w in self._windows.items()
            ],
        }

    @classmethod
    def from_manifest(cls, body: Any, windows_kept: int = WINDOWS_KEPT) -> AppliedBatches:
        """The books a checkpoint recorded (to_manifest's), as a new incarnation; an Error
        says what is wrong."""
        books = cls(windows_kept)
        for entry in CheckpointBooks.read(body).windows:
            books._windows[(entry["stream"], entry["start"])] = _Window(
                entry["reading"],
                entry["batches"],
                {g: set(o) for g, o in entry["open"].items()},
                entry["complete"],
                entry["earlier"],
            )
        return books


@dataclass(frozen=True)
class CheckpointBooks:
    """The books as a checkpoint's manifest holds them, checked."""

    incarnation: str
    gradients: tuple[str, ...]
    windows: list[dict[str, Any]]

    @staticmethod
    def read(body: Any) -> CheckpointBooks:
        if not isinstance(body, dict) or not isinstance(body.get("windows"), list):
            raise Error(f"applied-batch books must be an object with a list of windows, got {str(body)[:80]}")
        incarnation, gradients = body.get("incarnation"), body.get("gradients")
        if not isinstance(incarnation, str) or not isinstance(gradients, list):
            raise Error("applied-batch books name their incarnation and their gradients")
        if not all(isinstance(g, str) for g in gradients):
            raise Error("applied-batch books name their gradients as strings")
        for entry in body["windows"]:
            if not _window_entry(entry):
                raise Error(f"applied-batch books hold a bad window entry: {str(entry)[:120]}")
        return CheckpointBooks(incarnation, tuple(gradients), body["windows"])

    def held(self, stream: str) -> set[int] | None:
        """The windows of `stream` (their starts) whose latest reading's every batch these
        books hold for every gradient of the pserver; None for a pserver that applies no
        gradient."""
        if not self.gradients:
            return None
        return {
            w["start"]
            for w in self.windows
            if w["stream"] == stream and all(g in w["complete"] for g in self.gradients)
        }


def _window_entry(entry: Any) -> bool:
    try:
        return (
            isinstance(entry, dict)
            and isinstance(entry["stream"], str) and STREAM_ID.fullmatch(entry["stream"]) is not None
            and _count(entry["start"]) and _count(entry["reading"]) and _count(entry["batches"])
            and entry["batches"] >= 1
            and _offsets(entry["open"], lambda o: isinstance(o, list) and all(_count(i) for i in o))
            and _offsets(entry["complete"], _is_runs)
            and _offsets(entry["earlier"], _is_runs)
        )  # fmt: skip
    except (KeyError, TypeError):
        return False


def _offsets(by_gradient: Any, check) -> bool:
    return isinstance(by_gradient, dict) and all(
        isinstance(g, str) and check(v) for g, v in by_gradient.items()
    )


def _is_runs(runs: Any) -> bool:
    return isinstance(runs, list) and all(
        isinstance(r, list) and len(r) == 3 and all(_count(i) for i in r) and 1 <= r[2] <= MAX_RUN
        for r in runs
    )


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
