"""What each forward op of a training program costs a pipeline stage that holds it, and
what any assignment of those ops to stages costs: the numbers both placement searches
use (fluidps.transpiler.partition's exact cuts, fluidps.transpiler.graph_placement's
list scheduling).

The units are the forward ops of block 0 in program order. A unit carries its forward
op, the backward ops that go with it (a grad op goes with the forward op whose output's
gradient it reads) and the updates of the parameters it reads first (spread over the m
micro-batches). A value made by one unit and read by units on other stages crosses:
each end pays its own work on the message (and on its gradient coming back), and the
receiver waits for it once a step (the pipeline's fill).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fluidps.ir.program import Block, Program
from fluidps.ir.stages import explicit_stage, forward_name, phase
from fluidps.ir.types import EMPTY_VAR_NAME, GRAD_SUFFIX, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole
from fluidps.transpiler.cost_model import CostModel, var_bytes


@dataclass(frozen=True)
class Value:
    """A value one unit makes and units after it read: `work`, one end's own seconds on
    it (and its gradient) a micro-batch; `wait`, its time on the way; `grad`: whether its
    gradient comes back."""

    maker: int
    readers: frozenset[int]
    work: float
    wait: float
    grad: bool


@dataclass(frozen=True)
class Units:
    ops: tuple[int, ...]  # block-0 op index of each unit
    compute: np.ndarray  # seconds per micro-batch
    param_bytes: np.ndarray  # parameters, their gradient sums and optimizer state, first read here
    stash_bytes: np.ndarray  # what one micro-batch's forward keeps for its backward
    messages: np.ndarray  # (n + 1, n + 1): a stage holding units i .. j - 1: its work on messages
    waits: np.ndarray  # (n + 1, n + 1): ... and its received messages' time on their way
    cut_ok: np.ndarray  # (n + 1,): may a stage start (or end) at this unit boundary
    pins: tuple[int | None, ...]  # the stage a device_guard gave each unit
    values: tuple[Value, ...]  # what crosses when its maker and a reader sit on different stages
    run_s: float  # what a stage spends on a micro-batch besides its ops and messages
    wait_factor: float  # how much slower a stage that waits for a busier one runs (MachineModel's)


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


def units_of(program: Program, cost: CostModel, micro_rows: int, micro_batches: int) -> Units:
    """The units of training program `program` and their costs on `micro_rows` rows a micro-batch."""
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
    values = tuple(_values(block, maker, readers, cost, micro_rows))
    messages, waits = _message_matrices(n, values)
    # (a stage's own cost of each micro-batch, and of running its update once a step)
    run_s = cost.machine.stage_overhead_s + cost.machine.run_overhead_s / micro_batches
    return Units(
        units, compute, param_bytes, stash_bytes, messages, waits, cut_ok, pins, values, run_s,
        cost.machine.wait_factor,
    )  # fmt: skip


def _values(
    block: Block, maker: dict[str, int], readers: dict[str, set[int]], cost: CostModel, rows: int
) -> list[Value]:
    out = []
    for name, read in readers.items():
        later = frozenset(r for r in read if r > maker[name])
        if later:
            nbytes = var_bytes(block, name, rows)
            grad = block.find_var(name + GRAD_SUFFIX) is not None
            work = (2 if grad else 1) * cost.message_cpu_seconds(nbytes)
            out.append(Value(maker[name], later, work, cost.message_seconds(nbytes), grad))
    return out


def _message_matrices(n: int, values: Sequence[Value]) -> tuple[np.ndarray, np.ndarray]:
    """For a stage holding units i .. j - 1, per micro-batch: the seconds its own work on
    messages takes (each value made before i that it reads, each it makes that a later
    stage reads, and each one's gradient the other way), and the seconds its received
    messages spend on their way: what `evaluate` counts for a run of units, for every
    run at once, built from rectangles in (i, j) on a difference array."""
    work, wait = np.zeros((n + 2, n + 2)), np.zeros((n + 2, n + 2))

    def add(diff: np.ndarray, i0: int, i1: int, j0: int, j1: int, value: float) -> None:
        if i0 > i1 or j0 > j1 or value == 0:  # (i in [i0, i1], j in [j0, j1])
            return
        diff[i0, j0] += value
        diff[i0, j1 + 1] -= value
        diff[i1 + 1, j0] -= value
        diff[i1 + 1, j1 + 1] += value

    for value in values:
        a, later = value.maker, sorted(value.readers)
        # made inside [i, j), read at or after j: sent (and its gradient received)
        add(work, 0, a, a + 1, later[-1], value.work)
        add(wait, 0, a, a + 1, later[-1], value.wait if value.grad else 0.0)
        previous = a
        for r in later:  # made before i, read inside [i, j): received (and its gradient sent)
            add(work, previous + 1, r, r + 1, n, value.work)
            add(wait, previous + 1, r, r + 1, n, value.wait)
            previous = r
    return tuple(np.cumsum(np.cumsum(d, axis=0), axis=1)[: n + 1, : n + 1] for d in (work, wait))


def in_flight(schedule_mode: str, stage: int, num_stages: int, micro_batches: int) -> int:
    """How many micro-batches' activations stage `stage` keeps at most (PipelinePlan.schedule)."""
    if schedule_mode == "F-then-B":
        return micro_batches
    return min(num_stages - stage, micro_batches)


@dataclass(frozen=True)
class StageCosts:
    """What the model predicts for an assignment of units to stages: per stage and
    micro-batch, its compute (ops, and what running them costs) and its own work on
    messages; the waits its received messages add to the first micro-batch; the bytes
    it keeps; and the step."""

    compute_s: tuple[float, ...]
    message_s: tuple[float, ...]
    wait_s: tuple[float, ...]
    memory_bytes: tuple[int, ...]
    step_s: float


def waiting_slowdown(stage_seconds: Sequence[float], wait_factor: float) -> list[float]:
    """How much slower each stage's ops count for waiting for the slowest, the more it
    waits: 1 + (wait_factor - 1) * (1 - t / T) (see MachineModel.wait_factor)."""
    slowest = max(stage_seconds)
    if slowest <= 0:
        return [1.0] * len(stage_seconds)
    return [1 + (wait_factor - 1) * (1 - t / slowest) for t in stage_seconds]


def step_seconds(stage_seconds: Sequence[float], micro_batches: int, fill_seconds: float = 0.0) -> float:
    """The predicted step of stages taking these seconds per micro-batch (and the
    first micro-batch's `fill_seconds` of waiting for messages on its way)."""
    return sum(stage_seconds) + fill_seconds + (micro_batches - 1) * max(stage_seconds)


def evaluate(
    units: Units, stages: Sequence[int], num_stages: int, micro_batches: int, schedule_mode: str
) -> StageCosts:
    """The model's numbers for units placed on `stages` (one stage per unit)."""
    p = num_stages
    compute = [units.run_s] * p
    params, stash = [0.0] * p, [0.0] * p
    for u, k in enumerate(stages):
        compute[k] += float(units.compute[u])
        params[k] += float(units.param_bytes[u])
        stash[k] += float(units.stash_bytes[u])
    messages, waits = [0.0] * p, [0.0] * p
    for value in units.values:
        home = stages[value.maker]
        for k in {stages[r] for r in value.readers} - {home}:  # one message to each other stage
            messages[k] += value.work
            messages[home] += value.work
            waits[k] += value.wait
            if value.grad:
                waits[home] += value.wait
    memory = [int(params[k] + in_flight(schedule_mode, k, p, micro_batches) * stash[k]) for k in range(p)]
    # A waiting stage's ops run slower (their data went cold); its own cost a micro-batch
    # and its messages' were measured in jobs whose stages wait too, so they already hold it.
    slower = waiting_slowdown([c + m for c, m in zip(compute, messages, strict=True)], units.wait_factor)
    compute = [units.run_s + (c - units.run_s) * s for c, s in zip(compute, slower, strict=True)]
    times = [c + m for c, m in zip(compute, messages, strict=True)]
    step = step_seconds(times, micro_batches, sum(waits))
    return StageCosts(tuple(compute), tuple(messages), tuple(waits), tuple(memory), step)


def stages_of_cuts(cuts: Sequence[int]) -> list[int]:
    """The stage of each unit when stage k holds units cuts[k] .. cuts[k + 1] - 1."""
    return [k for k, (a, b) in enumerate(itertools.pairwise(cuts)) for _ in range(a, b)]
