"""A pserver's checkpoints: where and how often (listen_and_serv's attributes, which a
job's CheckpointOverrides replace), what they hold, and restoring them.

The pserver hands in its variables, the locks that keep an optimize thread off them
while they are copied, and its step count; the files, checksums and resharding are
fluidps.io.checkpoints'.

With checkpoint_base_every n > 1, of every n scheduled checkpoints the first is a base
and the others are deltas of it: hashed tables save only the rows updated since the
base (dense variables are whole in every checkpoint). The first checkpoint of a run,
and the first after a restore, is a base.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fluidps.errors import CheckpointError, ExecutionError
from fluidps.io import checkpoints as ckpt
from fluidps.ops.sparse_table import SparseTable, TableSnapshot

if TYPE_CHECKING:
    from fluidps.executor.ps.serve_spec import CheckpointSpec


@dataclass(frozen=True)
class CheckpointOverrides:
    """What a job sets for every pserver's checkpoints instead of what its program says
    (`fluidps launch --dataset` sets them; None: the program's attribute)."""

    directory: str | None = None
    every_steps: int | None = None
    every_seconds: float | None = None
    keep: int | None = None
    base_every: int | None = None
    # Checkpoint once before serving (a streaming job: each incarnation's books are on
    # disk before it acknowledges anything, fluidps.executor.tasks.checkpoint_watch).
    before_serving: bool = False


class Checkpointer:
    def __init__(
        self,
        spec: CheckpointSpec,
        pserver_id: int,
        log: Callable[[str], None],
        overrides: CheckpointOverrides,
    ):
        def setting(value: Any, programs: Any) -> Any:
            return programs if value is None else value

        self.log = log
        self.directory = overrides.directory or spec.directory
        self.every_steps = int(setting(overrides.every_steps, spec.every_steps))
        self.before_serving = overrides.before_serving
        self.every_seconds = float(setting(overrides.every_seconds, spec.every_seconds))
        keep = int(setting(overrides.keep, spec.keep))
        self.base_every = int(setting(overrides.base_every, spec.base_every))
        if self.every_steps < 0 or self.every_seconds < 0 or keep < 1 or self.base_every < 1:
            raise CheckpointError(
                f"checkpoint every {self.every_steps} steps / {self.every_seconds} s, keeping {keep}, a base "
                f"every {self.base_every}: intervals must be >= 0, keep and base_every >= 1"
            )
        # Which rows of which variable of the original program each persistable here is.
        self.placements = dict(spec.placements)
        self.store = ckpt.CheckpointStore(self.directory, pserver_id, keep) if self.directory else None
        self.saved: list[dict[str, Any]] = []  # this run's checkpoints, for stats
        self.restored_step: int | None = None
        self.restored_books: dict[str, Any] | None = None  # the applied-batch books restored
        self.newest_count: int | None = None  # the count of the newest checkpoint this process wrote
        self._last = (0, time.monotonic())  # (step, when) of the last checkpoint
        self._last_updates = 0  # the pserver's count of updates applied then
        # This run's last base: its count and each hashed table's step count then.
        self._base: tuple[int, dict[str, int]] | None = None
        self._deltas = 0  # checkpoints since that base

    @property
    def enabled(self) -> bool:
        return self.store is not None

    def due(self, steps: int, updates: int = 0) -> bool:
        """A periodic checkpoint is due at `steps`, with `updates` applied so far."""
        if self.store is None:
            return False
        last_step, last_time = self._last
        by_steps = self.every_steps and steps - last_step >= self.every_steps
        by_time = (
            self.every_seconds
            and time.monotonic() - last_time >= self.every_seconds
            and self.changed_since_last(steps, updates)
        )
        return bool(by_steps or by_time)

    def changed_since_last(self, steps: int, updates: int = 0) -> bool:
        """Whether the values moved since the last checkpoint: the step count, or the
        updates applied (after a restore the trainers' steps start below the restored one)."""
        return steps > self._last[0] or updates != self._last_updates

    def delta_since(self, delta: bool | None = None) -> dict[str, int] | None:
        """Whether the next checkpoint is a delta (None: as checkpoint_base_every says):
        the step count of each hashed table at the base it is a delta of, or None for a
        base (always, before this run has saved one)."""
        if delta is None:
            delta = self._deltas < self.base_every - 1
        return self._base[1] if delta and self._base is not None else None

    def layout(self, env: Mapping[str, Any]) -> str:
        """What this pserver serves, as a fingerprint: its slices of the original variables
        and its shards of hashed tables (books recorded under another layout say nothing
        about this one's rows)."""
        slices = sorted((name, *p) for name, p in self.placements.items())
        shards = sorted(
            (n, v.settings.shard, v.settings.shards)
            for n in self.placements
            if isinstance(v := env.get(n), SparseTable)
        )
        return hashlib.sha256(json.dumps([slices, shards]).encode()).hexdigest()[:16]

    def _expand_hashed(self, values: dict[str, Any]) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
        """Hashed tables' snapshots as their arrays, each a piece of its own (io.checkpoints)."""
        arrays, placements = {}, dict(self.placements)
        for name, value in values.items():
            if not isinstance(value, TableSnapshot):
                arrays[name] = value
                continue
            origin = self.placements[name].origin if name in self.placements else name
            for key, array in value.arrays.items():
                arrays[f"{name}.{key}"] = array
                placements[f"{name}.{key}"] = ckpt.Placement(ckpt.hashed_piece(origin, value.shard, key))
        return arrays, placements

    def take(
        self,
        env: Mapping[str, Any],
        locked: Callable[[str], contextlib.AbstractContextManager],
        steps: int,
        reason: str,
        delta: bool | None = None,
        books: dict[str, Any] | None = None,
        updates: int = 0,
    ) -> ckpt.Checkpoint:
        """Save a checkpoint of `env`'s persistables, each copied holding `locked(name)`;
        `delta`: of hashed tables' changes since the last base (None: as scheduled);
        `books`: the stream batches those values hold (applied_batches), recorded with them."""
        since = self.delta_since(delta) or {}
        if books is not None:
            books = {**books, "layout": self.layout(env)}
        values = {}
        for name in self.placements:
            with locked(name):
                value = env[name]
                values[name] = (
                    value.snapshot(since.get(name))
                    if isinstance(value, SparseTable)
                    else np.array(value, copy=True)
                )
        saved = self.save(values, steps, reason, books)
        self._last_updates = updates
        return saved

    def save(
        self, values: dict[str, Any], steps: int, reason: str, books: dict[str, Any] | None = None
    ) -> ckpt.Checkpoint:
        if self.store is None:
            raise CheckpointError(
                "this pserver has no checkpoint directory: set DistributeTranspilerConfig(checkpoint_dir=...) "
                "or FLUIDPS_CHECKPOINT_DIR"
            )
        started = time.monotonic()
        tables = {n: v for n, v in values.items() if isinstance(v, TableSnapshot)}
        delta = self._base is not None and any(t.is_delta for t in tables.values())
        values, placements = self._expand_hashed(values)
        saved = self.store.save(
            values, placements, steps, reason, base=self._base[0] if delta else None, applied_batches=books
        )
        self.newest_count = saved.count
        if delta:
            self._deltas += 1
        else:
            self._base, self._deltas = (saved.count, {n: t.clock for n, t in tables.items()}), 0
        self._last = (steps, time.monotonic())
        self.saved.append(ckpt.describe(saved))
        self.log(
            f"checkpoint {saved.count} ({reason}, step {saved.step}, {saved.data_bytes:,} bytes"
            f"{'' if saved.base is None else f', a delta of #{saved.base}'}) written to {saved.data_path} in "
            f"{1e3 * (time.monotonic() - started):.0f} ms"
        )
        return saved

    def restore(self, env: dict[str, Any], pserver_id: int) -> int | None:
        """Overwrite `env`'s persistables with the newest checkpoints' rows (resharded when
        the job's pservers changed); the step they were taken at, or None with none."""
        if self.store is None:
            return None
        found, problems = ckpt.latest(self.store.directory)
        for problem in problems:
            self.log(f"checkpoint problem: {problem}")
        if not found:
            self.log(f"no checkpoint in {self.store.directory}: starting from the startup program's values")
            return None
        wanted, hashed = [], []
        for name, placement in self.placements.items():
            if isinstance(env[name], SparseTable):
                hashed.append((name, placement.origin))
                continue
            value = np.asarray(env[name])
            wanted.append((name, placement.origin, placement.offset, value.shape, value.dtype))
        # Newest first, so that rows held by several checkpoints come from the latest one.
        sources = sorted(found.values(), key=lambda cv: cv[0].created, reverse=True)
        values = ckpt.assemble(wanted, sources)
        shards = ckpt.hashed_tables(sources) if hashed else {}
        for name, origin in hashed:
            if origin not in shards:
                raise CheckpointError(f"no checkpoint holds hashed table {origin!r} (needed for {name!r})")
            try:
                env[name].restore(shards[origin])  # keeps the ids this shard owns
            except ExecutionError as e:
                raise CheckpointError(f"cannot restore {name!r}: {e}") from None
            values[name] = env[name]
        env.update(values)
        own = found.get(pserver_id)
        step = own[0].step if own is not None else max(c.step for c, _ in found.values())
        books = own[0].applied_batches if own is not None else None
        self.restored_books = None
        if books is not None and books.get("layout") == self.layout(env):
            self.restored_books = books
        elif any(c.applied_batches for c, _ in sources):
            self.log(
                "the job's pservers changed since the checkpoints: this pserver's rows come from other "
                "pservers' checkpoints, so it does not know which stream batches they hold (batches sent "
                "again are applied again: at least once)"
            )
        self._last = (step, time.monotonic())
        self._base, self._deltas = None, 0  # the next checkpoint is a base of what was restored
        self.restored_step = step
        used = ", ".join(f"pserver {c.pserver_id} #{c.count} (step {c.step})" for c, _ in sources)
        self.log(
            f"restored {len(values)} variables at step {step} from {used} in {self.store.directory}; "
            "what this pserver learned after that is lost"
        )
        return step
