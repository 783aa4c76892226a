"""Pipeline cuts chosen by a cost model: which forward ops each stage runs.

    placement = place_pipeline(main, num_stages=2, micro_batches=8, cost=CostModel.load(), rows=256)
    print(placement.summary())

The units are the forward ops of block 0 in program order (a topological order of the
forward graph); a stage holds a contiguous run of them, with the backward ops of each
(a grad op goes with the forward op whose output's gradient it reads) and the updates
of the parameters it reads first. A stage's time per micro-batch is its compute plus
the messages it sends and receives (alpha + beta * bytes for each value that crosses a
cut, forward and, where it has one, its gradient back), plus its updates spread over
the m micro-batches. The predicted step is

    sum of the stage times + (m - 1) x the slowest stage

(the first micro-batch crosses every stage, the other m - 1 follow at the slowest's
pace). `best_cuts` minimizes it exactly: for a bound B on the slowest stage, a dynamic
program over the cut points finds the least sum; the least sum only changes at the
stage times themselves, so a walk down from the unbounded optimum visits each change
once and stops when no smaller bound can win.

Ops a device_guard placed keep their stage (the cuts go around them); a memory cap
bounds each stage's parameters, optimizer state and the activations its schedule
keeps. Everything here reads the program and never changes it.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fluidps.errors import UnsupportedError
from fluidps.ir.devices import PipelineConfig, stage_device
from fluidps.ir.program import Block, Program
from fluidps.ir.stages import EVERY_STAGE, assign_stages, explicit_stage, forward_name, phase
from fluidps.ir.types import (
    EMPTY_VAR_NAME,
    GRAD_SUFFIX,
    OP_DEVICE_ATTR,
    OP_ROLE_ATTR,
    OP_ROLE_VAR_ATTR,
    OpRole,
)
from fluidps.transpiler.cost_model import CostModel, CostModelWarning, var_bytes

_INF = float("inf")


# -- the exact search ----------------------------------------------------------------------


def step_seconds(stage_seconds: Sequence[float], micro_batches: int, fill_seconds: float = 0.0) -> float:
    """The predicted step of stages taking these seconds per micro-batch (and the
    first micro-batch's `fill_seconds` of waiting for messages on its way)."""
    return sum(stage_seconds) + fill_seconds + (micro_batches - 1) * max(stage_seconds)


def best_cuts(
    times: np.ndarray,
    num_stages: int,
    micro_batches: int,
    allowed: np.ndarray | None = None,
    fill: np.ndarray | None = None,
) -> tuple[tuple[int, ...], float] | None:
    """The cut points 0 = c0 < c1 < ... < cp = n minimizing step_seconds, where stage k
    holds units c_k .. c_{k+1} - 1, takes times[c_k, c_{k+1}] per micro-batch and adds
    fill[c_k, c_{k+1}] (default 0) to the first micro-batch's way through, and
    `allowed[k, i, j]` says whether stage k may hold units i .. j - 1 (default: all).
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
    if micro_batches == 1:
        return cuts, best[0]
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
        ceiling = slowest(cuts)
        step = total + (micro_batches - 1) * ceiling
        if step < best[0]:
            best = (step, cuts)
    return best[1], best[0]


# -- a program's units and what each costs ---------------------------------------------


@dataclass(frozen=True)
class Placement:
    """Where each forward op runs and what the model predicts for each stage (per
    micro-batch seconds; bytes a stage keeps)."""

    num_stages: int
    micro_batches: int
    schedule_mode: str
    rows: int  # of a mini-batch
    forward_ops: tuple[int, ...]  # block-0 indices of the units, in order
    cuts: tuple[int, ...]  # unit boundaries: stage k holds units cuts[k] .. cuts[k + 1] - 1
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
        return next(k for k in range(self.num_stages) if self.cuts[k] <= unit < self.cuts[k + 1])

    def op_stages(self) -> dict[int, int]:
        """Block-0 op index -> stage, for the forward ops."""
        return {op: self.stage_of_unit(u) for u, op in enumerate(self.forward_ops)}

    def summary(self) -> str:
        m = self.micro_batches
        lines = [
            f"placement: {self.num_stages} stages, {m} micro-batches of {self.rows // m} rows, "
            f"{self.schedule_mode}; predicted step {self.predicted_step_s * 1e3:.3f} ms",
            f"{'stage':>5}  {'ops':>9}  {'compute ms':>10}  {'messages ms':>11}  {'waits ms':>8}  "
            f"{'memory MB':>9}  first .. last op",
        ]
        for k in range(self.num_stages):
            a, b = self.cuts[k], self.cuts[k + 1]
            ops = f"{self.forward_ops[a]}..{self.forward_ops[b - 1]}"
            lines.append(
                f"{k:>5}  {ops:>9}  {self.compute_s[k] * 1e3:>10.3f}  {self.message_s[k] * 1e3:>11.3f}  "
                f"{self.wait_s[k] * 1e3:>8.3f}  {self.memory_bytes[k] / 2**20:>9.2f}  "
                f"{self.op_types[a]} .. {self.op_types[b - 1]}"
            )
        lines.append(
            "(per micro-batch: compute and messages are the stage's own work, its updates spread over"
        )
        lines.append(
            " the step; waits delay the first micro-batch only. step = stages + waits + (m - 1) x slowest)"
        )
        return "\n".join(lines)


@dataclass(frozen=True)
class _Units:
    ops: tuple[int, ...]  # block-0 op index of each unit
    compute: np.ndarray  # seconds per micro-batch
    param_bytes: np.ndarray  # parameters, their gradient sums and optimizer state, first read here
    stash_bytes: np.ndarray  # what one micro-batch's forward keeps for its backward
    messages: np.ndarray  # (n + 1, n + 1): a stage holding units i .. j - 1: its work on messages
    waits: np.ndarray  # (n + 1, n + 1): ... and its received messages' time on their way
    cut_ok: np.ndarray  # (n + 1,): may a stage start (or end) at this unit boundary
    pins: tuple[int | None, ...]  # the stage a device_guard gave each unit


def unit_of_ops(block: Block) -> tuple[tuple[int, ...], list[int | None]]:
    """The forward ops of `block` (the units), and for every op of it the unit it goes
    with: a forward op its own; a backward op the forward op that makes the variable
    whose gradient it reads (else writes); an update the first forward op that reads its
    parameter; None for what runs on every stage (learning-rate schedules)."""
    ops = list(block.ops)
    units = tuple(i for i, op in enumerate(ops) if phase(op) == "forward")
    unit_of: list[int | None] = [None] * len(ops)
    maker: dict[str, int] = {}
    first_reader: dict[str, int] = {}
    for u, i in enumerate(units):
        unit_of[i] = u
        for name in _names(ops[i].input_arg_names):
            first_reader.setdefault(name, u)
        for name in _names(ops[i].output_arg_names):
            maker.setdefault(name, u)
    for i, op in enumerate(ops):
        kind = phase(op)
        if kind == "backward":
            grads = [n for n in _names(op.input_arg_names) if GRAD_SUFFIX in n]
            bases = [forward_name(n) for n in grads or _names(op.output_arg_names)]
            made = [maker[b] for b in bases if b in maker]
            read = [first_reader[b] for b in bases if b in first_reader]  # a parameter's gradient parts
            unit_of[i] = max(made) if made else (min(read) if read else None)
        elif kind == "optimize" and not (op.attr(OP_ROLE_ATTR) & OpRole.LRSched):
            pairs = op.attr(OP_ROLE_VAR_ATTR) if op.has_attr(OP_ROLE_VAR_ATTR) else []
            unit_of[i] = first_reader.get(pairs[0]) if pairs else None
    return units, unit_of


def _names(names: Sequence[str]) -> list[str]:
    return [n for n in names if n != EMPTY_VAR_NAME]


def _units(program: Program, cost: CostModel, micro_rows: int, micro_batches: int) -> _Units:
    block = program.global_block()
    ops = list(block.ops)
    units, unit_of = unit_of_ops(block)
    n = len(units)
    persistable = {name for name, v in block.vars.items() if v.persistable}
    compute = np.zeros(n)
    param_bytes = np.zeros(n)
    stash = [dict[str, int]() for _ in range(n)]
    readers: dict[str, set[int]] = {}
    maker: dict[str, int] = {}
    for i, op in enumerate(ops):
        u = unit_of[i]
        if u is None:
            continue
        seconds = cost.op_seconds(block, op, micro_rows)
        kind = phase(op)
        if kind == "optimize":
            compute[u] += seconds / micro_batches
            param = op.input("Param")[0] if op.input("Param") else None
            if param is not None:
                state = [n for n in _names(op.input_arg_names) if n in persistable and n != param]
                grad = [n for n in op.input("Grad")]
                param_bytes[u] += sum(var_bytes(block, x, micro_rows) for x in {param, *state, *grad})
            continue
        compute[u] += seconds
        for name in _names(op.input_arg_names):
            if name in persistable:
                continue
            if name in maker and maker[name] != u:
                readers.setdefault(name, set()).add(u)
            if kind == "backward" and GRAD_SUFFIX not in name:
                stash[u][name] = var_bytes(block, name, micro_rows)
        if kind == "forward":
            for name in _names(op.output_arg_names):
                if name not in persistable:
                    maker.setdefault(name, u)
    messages, waits = _message_matrices(block, n, maker, readers, cost, micro_rows)
    cut_ok = np.ones(n + 1, dtype=bool)
    written: dict[str, list[int]] = {}
    for u, i in enumerate(units):
        for name in _names(ops[i].output_arg_names):
            if name not in persistable:
                written.setdefault(name, []).append(u)
    for us in written.values():  # a value written by several ops has one stage: no cut between them
        cut_ok[min(us) + 1 : max(us) + 1] = False
    pins = tuple(explicit_stage(ops[i], i) for i in units)
    stash_bytes = np.array([sum(s.values()) for s in stash], float)
    return _Units(units, compute, param_bytes, stash_bytes, messages, waits, cut_ok, pins)


def _message_matrices(
    block: Block, n: int, maker: dict[str, int], readers: dict[str, set[int]], cost: CostModel, rows: int
) -> tuple[np.ndarray, np.ndarray]:
    """For a stage holding units i .. j - 1, per micro-batch: the seconds its own work on
    messages takes (each value made before i that it reads, each it makes that a later
    stage reads, and each one's gradient the other way: encoding or decoding, copying),
    and the seconds its received messages spend on their way. Each built from
    rectangles in (i, j) on a difference array."""
    work, wait = np.zeros((n + 2, n + 2)), np.zeros((n + 2, n + 2))

    def add(
        diff: np.ndarray, i0: int, i1: int, j0: int, j1: int, value: float
    ) -> None:  # i in [i0, i1], j in [j0, j1]
        if i0 > i1 or j0 > j1 or value == 0:
            return
        diff[i0, j0] += value
        diff[i0, j1 + 1] -= value
        diff[i1 + 1, j0] -= value
        diff[i1 + 1, j1 + 1] += value

    for name, read in readers.items():
        a = maker[name]
        later = sorted(r for r in read if r > a)
        if not later:
            continue
        nbytes = var_bytes(block, name, rows)
        has_grad = block.find_var(name + GRAD_SUFFIX) is not None  # (its gradient comes back)
        each = (2 if has_grad else 1) * cost.message_cpu_seconds(nbytes)
        way = cost.message_seconds(nbytes)
        # made inside [i, j), read at or after j: sent (and its gradient received)
        add(work, 0, a, a + 1, later[-1], each)
        add(wait, 0, a, a + 1, later[-1], way if has_grad else 0.0)
        previous = a
        for r in later:  # made before i, read inside [i, j): received (and its gradient sent)
            add(work, previous + 1, r, r + 1, n, each)
            add(wait, previous + 1, r, r + 1, n, way)
            previous = r
    return tuple(np.cumsum(np.cumsum(d, axis=0), axis=1)[: n + 1, : n + 1] for d in (work, wait))


def in_flight(schedule_mode: str, stage: int, num_stages: int, micro_batches: int) -> int:
    """How many micro-batches' activations stage `stage` keeps at most (PipelinePlan.schedule)."""
    if schedule_mode == "F-then-B":
        return micro_batches
    return min(num_stages - stage, micro_batches)


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
    units = _units(program, cost, micro_rows, micro_batches)
    n, p = len(units.ops), num_stages
    if n < p:
        raise UnsupportedError(
            f"{p} pipeline stages need at least {p} forward ops, and the program has {n}: use fewer stages"
        )
    prefix = np.concatenate([[0.0], np.cumsum(units.compute)])
    # (a stage's own cost of each micro-batch, and of running its update once a step)
    runs = cost.machine.stage_overhead_s + cost.machine.run_overhead_s / micro_batches
    compute = prefix[None, :] - prefix[:, None] + runs
    times = compute + units.messages
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
    found = best_cuts(times, p, micro_batches, allowed, units.waits)
    if found is None:
        raise UnsupportedError(
            f"no placement of the program's {n} forward ops on {p} stages keeps its device_guards in order "
            "and cuts only between ops that write different variables: check the guards' stage order"
        )
    if memory_cap is not None:
        capped = allowed & (memory <= memory_cap)
        found_capped = best_cuts(times, p, micro_batches, capped, units.waits)
        if found_capped is None:
            uncapped = max(memory[k, a, b] for k, (a, b) in enumerate(itertools.pairwise(found[0])))
            raise UnsupportedError(
                f"no placement on {p} stages keeps every stage under the memory cap of {memory_cap:,} bytes "
                f"(the fastest placement's largest stage keeps {int(uncapped):,}): raise the cap, add stages, "
                "or keep fewer micro-batches in flight (schedule 1F1B)"
            )
        found = found_capped
    cuts, step = found
    pairs = list(itertools.pairwise(cuts))
    block = program.global_block()
    return Placement(
        num_stages=p,
        micro_batches=micro_batches,
        schedule_mode=schedule_mode,
        rows=rows,
        forward_ops=units.ops,
        cuts=cuts,
        compute_s=tuple(float(compute[a, b]) for a, b in pairs),
        message_s=tuple(float(units.messages[a, b]) for a, b in pairs),
        wait_s=tuple(float(units.waits[a, b]) for a, b in pairs),
        memory_bytes=tuple(int(memory[k, a, b]) for k, (a, b) in enumerate(pairs)),
        predicted_step_s=step,
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
    block = out.global_block()
    stages = assign_stages(out, placement.num_stages)
    for index, (op, stage) in enumerate(zip(block.ops, stages.op_stages, strict=True)):
        if stage != EVERY_STAGE and explicit_stage(op, index) is None:
            op.set_attr(OP_DEVICE_ATTR, stage_device(stage))
    out.pipeline = PipelineConfig(placement.micro_batches, placement.schedule_mode, placement.num_stages)
    return out
