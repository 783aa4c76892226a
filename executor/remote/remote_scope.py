"""RemoteScope: a RemoteExecutor's values, wherever the job keeps them.

Before the job is deployed the values live in the client (the startup
program ran here, saved values were loaded here) and the job starts from
them. Once deployed, a variable the plan placed on pservers is gathered from
its slices (rows concatenated by offset) and scattered back to them, once: the
trainers are only told which of their copies are stale, and pull those from the
pservers before their next step (so the next step uses what was set).
Variables only trainers hold (not placed) are read from trainer 0 and
written to every trainer. Gathered values are cached until the next step
or write, so an evaluation loop reads the parameters once. A pipeline job's
values are read from the stage that holds them and written to every stage
that does (PipelineJob).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from fluidps.errors import ExecutionError, UnsupportedError
from fluidps.executor.scope import Scope, Value, as_value
from fluidps.executor.transport.rpc import wait_all
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ir.program import Program
from fluidps.ir.types import to_numpy_dtype
from fluidps.ops.sparse_table import SparseTable, TableSettings, owners

if TYPE_CHECKING:
    from fluidps.executor.remote.pipeline_job import PipelineJob
    from fluidps.executor.remote.remote_executor import Deployment


class RemoteScope:
    def __init__(self, staging: Scope):
        self.staging = staging  # the client's values, before deployment
        self.deployment: Deployment | None = None
        self.pipeline: PipelineJob | None = None  # a pipeline program's stages, once deployed
        self._cache: dict[str, Value] = {}

    def invalidate(self) -> None:
        """The job's values changed (a training step ran)."""
        self._cache.clear()

    # -- the Scope interface that io and users rely on ----------------------------------------

    def find(self, name: str) -> Value | None:
        return self.gather([name]).get(name)

    def __getitem__(self, name: str) -> Value:
        value = self.find(name)
        if value is None:
            raise KeyError(f"variable {name!r} is not in the job")
        return value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.find(name) is not None

    def __setitem__(self, name: str, value: Any) -> None:
        self.scatter({name: as_value(name, value)})

    # -- batched ---------------------------------------------------------------------------

    def table_rows(self, table: str, ids: np.ndarray) -> np.ndarray:
        """The rows of `ids` (unique int64) of hashed table `table`, asked of the pservers
        owning them (an observer's PREFETCH: it changes nothing, and ids without a row read
        their initial values). Only the asked rows travel."""
        d = self.deployment
        shards = d.plan.slices_of(table) if d is not None else []
        if not shards or not shards[0].hashed:
            raise ExecutionError(f"{table!r} is not a hashed table of this job")
        owner = owners(ids, len(shards))
        pending = {}
        for s in shards:
            mine = owner == s.block_id
            if mine.any():
                message = Message(Kind.PREFETCH, trainer_id=-1, tensors={s.name: ids[mine]})
                pending[s.block_id] = (d.pservers[s.endpoint], d.pservers[s.endpoint].request(message))
        replies = wait_all(pending)
        rows = np.empty((len(ids), shards[0].shape[1]), dtype=to_numpy_dtype(shards[0].dtype))
        for s in shards:
            if s.block_id in replies:
                rows[owner == s.block_id] = replies[s.block_id].tensors[s.name]
        return rows

    def hashed_rows(self, program: Program, feed: Mapping[str, Any]) -> dict[str, SparseTable]:
        """For each hashed table of the job `program` reads, a local table holding the rows of
        the fed ids (asked of the pservers): evaluating costs the batch, never the table."""
        d = self.deployment
        ids_of: dict[str, list[str]] = {}
        for op in program.global_block().ops:
            if op.type == "lookup_sparse_table":
                ids_of.setdefault(op.input("W")[0], []).append(op.input("Ids")[0])
        tables = {}
        for table, names in ids_of.items():
            shards = d.plan.slices_of(table) if d is not None else []
            if not shards:
                continue
            unfed = [n for n in names if n not in feed]
            if unfed:
                raise UnsupportedError(
                    f"hashed table {table!r} lives on the pservers: its ids {unfed} must be fed to run this "
                    "program outside a training step"
                )
            ids = np.unique(np.concatenate([np.asarray(feed[n], dtype=np.int64).reshape(-1) for n in names]))
            ids = ids[ids >= 0]  # negative ids fail in the lookup, naming the table
            dim, dtype = shards[0].shape[1], np.dtype(to_numpy_dtype(shards[0].dtype)).name
            local = SparseTable(table, TableSettings(dim=dim, dtype=dtype), capacity=max(16, 2 * len(ids)))
            local.rows.add(ids, self.table_rows(table, ids))
            tables[table] = local
        return tables

    def gather(self, names: Iterable[str]) -> dict[str, Value]:
        """The values of `names` the job holds (names it does not hold are left out)."""
        names = list(dict.fromkeys(names))
        if self.pipeline is not None:
            return self.pipeline.gather(names)
        d = self.deployment
        if d is None:
            return {n: v for n in names if (v := self.staging.find(n)) is not None}
        wanted = [n for n in names if n not in self._cache]
        hashed = [n for n in wanted if any(s.hashed for s in d.plan.slices_of(n))]
        if hashed:
            raise ExecutionError(
                f"hashed table {hashed[0]!r} lives on the pservers and is never gathered whole: read rows with "
                f"exe.scope.table_rows({hashed[0]!r}, ids), or export it with `fluidps checkpoint merge`"
            )
        if wanted:
            self._cache.update(self._fetch(d, wanted))
        return {n: self._cache[n] for n in names if n in self._cache}

    def _fetch(self, d: Deployment, names: list[str]) -> dict[str, Value]:
        per_pserver: dict[str, list[str]] = defaultdict(list)
        from_trainer: list[str] = []
        for name in names:
            placed = d.plan.placement_of(name)
            if not placed:
                from_trainer.append(name)
            elif placed[0].offset is None:
                per_pserver[placed[0].endpoint].append(placed[0].remote)
            else:
                for p in placed:
                    per_pserver[p.endpoint].append(p.remote)
        pending: dict[Any, tuple[Any, int]] = {
            ep: (d.pservers[ep], d.pservers[ep].request(Message(Kind.GET, names=remote)))
            for ep, remote in per_pserver.items()
        }
        held = [n for n in from_trainer if n in d.trainer_persistables]
        if held:
            pending["trainer"] = (d.trainers[0], d.trainers[0].request(Message(Kind.GET, names=held)))
        replies = wait_all(pending)
        out: dict[str, Value] = {n: replies["trainer"].tensors[n] for n in held}
        for name in names:
            placed = d.plan.placement_of(name)
            if not placed:
                continue
            if placed[0].offset is None:
                out[name] = replies[placed[0].endpoint].tensors[placed[0].remote]
            else:
                pieces = sorted(placed, key=lambda p: p.offset)
                out[name] = np.concatenate([replies[p.endpoint].tensors[p.remote] for p in pieces])
        return out

    def scatter(self, values: dict[str, Value], trainers_pull: bool = True) -> None:
        """Write values into the job: their slices to the pservers (the trainers holding a
        copy pull it before their next step; `trainers_pull=False`: they are about to pull
        everything anyway), what only trainers hold to every trainer."""
        if self.pipeline is not None:
            self.pipeline.scatter(values)
            return
        d = self.deployment
        if d is None:
            for name, value in values.items():
                self.staging[name] = value
            return
        per_pserver: dict[str, dict[str, Value]] = defaultdict(dict)
        to_trainers: dict[str, Value] = {}
        stale: list[str] = []  # trainers' copies of what the pservers now hold anew
        for name, value in values.items():
            placed = d.plan.placement_of(name)
            if not placed and name not in d.trainer_persistables:
                raise ExecutionError(
                    f"cannot set {name!r}: it is not a persistable variable of the job's training program"
                )
            for p in placed:
                if p.offset is None:
                    per_pserver[p.endpoint][p.remote] = value
                else:
                    total = sum(q.rows for q in placed if q.offset is not None)
                    if not isinstance(value, np.ndarray) or value.ndim == 0 or value.shape[0] != total:
                        raise ExecutionError(
                            f"cannot set {name!r}: its slices hold {total} rows, "
                            f"the value has shape {list(np.shape(value))}"
                        )
                    per_pserver[p.endpoint][p.remote] = np.ascontiguousarray(
                        value[p.offset : p.offset + p.rows]
                    )
            if name in d.trainer_persistables:
                if placed:
                    stale += [name] if trainers_pull else []
                else:
                    to_trainers[name] = value
        pending: dict[Any, tuple[Any, int]] = {
            ep: (d.pservers[ep], d.pservers[ep].request(Message(Kind.SET, tensors=tensors)))
            for ep, tensors in per_pserver.items()
        }
        if to_trainers or stale:
            for i, trainer in enumerate(d.trainers):
                message = Message(Kind.SET, tensors=to_trainers, names=stale)
                pending[i] = (trainer, trainer.request(message))
        self._cache.clear()
        wait_all(pending)

    def __repr__(self) -> str:
        where = "in the job" if self.deployment is not None else "in the client, not deployed yet"
        return f"RemoteScope({where})"
