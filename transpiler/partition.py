"""Pipeline stages chosen by a cost model: which forward ops each stage runs.

    placement = place_pipeline(main, num_stages=2, micro_batches=8, cost=CostModel.load(), rows=256)
    print(placement.summary())

The units are the forward ops of block 0 with what goes with each (its grad ops, the
updates of the parameters it reads first: fluidps.transpiler.stage_costs). A stage's
time per micro-batch is its compute plus its own work on the messages it sends and
receives; the messages' time on the way delays the first micro-batch only. The
predicted step is

    sum of the stage times + the waits + (m - 1) x the slowest stage

(the first micro-batch crosses every stage, the other m - 1 follow at the slowest's
pace). Two searches, and the faster prediction wins:

- `best_cuts`, exact over cuts of the program order (a stage holds a run of ops): for a
  bound B on the slowest stage, a dynamic program over the cut points finds the least
  sum; the least sum only changes at the stage times themselves, so a walk down from
  the unbounded optimum visits each change once and stops when no smaller bound can win
  (with a wait factor, which counts the other stages slower against the slowest, the
  cuts it visited are counted with it: within (f - 1)(p - 1) / 4m of the optimum);
- list scheduling over the graph (fluidps.transpiler.graph_placement), for programs
  whose branches a cut of the program order would split badly.

Ops a device_guard placed keep their stage; a memory cap bounds each stage's
parameters, optimizer state and the activations its schedule keeps. Everything here
reads the program and never changes it.
"""

from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass

import numpy as np

from fluidps.errors import UnsupportedError
from fluidps.ir.devices import PipelineConfig, stage_device
from fluidps.ir.program import Program
from fluidps.ir.stages import EVERY_STAGE, assign_stages, explicit_stage, phase
from fluidps.ir.types import OP_DEVICE_ATTR
from fluidps.transpiler.cost_model import CostModel, CostModelWarning
from fluidps.transpiler.graph_placement import list_schedule
from fluidps.transpiler.stage_costs import (
    evaluate,
    in_flight,
    stages_of_cuts,
    step_seconds,
    unit_of_ops,
    units_of,
    waiting_slowdown,
)

_INF = float("inf")


# -- the exact search ----------------------------------------------------------------------


def best_cuts(
    times: np.ndarray,
    num_stages: int,
    micro_batches: int,
    allowed: np.ndarray | None = None,
    fill: np.ndarray | None = None,
    wait_factor: float = 1.0,
    slowed: np.ndarray | None = None,
) -> tuple[tuple[int, ...], float] | None:
    """The cut points 0 = c0 < c1 < ... < cp = n minimizing step_seconds, where stage k
    holds units c_k .. c_{k+1} - 1, takes times[c_k, c_{k+1}] per micro-batch and adds
    fill[c_k, c_{k+1}] (default 0) to the first micro-batch's way through, and
    `allowed[k, i, j]` says whether stage k may hold units i .. j - 1 (default: all).
    With a wait_factor f, each stage of time t counts t + x * (f - 1) * (1 - t / T) next
    to a slowest stage of T, where x = slowed[c_k, c_{k+1}] is the part of t that waiting
    slows (its ops: default all of t; as fluidps.transpiler.stage_costs.evaluate counts
    it), and the cuts are within (f - 1)(p - 1) / 4m of the optimum (exact at f = 1).
    Returns (cuts, predicted step), or None when no cuts are allowed."""
    n = times.shape[0] - 1
    p = num_stages
    if n < p:
        return None
    pair = np.triu(np.ones((n + 1, n + 1), dtype=bool), 1)
    masks = [pair & (allowed[k] if allowed is not None else True) for k in range(p)]
    with_fill = times if fill is None else times + fill
    # Transposed, [j, i]: the least sum over where a stage starts is a reduction along rows.
    stage_times = [np.ascontiguousarray(np.where(mask, times, _INF).T) for mask in masks]
    stage_sums = [np.ascontiguousarray(np.where(mask, with_fill, _INF).T) for mask in masks]

    def least_sum(bound: float) -> tuple[float, tuple[int, ...]] | None:
        """The least sum of stage times and fills with every stage's time <= bound, and its cuts."""

        def under(k: int, rows: slice) -> np.ndarray:
            sums = stage_sums[k][rows]
            return sums if bound == _INF else np.where(stage_times[k][rows] <= bound, sums, _INF)

        g = under(0, slice(None))[:, 0]  # the first stage starts at unit 0
        back = [np.zeros(n + 1, dtype=np.int64)]
        for k in range(1, p):
            last = k == p - 1  # (the last stage ends at unit n: one row is enough)
            rows = under(k, slice(n, None) if last else slice(None))
            total = rows + g[None, :]
            choice = np.argmin(total, axis=1)
            g = total[np.arange(len(rows)), choice]
            back.append(np.full(n + 1, choice[0]) if last else choice)
        if not np.isfinite(g[-1]):
            return None
        cuts = [n]
        for k in reversed(range(p)):
            cuts.append(int(back[k][cuts[-1]]))
        return float(g[-1]), tuple(reversed(cuts))

    def least_slowest() -> float:
        """The smallest bound any cuts meet (a min-max program over the same stages)."""
        h = stage_times[0][:, 0].copy()
        for k in range(1, p):
            h = np.min(np.maximum(stage_times[k], h[None, :]), axis=1)
        return float(h[n])

    def slowest(cuts: tuple[int, ...]) -> float:
        return max(float(times[a, b]) for a, b in itertools.pairwise(cuts))

    unbounded = least_sum(_INF)
    if unbounded is None:
        return None
    total, cuts = unbounded
    best = (total + (micro_batches - 1) * slowest(cuts), cuts)
    visited = [cuts]  # every bound's least-sum cuts
    if micro_batches > 1:
        candidates = np.unique(np.concatenate([t[np.isfinite(t)] for t in stage_times]))
        floor = least_slowest()
        ceiling = slowest(cuts)
        while True:
            below = candidates[candidates < ceiling]
            if len(below) == 0 or below[-1] < floor:
                break
            found = least_sum(float(below[-1]))
            if found is None:
                break
            total, cuts = found
            if total + (micro_batches - 1) * floor >= best[0]:
                break  # a smaller bound only raises the sum: none can win
            visited.append(cuts)
            ceiling = slowest(cuts)
            step = total + (micro_batches - 1) * ceiling
            if step < best[0]:
                best = (step, cuts)
    if wait_factor == 1.0:
        return best[1], best[0]
    # The waiting stages' extra (MachineModel.wait_factor) is counted on the cuts the walk
    # visited, the plain optimum among them: its extra is at most (f - 1) / 4 of the
    # slowest stage for each other stage (x (1 - t / T) <= t (1 - t / T) <= T / 4), and
    # the step is at least m times the slowest, so what this returns is within
    # (f - 1)(p - 1) / 4m of the optimum counted with it.
    slowed = times if slowed is None else slowed
    return min(
        ((c, _counted_step(times, fill, c, micro_batches, wait_factor, slowed)) for c in visited),
        key=lambda x: x[1],
    )


def _counted_step(
    times: np.ndarray,
    fill: np.ndarray | None,
    cuts: tuple[int, ...],
    micro_batches: int,
    factor: float,
    slowed: np.ndarray,
) -> float:
    """step_seconds of these cuts, each stage counted next to the slowest as evaluate counts it."""
    pairs = list(itertools.pairwise(cuts))
    stage = [float(times[a, b]) for a, b in pairs]
    ops = [float(slowed[a, b]) for a, b in pairs]
    counted = [t + x * (s - 1) for t, x, s in zip(stage, ops, waiting_slowdown(stage, factor), strict=True)]
    fills = 0.0 if fill is None else sum(float(fill[a, b]) for a, b in itertools.pairwise(cuts))
    return step_seconds(counted, micro_batches, fills)


# -- a program's units and what each costs ---------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where each forward op runs and what the model predicts for each stage (per
    micro-batch seconds; bytes a stage keeps). `method`: "cuts" (stage k holds a run of
    ops in program order) or "list" (list scheduling: a stage's ops need not be next to
    each other, as the two towers of a model)."""

    num_stages: int
    micro_batches: int
    schedule_mode: str
    rows: int  # of a mini-batch
    forward_ops: tuple[int, ...]  # block-0 indices of the units, in order
    unit_stages: tuple[int, ...]  # the stage of each unit
    method: str
    compute_s: tuple[float, ...]  # its ops, and running its programs
    message_s: tuple[float, ...]  # its own work on the messages it sends and receives
    wait_s: tuple[float, ...]  # its received messages' time on their way (the pipeline's fill)
    memory_bytes: tuple[int, ...]
    predicted_step_s: float
    op_types: tuple[str, ...]  # of the units

    @property
    def stage_s(self) -> tuple[float, ...]:
        """Each stage's time per micro-batch, as the step's formula counts it."""
        return tuple(c + m for c, m in zip(self.compute_s, self.message_s, strict=True))

    def stage_of_unit(self, unit: int) -> int:
        return self.unit_stages[unit]

    def ops_of(self, stage: int) -> list[int]:
        """The block-0 indices of the forward ops stage `stage` runs."""
        return [op for op, k in zip(self.forward_ops, self.unit_stages, strict=True) if k == stage]

    def op_stages(self) -> dict[int, int]:
        """Block-0 op index -> stage, for the forward ops."""
        return dict(zip(self.forward_ops, self.unit_stages, strict=True))

    def summary(self) -> str:
        m = self.micro_batches
        how = "cuts in program order" if self.method == "cuts" else "list scheduling"
        lines = [
            f"placement: {self.num_stages} stages, {m} micro-batches of {self.rows // m} rows, "
            f"{self.schedule_mode}, by {how}; predicted step {self.predicted_step_s * 1e3:.3f} ms",
            f"{'stage':>5}  {'ops':>9}  {'compute ms':>10}  {'messages ms':>11}  {'waits ms':>8}  "
            f"{'memory MB':>9}  first .. last op",
        ]
        for k in range(self.num_stages):
            ops = self.ops_of(k)
            span = (
                f"{ops[0]}..{ops[-1]}" if ops == list(range(ops[0], ops[0] + len(ops))) else f"{len(ops)} ops"
            )
            first, last = (self.op_types[self.forward_ops.index(i)] for i in (ops[0], ops[-1]))
            lines.append(
                f"{k:>5}  {span:>9}  {self.compute_s[k] * 1e3:>10.3f}  {self.message_s[k] * 1e3:>11.3f}  "
                f"{self.wait_s[k] * 1e3:>8.3f}  {self.memory_bytes[k] / 2**20:>9.2f}  {first} .. {last}"
            )
        lines.append(
            "(per micro-batch: compute and messages are the stage's own work, its updates spread over"
        )
        lines.append(
            " the step; waits delay the first micro-batch only. step = stages + waits + (m - 1) x slowest)"
        )
        return "\n".join(lines)


def place_pipeline(
    program: Program,
    num_stages: int,
    micro_batches: int,
    cost: CostModel,
    rows: int,
    schedule_mode: str = "1F1B",
    memory_cap: int | None = None,
) -> Placement:
    """The placement of `program`'s forward ops on `num_stages` stages that minimizes the
    predicted step of a mini-batch of `rows` rows in `micro_batches` micro-batches
    (ops with an op_device stay on their stage). UnsupportedError says why there is none."""
    if rows < micro_batches or rows % micro_batches:
        raise UnsupportedError(
            f"a mini-batch of {rows} rows cannot be cut into {micro_batches} equal micro-batches: "
            "give a batch size that is a multiple of the micro-batch count"
        )
    micro_rows = rows // micro_batches
    _check_coverage(program, cost, micro_rows)
    units = units_of(program, cost, micro_rows, micro_batches)
    n, p = len(units.ops), num_stages
    if n < p:
        raise UnsupportedError(
            f"{p} pipeline stages need at least {p} forward ops, and the program has {n}: use fewer stages"
        )
    prefix = np.concatenate([[0.0], np.cumsum(units.compute)])
    ops = prefix[None, :] - prefix[:, None]
    times = ops + units.run_s + units.messages
    params = np.concatenate([[0.0], np.cumsum(units.param_bytes)])
    stash = np.concatenate([[0.0], np.cumsum(units.stash_bytes)])
    boundary = units.cut_ok[:, None] & units.cut_ok[None, :]
    allowed = np.zeros((p, n + 1, n + 1), dtype=bool)
    memory = np.zeros((p, n + 1, n + 1))
    pinned = np.array([-1 if s is None else s for s in units.pins])
    for k in range(p):
        other = np.concatenate([[0], np.cumsum((pinned >= 0) & (pinned != k))])
        clean = (other[None, :] - other[:, None]) == 0
        memory[k] = (params[None, :] - params[:, None]) + in_flight(schedule_mode, k, p, micro_batches) * (
            stash[None, :] - stash[:, None]
        )
        allowed[k] = boundary & clean
    if (too_far := int(pinned.max(initial=-1))) >= p:
        raise UnsupportedError(
            f"op #{units.ops[int(np.argmax(pinned))]} is placed on stage {too_far}, but the pipeline has {p} stages"
        )
    uncapped = allowed.copy()
    if memory_cap is not None:
        allowed &= memory <= memory_cap
    found = best_cuts(times, p, micro_batches, allowed, units.waits, units.wait_factor, ops)
    candidates = []  # (method, stage of each unit)
    if found is not None:
        candidates.append(("cuts", stages_of_cuts(found[0])))
    listed = list_schedule(units, p, micro_batches, schedule_mode, memory_cap)
    if listed is not None:
        candidates.append(("list", listed))
    if not candidates:
        fastest = (
            best_cuts(times, p, micro_batches, uncapped, units.waits, units.wait_factor, ops)
            if memory_cap is not None
            else None
        )
        if fastest is not None:
            keeps = max(
                evaluate(units, stages_of_cuts(fastest[0]), p, micro_batches, schedule_mode).memory_bytes
            )
            raise UnsupportedError(
                f"no placement on {p} stages keeps every stage under the memory cap of {memory_cap:,} bytes "
                f"(the fastest placement's largest stage keeps {keeps:,}): raise the cap, add stages, or keep "
                "fewer micro-batches in flight (schedule 1F1B)"
            )
        raise UnsupportedError(
            f"no placement of the program's {n} forward ops on {p} stages keeps its device_guards in order "
            "and cuts only between ops that write different variables: check the guards' stage order"
        )
    scored = [
        (evaluate(units, stages, p, micro_batches, schedule_mode), method, stages)
        for method, stages in candidates
    ]
    costs, method, stages = min(scored, key=lambda c: c[0].step_s)  # (ties: the cuts, listed first)
    block = program.global_block()
    return Placement(
        num_stages=p,
        micro_batches=micro_batches,
        schedule_mode=schedule_mode,
        rows=rows,
        forward_ops=units.ops,
        unit_stages=tuple(stages),
        method=method,
        compute_s=costs.compute_s,
        message_s=costs.message_s,
        wait_s=costs.wait_s,
        memory_bytes=costs.memory_bytes,
        predicted_step_s=costs.step_s,
        op_types=tuple(block.ops[i].type for i in units.ops),
    )


def _check_coverage(program: Program, cost: CostModel, rows: int) -> None:
    """A CostModelWarning when the model's op profile lacks some of the program's ops."""
    if cost.profile is None:
        return
    block = program.global_block()
    missing = [op.type for op in block.ops if cost.measured(block, op, rows) is None]
    if missing:
        which = "none" if len(missing) == len(block.ops) else f"{len(block.ops) - len(missing)}"
        warnings.warn(
            f"the op profile holds {which} of the program's {len(block.ops)} ops at {rows} rows a micro-batch "
            f"(measured for another program or batch size): analytic times for {len(missing)} ops "
            f"({', '.join(sorted(set(missing))[:6])}{', ...' if len(set(missing)) > 6 else ''}); "
            "measure this program with `fluidps place --measure`",
            CostModelWarning,
            stacklevel=3,
        )


def write_stages(program: Program, placement: Placement) -> None:
    """Write each placed forward op's stage, and its grad ops', into their op_device (ops
    that have one keep it; the rest follow fluidps.ir.stages' rules). A builder's step:
    PipelineOptimizer.minimize calls it on the program it builds; `placed` on a copy."""
    block = program.global_block()
    _, unit_of = unit_of_ops(block)
    for index, (op, unit) in enumerate(zip(block.ops, unit_of, strict=True)):
        if unit is not None and explicit_stage(op, index) is None and phase(op) != "optimize":
            op.set_attr(OP_DEVICE_ATTR, stage_device(placement.stage_of_unit(unit)))


def placed(program: Program, placement: Placement) -> Program:
    """A copy of training program `program` with the stage of every op in its op_device
    and the pipeline's configuration (`program` is not changed)."""
    out = program.clone()
    write_stages(out, placement)
    complete_stages(out, placement.num_stages)
    out.pipeline = PipelineConfig(placement.micro_batches, placement.schedule_mode, placement.num_stages)
    return out


def complete_stages(program: Program, num_stages: int | None = None) -> int:
    """Give every op of `program` without a stage the one fluidps.ir.stages assigns it
    (learning-rate schedule ops keep none: they run on every stage); returns how many
    stages there are (`num_stages`, or as many as the program names). A builder's step,
    as write_stages."""
    block = program.global_block()
    stages = assign_stages(program, num_stages)
    for index, (op, stage) in enumerate(zip(block.ops, stages.op_stages, strict=True)):
        if stage != EVERY_STAGE and explicit_stage(op, index) is None:
            op.set_attr(OP_DEVICE_ATTR, stage_device(stage))
    return stages.num_stages
