"""PipelinePlan: what PipelineTranspiler made, read-only.

One StagePlan per stage: its section program (the ops of the stage, in order:
forward, backward, optimize, with the send_v2 / recv_v2 of every value that
crosses stages), that program's three phases as programs of their own (what
runs once per micro-batch forward, once per micro-batch backward, and once per
mini-batch), and what a schedule needs to know: which data variables it reads,
which values a micro-batch's forward keeps for its backward. The schedules are
data too (`schedule`): a list of ("F", k) and ("B", k) actions per stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fluidps.ir.devices import PipelineConfig
from fluidps.ir.program import Program
from fluidps.ir.types import MERGED_SUFFIX, to_numpy_dtype

FORWARD, BACKWARD = "F", "B"
Action = tuple[str, int]  # (FORWARD or BACKWARD, micro-batch)


@dataclass(frozen=True)
class Crossing:
    """Variable `var` goes from stage `src` to stage `dst` once a micro-batch, in the
    forward phase (an activation) or the backward one (a gradient); or once a step, in
    the optimize phase (a parameter several stages read, from the one that updates it)."""

    var: str
    src: int
    dst: int
    phase: str  # "forward", "backward" or "optimize"
    shape: tuple[int, ...]  # as declared; -1: the micro-batch's rows
    dtype_size: int

    def nbytes(self, rows: int) -> int:
        return self.dtype_size * math.prod(rows if d == -1 else d for d in self.shape)


@dataclass(frozen=True)
class StagePlan:
    stage: int
    program: Program  # the section program: every op of the stage, in order
    forward: Program
    backward: Program
    optimize: Program
    params: tuple[str, ...]  # the parameters it updates (and owns)
    param_bytes: int
    feeds: tuple[str, ...]  # data variables its forward reads
    stash: tuple[str, ...]  # what a micro-batch's forward keeps for its backward
    accumulators: tuple[
        tuple[str, tuple[int, ...], str], ...
    ]  # (name, shape, numpy dtype), zeroed at the start
    made: frozenset[str]  # non-persistable variables its forward makes (fetchable per micro-batch)
    ops: int  # compute ops (send_v2 / recv_v2 not counted)


@dataclass(frozen=True)
class PipelinePlan:
    config: PipelineConfig
    stages: tuple[StagePlan, ...]
    crossings: tuple[Crossing, ...]
    placement: tuple[
        tuple[str, int], ...
    ] = ()  # per op of the input's block 0: (type, stage; -1: every stage)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def holds(self, stage: int) -> frozenset[str]:
        """The persistable variables stage `stage` holds: its parameters, a weight it reads
        that another stage updates, its learning rate, ... (not its gradient sums)."""
        block = self.stages[stage].program.global_block()
        return frozenset(n for n, v in block.vars.items() if v.persistable and not n.endswith(MERGED_SUFFIX))

    def holders(self, name: str) -> tuple[int, ...]:
        """The stages that hold persistable variable `name` (a weight several stages read: each)."""
        return tuple(s.stage for s in self.stages if name in self.holds(s.stage))

    def owner(self, name: str) -> int | None:
        """The stage to fetch `name` from: the one whose forward makes it, else the first
        that holds it (None: no stage has it)."""
        for stage in self.stages:
            if name in stage.made:
                return stage.stage
        return next(iter(self.holders(name)), None)

    def receives(self, stage: int, phase: str) -> tuple[Crossing, ...]:
        return tuple(c for c in self.crossings if c.dst == stage and c.phase == phase)

    def schedule(self, stage: int) -> tuple[Action, ...]:
        """Stage `stage`'s actions for one mini-batch, in order (then its optimize phase)."""
        return schedule(self.config.schedule_mode, stage, self.num_stages, self.config.num_microbatches)

    def summary(self, batch_rows: int | None = None) -> str:
        """A table of the stages: ops, parameter bytes, and bytes each sends per
        micro-batch (per micro-batch row when `batch_rows`, the mini-batch's, is not given)."""
        m = self.config.num_microbatches
        rows = batch_rows // m if batch_rows else 1
        unit = "bytes sent per micro-batch" if batch_rows else "bytes sent per micro-batch row"
        lines = [
            f"pipeline: {self.num_stages} stages, {m} micro-batches, schedule {self.config.schedule_mode}",
            f"{'stage':>5}  {'ops':>5}  {'params':>6}  {'param bytes':>12}  {unit}",
        ]
        for s in self.stages:
            sent = sum(c.nbytes(rows) for c in self.crossings if c.src == s.stage and c.phase != "optimize")
            lines.append(f"{s.stage:>5}  {s.ops:>5}  {len(s.params):>6}  {s.param_bytes:>12,}  {sent:,}")
        for c in self.crossings:
            lines.append(f"  {c.phase:>8}: {c.var} stage {c.src} -> {c.dst} {list(c.shape)}")
        return "\n".join(lines)


def placement_table(plan: PipelinePlan) -> str:
    """Each op of the input program and the stage it runs on."""
    lines = [f"{'op':>5}  {'stage':>5}  type"]
    for i, (op_type, stage) in enumerate(plan.placement):
        lines.append(f"{i:>5}  {'every' if stage < 0 else stage:>5}  {op_type}")
    return "\n".join(lines)


def plan_to_dict(plan: PipelinePlan) -> dict:
    """The plan as JSON-ready data (programs left out)."""
    return {
        "num_stages": plan.num_stages,
        "num_microbatches": plan.config.num_microbatches,
        "schedule_mode": plan.config.schedule_mode,
        "stages": [
            {
                "stage": s.stage,
                "ops": s.ops,
                "params": list(s.params),
                "param_bytes": s.param_bytes,
                "feeds": list(s.feeds),
                "schedule": [f"{kind}{k}" for kind, k in plan.schedule(s.stage)],
            }
            for s in plan.stages
        ],
        "crossings": [
            {"var": c.var, "from": c.src, "to": c.dst, "phase": c.phase, "shape": list(c.shape)}
            for c in plan.crossings
        ],
        "placement": [{"op": i, "type": t, "stage": s} for i, (t, s) in enumerate(plan.placement)],
    }


def schedule(mode: str, stage: int, num_stages: int, micro_batches: int) -> tuple[Action, ...]:
    """F-then-B: every forward, then every backward. 1F1B: as many forwards as the
    stages after this one need to fill up (num_stages - stage - 1), then one
    backward after each forward, then the backwards left; a stage holds at most
    num_stages - stage micro-batches' activations (m, when fewer)."""
    m = micro_batches
    if mode == "F-then-B":
        return tuple((FORWARD, k) for k in range(m)) + tuple((BACKWARD, k) for k in range(m))
    warmup = min(num_stages - stage - 1, m)
    actions: list[Action] = [(FORWARD, k) for k in range(warmup)]
    for k in range(warmup, m):
        actions += [(FORWARD, k), (BACKWARD, k - warmup)]
    actions += [(BACKWARD, k) for k in range(m - warmup, m)]
    return tuple(actions)


def dtype_size(dtype) -> int:
    return to_numpy_dtype(dtype).itemsize
