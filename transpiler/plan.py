"""DistributedPlan: everything the transpiler produced, read-only.

It holds the trainer's programs, each pserver's programs and the placement
table: which slice of which parameter lives on which pserver, at which row
offset. The transpiler's getters hand out copies of the programs, so the
plan itself never changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fluidps.ir.program import Program
from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.transpiler.config import DistributeTranspilerConfig


@dataclass(frozen=True)
class Slice:
    """One block of a parameter: rows [offset, offset + rows) of `param`."""

    param: str
    name: str  # the slice's variable: `w.block0`, or `w` when the parameter is whole
    grad: str  # the gradient block the trainer sends: `w@GRAD.block0` (or `w@GRAD`)
    block_id: int
    offset: int
    shape: tuple[int, ...]
    dtype: VarType
    endpoint: str
    sparse: bool  # its gradient is a SelectedRows
    distributed: bool = False  # a block of a distributed table: prefetched by rows, never received whole
    hashed: bool = (
        False  # a shard of a hashed table: ids i with mix64(i) mod shards == block_id; shape [-1, dim]
    )
    load_s: float = 0.0  # predicted seconds it costs its pserver a trainer's step (pserver_cost)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Bytes at the start (a hashed shard starts empty and grows with its ids)."""
        if self.hashed:
            return 0
        return math.prod(self.shape) * to_numpy_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Placement:
    """Where (part of) a variable of the original program lives on a pserver:
    rows [offset, offset + rows) when it was cut with its parameter, the whole
    value (offset None) otherwise; whole copies may sit on several pservers."""

    var: str
    remote: str
    endpoint: str
    offset: int | None
    rows: int | None


@dataclass(frozen=True)
class DistributedPlan:
    config: DistributeTranspilerConfig
    trainer_id: int
    trainers: int
    endpoints: tuple[str, ...]
    trainer_program: Program
    trainer_startup: Program
    pserver_programs: Mapping[str, Program]
    pserver_startups: Mapping[str, Program]
    slices: tuple[Slice, ...]
    notes: tuple[str, ...] = field(default=())
    placements: tuple[Placement, ...] = field(default=())

    def __post_init__(self) -> None:
        object.__setattr__(self, "pserver_programs", MappingProxyType(dict(self.pserver_programs)))
        object.__setattr__(self, "pserver_startups", MappingProxyType(dict(self.pserver_startups)))

    def slices_on(self, endpoint: str) -> list[Slice]:
        return [s for s in self.slices if s.endpoint == endpoint]

    def slices_of(self, param: str) -> list[Slice]:
        return [s for s in self.slices if s.param == param]

    def placement_of(self, var: str) -> list[Placement]:
        """Where a persistable variable of the original program lives ([] for trainer-side ones)."""
        return [p for p in self.placements if p.var == var]

    def distributed_tables(self) -> list[str]:
        """The tables that stay on the pservers (trainers prefetch their rows)."""
        return list(dict.fromkeys(s.param for s in self.slices if s.distributed))

    def bytes_per_pserver(self) -> dict[str, int]:
        return {ep: sum(s.nbytes for s in self.slices_on(ep)) for ep in self.endpoints}

    def loads(self) -> dict[str, float]:
        """Each pserver's predicted seconds a trainer's step (its blocks' updates and
        messages, fluidps.transpiler.pserver_cost): what split_method="Cost" balances."""
        return {ep: sum(s.load_s for s in self.slices_on(ep)) for ep in self.endpoints}

    def summary(self) -> str:
        """A readable placement table: per pserver, its slices, bytes and share."""
        per = self.bytes_per_pserver()
        total = sum(per.values()) or 1
        lines = [
            f"mode {self.config.mode}, {self.trainers} trainer(s), {len(self.endpoints)} pserver(s), "
            f"{len(self.slices)} slice(s) of {len({s.param for s in self.slices})} parameter(s), "
            f"{total:,} bytes"
        ]
        loads = self.loads()
        for i, ep in enumerate(self.endpoints):
            lines.append(
                f"pserver {i} {ep}: {per[ep]:,} bytes ({100 * per[ep] / total:.1f}%), "
                f"predicted {loads[ep] * 1e3:.3f} ms a step"
            )
            for s in self.slices_on(ep):
                if s.hashed:
                    lines.append(
                        f"  {s.name:<28} shard {s.block_id} of hashed table {s.param} [-1, {s.shape[1]}], "
                        "grows with its ids"
                    )
                    continue
                kind = " distributed table" if s.distributed else " sparse" if s.sparse else ""
                lines.append(
                    f"  {s.name:<28} rows {s.offset}..{s.offset + s.rows - 1} of {s.param}{kind} "
                    f"{list(s.shape)} {s.nbytes:,} bytes"
                )
        for table in self.distributed_tables():
            blocks = self.slices_of(table)
            if blocks[0].hashed:
                lines.append(
                    f"hashed table {table}: rows created by id in {len(blocks)} shard(s); id i lives on pserver "
                    f"mix64(i) mod {len(blocks)}; trainers prefetch the rows of each batch"
                )
                continue
            lines.append(
                f"distributed table {table}: {sum(s.rows for s in blocks):,} rows in {len(blocks)} block(s); "
                "id i lives on the pserver whose block holds row i; trainers prefetch the rows of each batch"
            )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        per = self.bytes_per_pserver()
        return {
            "mode": self.config.mode,
            "trainers": self.trainers,
            "endpoints": list(self.endpoints),
            "bytes_per_pserver": per,
            "predicted_ms_per_pserver": {ep: round(t * 1e3, 6) for ep, t in self.loads().items()},
            "slices": [
                {
                    "param": s.param,
                    "name": s.name,
                    "grad": s.grad,
                    "block_id": s.block_id,
                    "offset": s.offset,
                    "shape": list(s.shape),
                    "endpoint": s.endpoint,
                    "bytes": s.nbytes,
                    "sparse": s.sparse,
                    "distributed": s.distributed,
                    "hashed": s.hashed,
                    "predicted_ms": round(s.load_s * 1e3, 6),
                }
                for s in self.slices
            ],
            "distributed_tables": self.distributed_tables(),
            "hashed_tables": [t for t in self.distributed_tables() if self.slices_of(t)[0].hashed],
            "notes": list(self.notes),
        }
