"""Measured op times: what fluidps.transpiler.cost_model's OpProfile holds.

    profile = profile_ops(main, startup, feed, steps=5)
    profile.save()          # merged into ~/.cache/fluidps/op_profile.json

The program runs a few steps on a scope of its own (the startup program run into it;
the caller's values are never touched), op by op through the interpreter's kernels,
and each op's time is the median over the steps after the first, keyed by its
signature at the feed's rows. Ops of one signature (the same layer repeated) share
the median of all their runs.

Timed one by one, ops cost more than they do when an Executor runs a pipeline stage
compiled (each op alone pays for its fresh outputs' first touch, which a compiled
segment's plan and a warm allocator mostly avoid): measured here, 30-60% more for
the matrix products of a wide MLP. So the program also runs as a one-stage pipeline
of `micro_batches` micro-batches, compiled, as a stage runs it (its forward and
backward once per micro-batch, its updates once a step), and every op's time is
scaled by that stage's busy time over what the ops' medians add up to for the same
step: the profile keeps the ops' proportions and the executor's total.

Stages that share a host slow each other down, small ops most (fluidps.executor.measure.neighbors
has the numbers). With `neighbors=k`, k processes run the program's steps while its ops
and its reference step are timed, as a pipeline's other stages on the same host run
while one stage works: the profile then holds the times such a stage sees.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fluidps.errors import FeedError
from fluidps.executor.executor import Executor, PreparedProgram
from fluidps.executor.measure.neighbors import busy_neighbors, one_stage, warm, whole_batch
from fluidps.executor.scope import Scope
from fluidps.ir.program import Program
from fluidps.ir.stages import phase
from fluidps.transpiler.cost_model import OpProfile, machine_id, op_signature


def profile_ops(
    program: Program,
    startup: Program,
    feed: Mapping[str, Any],
    steps: int = 5,
    micro_batches: int = 1,
    neighbors: int = 0,
) -> OpProfile:
    """Each op of training program `program`'s global block timed over `steps` runs (after
    one untimed) on `feed` (one micro-batch's rows), scaled to a compiled stage's step of
    `micro_batches` such micro-batches; next to `neighbors` processes running its steps."""
    rows = {np.shape(v)[0] for v in feed.values() if np.ndim(v) > 0}
    if len(rows) != 1:
        raise FeedError(f"profile_ops: every fed value needs the same number of rows, got {sorted(rows)}")
    (batch_rows,) = rows
    block = program.global_block()
    signatures = [op_signature(block, op, batch_rows) for op in block.ops]
    with busy_neighbors(program, startup, feed, micro_batches, neighbors):
        medians, busy = _timed(program, startup, feed, signatures, steps, micro_batches)
    per_step = sum(
        medians[s] * (1 if phase(op) == "optimize" else micro_batches)
        for s, op in zip(signatures, block.ops, strict=True)
    )
    scale = busy / per_step if per_step > 0 else 1.0
    return OpProfile(machine_id(), {s: t * scale for s, t in medians.items()})


def _timed(
    program: Program,
    startup: Program,
    feed: Mapping[str, Any],
    signatures: list[str],
    steps: int,
    micro_batches: int,
) -> tuple[dict[str, float], float]:
    """(each op signature's median seconds through the interpreter, the compiled one-stage
    pipeline's median busy seconds a step)."""
    scope = Scope()
    exe = Executor(compile=False)
    exe.run(startup, scope=scope)
    prepared = PreparedProgram(program, [])
    times: dict[str, list[float]] = {}
    for step in range(steps + 1):
        env = {name: scope.find(name) for name in prepared.scope_reads if scope.find(name) is not None}
        env.update(prepared.check_feeds(feed))
        seconds = prepared.runner.run_timed(env)
        if step:  # (the first run builds what kernels cache)
            for signature, taken in zip(signatures, seconds, strict=True):
                times.setdefault(signature, []).append(taken)
        for name in prepared.persistables:  # the next step starts where this one ended
            if name in env:
                scope[name] = env[name]
    medians = {s: statistics.median(t) for s, t in times.items()}
    return medians, _stage_step(program, startup, feed, micro_batches, steps)


def _stage_step(
    program: Program, startup: Program, feed: Mapping[str, Any], micro_batches: int, steps: int
) -> float:
    """Median busy seconds of a step of `program` run as a one-stage pipeline of
    `micro_batches` micro-batches of `feed`, compiled."""
    staged = one_stage(program, micro_batches)
    batch = whole_batch(feed, micro_batches)
    scope = Scope()
    exe = Executor()
    exe.run(startup, scope=scope)
    warm(exe, staged, batch, scope)
    seconds = []
    for _ in range(steps):
        (before,) = exe.pipeline_stats(staged)
        exe.run(staged, feed=batch, scope=scope)
        (after,) = exe.pipeline_stats(staged)
        seconds.append(after["busy_s"] - before["busy_s"])
    return statistics.median(seconds)


def main(argv: list[str] | None = None) -> None:
    """`python -m fluidps.executor.measure.op_profile MAIN.pb STARTUP.pb FEED.npz OUT.json
    [--micro-batches M] [--neighbors K]`: profile_ops in a process of its own, threaded as
    its environment says (as a stage process is: `fluidps place --measure` runs it with the
    stages' thread count, next to one neighbor for each other stage on this host)."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    for name in ("main", "startup", "feed", "out"):
        parser.add_argument(name)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--neighbors", type=int, default=0)
    args = parser.parse_args(argv)
    program = Program.parse_from_string(Path(args.main).read_bytes())
    startup = Program.parse_from_string(Path(args.startup).read_bytes())
    with np.load(args.feed) as data:  # (object arrays refused: numpy loads no pickles by default)
        feed = {name: data[name] for name in data.files}
    profile_ops(program, startup, feed, args.steps, args.micro_batches, args.neighbors).save(args.out)


if __name__ == "__main__":
    main()
