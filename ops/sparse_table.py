"""SparseTable: an auto-growing embedding table and the policy around its rows.

It is the value a hashed table's variable holds, in a local scope or on the pserver
that owns a shard of it. The rows live in a HashedTable (fluidps.ops.hashed_table);
this class decides which rows exist:

- **Reads never create rows.** An id without a row reads its initial values, which
  depend only on (seed, id), so reading is free of side effects and gives the same
  values on every pserver and locally.
- **Admission.** An update of an id without a row counts a sighting of it (once per
  step it appears in); its row is created, from its initial values, once the id was
  seen `min_count` times and a draw that depends on (seed, id, step) falls under
  `admit_probability`. Until then its gradient is dropped.
- **Eviction.** Each row keeps the step of its last update and a score: the number of
  times it appeared in updated batches, multiplied by `score_decay` at every shrink.
  A shrink (every `shrink_every` steps, or `shrink()`) removes rows not updated for more
  than `ttl_steps` steps and rows whose score fell under `delete_threshold`. A table
  at `max_rows` refuses new rows with an error, or with `evict_when_full` makes room
  by removing its lowest-scored rows.
- **Row optimizers.** The table's optimizer rule (SGD, Adagrad, lazy Adam, FTRL) is set
  by its update op at the first update; each row keeps its own state.

A table's "step" is one update: one training step locally and in a sync job, one
applied gradient in an async job.

A shard of a table distributed over K pservers holds the ids i with
mix64(i) mod K equal to its shard number (`shard_of`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from fluidps.errors import ExecutionError, ProgramError
from fluidps.ops.hashed_table import (
    RULES,
    HashedTable,
    draws,
    gather_or_init,
    initial_state,
    shard_of,
    state_width,
    update_rows,
)
from fluidps.ops.selected_rows import merge_rows

INITIALIZERS = ("uniform", "normal")


@dataclass(frozen=True)
class TableSettings:
    """A hashed table's settings (its creation op's attributes)."""

    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"  # uniform in [init_a, init_b), or normal(mean init_a, std init_b)
    init_a: float = -0.01
    init_b: float = 0.01
    seed: int = 0
    min_count: int = 1
    admit_probability: float = 1.0
    ttl_steps: int = 0  # 0: rows never expire
    score_decay: float = 1.0
    delete_threshold: float = 0.0  # 0: no row is removed for its score
    shrink_every: int = 0  # 0: only on demand
    max_rows: int = 0  # 0: unbounded
    evict_when_full: bool = False
    shard: int = 0
    shards: int = 1

    def check(self, name: str) -> TableSettings:
        """Self, or a ProgramError naming the table and the setting that is wrong."""
        problems = []
        if self.dim < 1:
            problems.append(f"dim must be >= 1, got {self.dim}")
        if self.dtype not in ("float32", "float64"):
            problems.append(f"dtype must be float32 or float64, got {self.dtype!r}")
        if self.initializer not in INITIALIZERS:
            problems.append(f"initializer must be one of {INITIALIZERS}, got {self.initializer!r}")
        elif self.initializer == "uniform" and self.init_a > self.init_b:
            problems.append(f"a uniform initializer needs low <= high, got [{self.init_a}, {self.init_b})")
        elif self.initializer == "normal" and self.init_b < 0:
            problems.append(f"a normal initializer needs std >= 0, got {self.init_b}")
        if self.min_count < 1:
            problems.append(f"min_count must be >= 1, got {self.min_count}")
        if not 0 < self.admit_probability <= 1:
            problems.append(f"admit_probability must be in (0, 1], got {self.admit_probability}")
        if min(self.ttl_steps, self.shrink_every, self.max_rows) < 0:
            problems.append("ttl_steps, shrink_every and max_rows must be >= 0 (0: off)")
        if not 0 < self.score_decay <= 1 or self.delete_threshold < 0:
            problems.append("score_decay must be in (0, 1] and delete_threshold >= 0")
        if not 0 <= self.shard < self.shards:
            problems.append(f"shard {self.shard} must be in [0, shards={self.shards})")
        if problems:
            raise ProgramError(f"hashed table {name!r}: {'; '.join(problems)}")
        return self

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class Rule:
    """How the table's update op trains its rows."""

    name: str
    epsilon: float = 1e-6
    beta1: float = 0.9
    beta2: float = 0.999
    l1: float = 0.0
    l2: float = 0.0


def owners(ids: np.ndarray, shards: int) -> np.ndarray:
    """The shard (pserver) of each id: mix64(id) mod shards."""
    out = np.empty(len(ids), dtype=np.int64)
    shard_of(np.ascontiguousarray(ids, dtype=np.int64), shards, out)
    return out


@dataclass(frozen=True)
class TableSnapshot:
    """A copy of what a table (shard) holds, taken at once: its to_arrays, whole or as a
    delta (see SparseTable.to_arrays), and the table's step count then."""

    name: str
    shard: int
    arrays: dict[str, np.ndarray]
    clock: int = 0

    @property
    def is_delta(self) -> bool:
        return is_delta(self.arrays)


# A delta's own arrays: every live row's id and score (scores decay at each shrink, so
# they change for rows the delta does not otherwise hold).
DELTA_KEYS = ("live_ids", "live_score")


def is_delta(arrays: Mapping[str, np.ndarray]) -> bool:
    return "live_ids" in arrays


def apply_delta(
    base: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray], name: str
) -> dict[str, np.ndarray]:
    """The whole arrays of a table shard from its base arrays and a delta taken later
    against that base: the delta's live rows, each from the delta where it changed and
    from the base otherwise. Raises ExecutionError when they do not fit together."""
    if is_delta(base) or not is_delta(delta):
        raise ExecutionError(f"hashed table {name!r}: a delta applies to a base, not to another delta")
    if (
        base["state"].shape[1:] != delta["state"].shape[1:]
        or base["values"].shape[1:] != delta["values"].shape[1:]
    ):
        raise ExecutionError(
            f"hashed table {name!r}: the delta holds rows {list(delta['values'].shape[1:])} and state "
            f"{list(delta['state'].shape[1:])}, its base {list(base['values'].shape[1:])} and "
            f"{list(base['state'].shape[1:])}: they belong to different programs"
        )
    live = delta["live_ids"]
    changed, in_base = _positions(delta["ids"], live), _positions(base["ids"], live)
    lost = (changed < 0) & (in_base < 0)
    if lost.any():
        raise ExecutionError(
            f"hashed table {name!r}: the delta keeps id {int(live[np.argmax(lost)])} unchanged, but its "
            "base does not hold it: the delta was taken against another base"
        )
    out = {}
    for key in ("values", "state", "updated"):
        column = base[key][np.maximum(in_base, 0)]
        column[changed >= 0] = delta[key][changed[changed >= 0]]
        out[key] = column
    out |= {"ids": live.copy(), "score": delta["live_score"].copy()}
    out |= {k: v for k, v in delta.items() if k.startswith("pending_") or k in ("counters", "shards")}
    return out


def newest_job_shards(name: str, sources: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Of `sources` (to_arrays of shards of table `name`, newest first), those saved by the
    newest one's job (the same number of shards), checked to hold every shard of it."""
    if not sources or "shards" not in sources[0]:
        return sources
    total = int(sources[0]["shards"][1])
    mine = [src for src in sources if "shards" in src and int(src["shards"][1]) == total]
    missing = sorted(set(range(total)) - {int(src["shards"][0]) for src in mine})
    if missing:
        raise ExecutionError(
            f"hashed table {name!r} was last saved in {total} shards, but no intact checkpoint holds shard(s) "
            f"{missing}: their pservers' checkpoints are missing or corrupt; restore them, or remove the "
            "newer checkpoints to go back to an older complete set"
        )
    return mine


def _positions(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Where each of `queries` is in `keys` (unique ids), -1 where absent."""
    if not len(keys):
        return np.full(len(queries), -1, np.int64)
    order = np.argsort(keys, kind="stable")
    found = order[np.searchsorted(keys, queries, sorter=order).clip(max=len(keys) - 1)]
    return np.where(keys[found] == queries, found, -1)


class SparseTable:
    def __init__(self, name: str, settings: TableSettings, capacity: int = 1024):
        self.name = name
        self.settings = settings.check(name)
        self.dtype = np.dtype(settings.dtype)
        self.rows = HashedTable(settings.dim, 0, self.dtype, capacity)
        # Ids seen but not admitted yet: one value per id, its sightings.
        self.pending = HashedTable(1, 0, np.int64, 16)
        self.rule: Rule | None = None
        self.restored_rule: str | None = None  # the rule its checkpoint was trained by
        self.clock = 0  # updates applied
        self.created = self.evicted = self.dropped = 0

    # -- reading --------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def dim(self) -> int:
        return self.settings.dim

    def check_ids(self, ids: np.ndarray, what: str) -> np.ndarray:
        """`ids` as flat int64 ids of this table (>= 0, and owned by this shard)."""
        ids = np.asarray(ids)
        if ids.dtype not in (np.int64, np.int32):
            raise ExecutionError(f"{what}: ids of hashed table {self.name!r} must be int64, got {ids.dtype}")
        ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and ids.min() < 0:
            bad = int(ids[np.argmax(ids < 0)])
            raise ExecutionError(
                f"{what}: id {bad} of hashed table {self.name!r} is negative; ids are int64 >= 0 "
                "(feature hashes: keep the low 63 bits)"
            )
        if self.settings.shards > 1 and ids.size:
            foreign = owners(ids, self.settings.shards) != self.settings.shard
            if foreign.any():
                raise ExecutionError(
                    f"{what}: id {int(ids[np.argmax(foreign)])} does not belong to shard {self.settings.shard} "
                    f"of {self.settings.shards} of hashed table {self.name!r} (its shard is mix64(id) mod "
                    f"{self.settings.shards}); trainers and pservers must be transpiled for the same job"
                )
        return ids

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (checked int64), initial values for ids without one."""
        s = self.settings
        out = np.empty((len(ids), s.dim), dtype=self.dtype)
        rows = self.rows.rows_of(ids)
        gather_or_init(
            self.rows.values, rows, ids, s.seed, s.initializer == "normal", s.init_a, s.init_b, out
        )
        return out

    # -- training -------------------------------------------------------------------------

    def use_rule(self, rule: Rule) -> None:
        """Train with `rule` (set at the first update; a second rule is an error)."""
        if self.rule == rule:
            return
        if rule.name not in RULES:
            raise ExecutionError(f"hashed table {self.name!r}: no row rule {rule.name!r}; rules: {RULES}")
        trained_by = self.rule.name if self.rule is not None else self.restored_rule
        if (trained_by is not None and trained_by != rule.name) or self.rule is not None:
            raise ExecutionError(
                f"hashed table {self.name!r} is trained by {self.rule or trained_by}, not {rule}: "
                "a table has one optimizer"
            )
        self.rule = rule
        if state_width(rule.name, self.dim) != self.rows.state_width:
            self.rows.replace_state(self._initial_state(len(self.rows)))

    def _initial_state(self, n: int) -> np.ndarray:
        r = self.rule
        return initial_state(r.name, self.dim, n, self.dtype, r.beta1, r.beta2)

    def update(self, ids: np.ndarray, grad: np.ndarray, lr: float) -> None:
        """One step: the gradient rows `grad` of `ids` (checked; may repeat, they add up)."""
        if self.rule is None:
            raise ExecutionError(f"hashed table {self.name!r} has no optimizer rule yet")
        if grad.shape != (len(ids), self.dim):
            raise ExecutionError(
                f"the gradient of hashed table {self.name!r} is {list(grad.shape)}, expected "
                f"[{len(ids)}, {self.dim}]"
            )
        self.clock += 1
        if len(ids):
            merged_ids, g = merge_rows(ids, np.ascontiguousarray(grad, dtype=self.dtype))  # sorted, unique
            shows = np.bincount(np.searchsorted(merged_ids, ids), minlength=len(merged_ids))
            rows = self.rows.rows_of(merged_ids)
            if (rows < 0).any():
                self._admit(merged_ids[rows < 0])
                rows = self.rows.rows_of(merged_ids)  # admission may have evicted rows
            live = rows >= 0
            self.dropped += int((~live).sum())
            rows, g, shows = rows[live], np.ascontiguousarray(g[live]), shows[live]
            r, t = self.rule, self.dtype.type
            update_rows(
                RULES.index(r.name), self.rows.values, self.rows.state, rows, g,
                t(lr), t(r.epsilon), t(r.beta1), t(r.beta2), t(r.l1), t(r.l2),
            )  # fmt: skip
            self.rows.updated[rows] = self.clock
            self.rows.score[rows] += shows
        if self.settings.shrink_every and self.clock % self.settings.shrink_every == 0:
            self.shrink()

    def _admit(self, ids: np.ndarray) -> None:
        """Create the rows of those of `ids` (absent, unique) that pass the admission rules."""
        s = self.settings
        admit = np.ones(len(ids), dtype=bool)
        if s.min_count > 1:
            seen = self.pending.rows_of(ids)
            fresh = seen < 0
            if fresh.any():
                self.pending.add(ids[fresh], np.zeros((int(fresh.sum()), 1), np.int64))
                seen = self.pending.rows_of(ids)
            self.pending.values[seen, 0] += 1
            self.pending.updated[seen] = self.clock
            admit &= self.pending.values[seen, 0] >= s.min_count
        if s.admit_probability < 1:
            u = np.empty(len(ids))
            draws(ids, s.seed, self.clock, u)
            admit &= u < s.admit_probability
        new = ids[admit]
        if not len(new):
            return
        if s.min_count > 1:
            self.pending.remove(new)
        room = s.max_rows - len(self.rows) if s.max_rows else len(new)
        if room < len(new):
            if not s.evict_when_full:
                raise ExecutionError(
                    f"hashed table {self.name!r} holds {len(self.rows)} rows, its max_rows is {s.max_rows}, and "
                    f"{len(new)} new ids were admitted: raise max_rows, admit fewer ids (min_count, "
                    "admit_probability), evict more (ttl_steps, delete_threshold) or set evict_when_full"
                )
            self._evict_lowest(len(new) - room)
            new = new[: s.max_rows]
        values = self.lookup(new)
        rows = self.rows.add(new, values)
        if self.rule is not None and self.rows.state_width:
            self.rows.state[rows] = self._initial_state(len(new))
        self.rows.updated[rows] = self.clock
        self.created += len(new)

    def _evict_lowest(self, count: int) -> None:
        n = len(self.rows)
        count = min(count, n)
        if count <= 0:
            return
        lowest = np.argpartition(self.rows.score[:n], count - 1)[:count]
        self.rows.remove(self.rows.ids[lowest].copy())
        self.evicted += count

    def shrink(self) -> int:
        """Decay every score, then remove expired and low-scored rows (and ids pending
        admission not seen within ttl_steps); the number of rows removed."""
        s, n = self.settings, len(self.rows)
        if s.score_decay != 1:
            self.rows.score[:n] *= np.float32(s.score_decay)
        gone = np.zeros(n, dtype=bool)
        if s.ttl_steps:
            gone |= self.clock - self.rows.updated[:n] > s.ttl_steps
            waiting = len(self.pending)
            stale = self.clock - self.pending.updated[:waiting] > s.ttl_steps
            if stale.any():
                self.pending.remove(self.pending.ids[:waiting][stale].copy())
        if s.delete_threshold:
            gone |= self.rows.score[:n] < s.delete_threshold
        removed = int(gone.sum())
        if removed:
            self.rows.remove(self.rows.ids[:n][gone].copy())
            self.evicted += removed
        return removed

    # -- inspection and checkpoints -------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes + self.pending.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "rows": len(self.rows),
            "created": self.created,
            "evicted": self.evicted,
            "dropped_updates": self.dropped,
            "pending_ids": len(self.pending),
            "bytes": self.nbytes,
            "steps": self.clock,
        }

    def items(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of every row held, as copies."""
        n = len(self.rows)
        return self.rows.ids[:n].copy(), self.rows.values[:n].copy()

    def to_arrays(self, since: int | None = None) -> dict[str, np.ndarray]:
        """Everything the table holds, as arrays (a checkpoint's content). With `since`
        (the step count of an earlier whole save, its base), a delta: whole rows only for
        those updated or created after it, and every live row's id and score
        (apply_delta rebuilds the whole arrays from the base and the delta)."""
        n, p = len(self.rows), len(self.pending)
        rule = RULES.index(self.rule.name) if self.rule else -1
        rows = slice(0, n) if since is None else np.flatnonzero(self.rows.updated[:n] > since)
        out = {
            "ids": self.rows.ids[rows].copy(),
            "values": self.rows.values[rows].copy(),
            "state": self.rows.state[rows].copy(),
            "updated": self.rows.updated[rows].copy(),
            "score": self.rows.score[:n].copy(),
            "pending_ids": self.pending.ids[:p].copy(),
            "pending_counts": self.pending.values[:p, 0].copy(),
            "pending_seen": self.pending.updated[:p].copy(),
            "counters": np.array([self.clock, rule, self.created, self.evicted, self.dropped], np.int64),
            "shards": np.array([self.settings.shard, self.settings.shards], np.int64),
        }
        if since is not None:
            out |= {"live_ids": self.rows.ids[:n].copy(), "live_score": out.pop("score")}
        return out

    def snapshot(self, since: int | None = None) -> TableSnapshot:
        """to_arrays(since), with the table's step count (a later delta's `since`)."""
        return TableSnapshot(self.name, self.settings.shard, self.to_arrays(since), self.clock)

    def restore(self, sources: list[dict[str, np.ndarray]]) -> None:
        """Replace what the table holds by the rows of `sources` (to_arrays of one or more
        shards, newest first) that belong to this shard: the rows move by the id rule when
        the number of shards changed. Only the shards of the newest source's job are used
        (older ones would bring back evicted rows), and all of them must be there. An id
        held by several sources comes from the first. The step count continues from the
        newest; created/evicted/dropped count anew."""
        s = self.settings
        if any(is_delta(src) for src in sources):
            raise ExecutionError(
                f"hashed table {self.name!r}: restore whole arrays (apply_delta to a delta first)"
            )
        sources = newest_job_shards(self.name, sources)
        rules = {int(src["counters"][1]) for src in sources} - {-1}
        if len(rules) > 1:
            raise ExecutionError(
                f"hashed table {self.name!r}: its checkpoints were trained by different rules"
            )
        saved_rule = RULES[rules.pop()] if rules else None
        if self.rule is not None and saved_rule not in (None, self.rule.name):
            raise ExecutionError(
                f"hashed table {self.name!r} was saved trained by {saved_rule}; this program trains it by "
                f"{self.rule.name}"
            )
        fresh = SparseTable(self.name, s)
        fresh.rule, fresh.restored_rule = self.rule, saved_rule
        width = state_width(saved_rule, s.dim) if saved_rule else 0
        fresh.rows.replace_state(np.zeros((0, width), self.dtype))
        for src in sources:
            if src["values"].shape[1:] != (s.dim,) or src["state"].shape[1:] != (width,):
                raise ExecutionError(
                    f"hashed table {self.name!r}: a checkpoint holds rows {list(src['values'].shape[1:])} "
                    f"and state {list(src['state'].shape[1:])}; the table needs [{s.dim}] and [{width}]"
                )
            src_ids = src["ids"]
            keep = fresh.rows.rows_of(src_ids) < 0  # not taken from a newer source
            if s.shards > 1:
                keep &= owners(src_ids, s.shards) == s.shard
            if keep.any():
                rows = fresh.rows.add(src_ids[keep], src["values"][keep].astype(self.dtype))
                fresh.rows.state[rows] = src["state"][keep]
                fresh.rows.updated[rows] = src["updated"][keep]
                fresh.rows.score[rows] = src["score"][keep]
            pend = src["pending_ids"]
            mine = fresh.pending.rows_of(pend) < 0
            if s.shards > 1:
                mine &= owners(pend, s.shards) == s.shard
            if mine.any():
                prow = fresh.pending.add(pend[mine], src["pending_counts"][mine].reshape(-1, 1))
                fresh.pending.updated[prow] = src["pending_seen"][mine]
        fresh.clock = max((int(src["counters"][0]) for src in sources), default=0)
        self.__dict__.update(fresh.__dict__)

    def __repr__(self) -> str:
        return f"SparseTable({self.name!r}, {len(self)} rows of {self.dim}, shard {self.settings.shard}/{self.settings.shards})"
