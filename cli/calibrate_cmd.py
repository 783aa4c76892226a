"""`fluidps calibrate`: measure this machine, its transport and a pipeline stage's own
cost per micro-batch for the cost model (fluidps.transpiler.cost_model), and store them.

The rates (a product's, a copy's) hold still between minutes; the constants a pipeline
stage pays every micro-batch do not: on a shared host one measure of a message's send
read 67 us and the next 214 us, a minute apart. They are measured in interleaved rounds
and each is the median of its rounds, so one slow minute does not set them."""

from __future__ import annotations

import dataclasses
import os
import statistics
import warnings
from collections.abc import Sequence

import click
import numpy as np

import fluidps
from fluidps import layers
from fluidps.cli.common import fail
from fluidps.cli.stage_timing import time_stages
from fluidps.errors import Error
from fluidps.executor.measure.calibrate import calibrate as measure_machine
from fluidps.executor.measure.op_profile import profile_ops
from fluidps.executor.transport.link import measure_link
from fluidps.transpiler.cost_model import CostModel, CostModelWarning, MachineModel
from fluidps.transpiler.partition import place_pipeline

_MICRO_BATCHES = 8


def measure_stage_costs(model: MachineModel, steps: int = 20) -> tuple[float, float]:
    """(seconds, seconds a byte) a pipeline stage process spends on a micro-batch besides
    its ops and messages, and on each byte of a message it sends or receives: two-stage
    jobs (`RemoteExecutor`, one process per stage) of a model too small to compute
    anything, passing 64 bytes and then 256 KiB a micro-batch; each stage's busy time a
    micro-batch, less what `model` counts for its messages' fixed cost and what a profile
    of the same ops (fluidps.executor.measure.op_profile, next to a neighbor as a stage
    runs) says they take: the stage's own cost is what the model would otherwise miss,
    measured the way the model times ops (its ops timed alone, not guessed at a fixed
    cost each, which counted a small stage's ops twice)."""
    small = _stage_busy(4, steps)
    wide = _stage_busy(_WIDE, steps)
    nbytes = {4: _ROWS * 4 * 4, _WIDE: _ROWS * _WIDE * 4}  # float32 [rows, width], each way
    per_byte = max((wide - small) / (2 * (nbytes[_WIDE] - nbytes[4])), 0.0)  # (a message each way)
    ops = statistics.mean(_stage_ops(model, 4))
    overhead = small - 2 * (model.send_cpu_s + per_byte * nbytes[4]) - ops
    return max(overhead, 0.0), per_byte


_ROWS = 2  # a micro-batch's
_WIDE = 32768  # the wide job's activation: 256 KiB a micro-batch


def _stage_busy(width: int, steps: int) -> float:
    """Mean busy seconds a micro-batch of the two stages of x[4] -> fc(width) | fc(2) -> loss."""
    busy = _two_stage_busy(4, (width,), (), 2, _ROWS, steps)
    return statistics.mean(busy) / _MICRO_BATCHES


def _stage_ops(model: MachineModel, width: int) -> tuple[float, ...]:
    """Each stage's ops' seconds a micro-batch in the job `_stage_busy(width)` times, as
    the cost model counts them from a profile (no messages, no stage's own cost, no
    waiting): what the stage's busy time holds besides those."""
    return _predicted_stages(model, 4, (width,), (), 2, _ROWS)[1]


def _predicted_stages(
    model: MachineModel, inputs: int, first: tuple[int, ...], second: tuple[int, ...], classes: int, rows: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(each stage's seconds a micro-batch as `model` predicts them without the waiting
    slowdown, each stage's ops alone) for _two_stage_program's job, its ops timed by a
    profile next to a neighbor (as the other stage runs beside it)."""
    main, _, feed = _two_stage_program(inputs, first, second, classes, rows)
    plain, plain_startup, _ = _two_stage_program(inputs, first, second, classes, rows, pipelined=False)
    one = {name: value[:rows] for name, value in feed.items()}
    neighbors = min(2, os.cpu_count() or 1) - 1  # (the other stage shares the host, as in the job)
    profile = profile_ops(plain, plain_startup, one, 5, _MICRO_BATCHES, neighbors)
    unslowed = dataclasses.replace(model, wait_factor=1.0)
    ops_only = dataclasses.replace(
        unslowed, stage_overhead_s=0.0, run_overhead_s=0.0, send_cpu_s=0.0, stage_byte_s=0.0
    )
    placed = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostModelWarning)  # (the loss seed's 1 / m: not in the profile)
        for machine in (unslowed, ops_only):
            cost = CostModel(machine, profile)
            placed.append(place_pipeline(main, 2, _MICRO_BATCHES, cost, rows * _MICRO_BATCHES).stage_s)
    return placed[0], placed[1]


def _two_stage_program(
    inputs: int,
    first: tuple[int, ...],
    second: tuple[int, ...],
    classes: int,
    rows: int,
    pipelined: bool = True,
) -> tuple[fluidps.Program, fluidps.Program, dict[str, np.ndarray]]:
    """x[inputs] -> relu layers `first` | relu layers `second` -> fc(classes) -> loss, two
    stages of `_MICRO_BATCHES` micro-batches of `rows` rows (or, not `pipelined`, the same
    layers under plain SGD: what a profile runs), and a step's feed."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    with fluidps.program_guard(main, startup):
        h = layers.data("x", [inputs])
        y = layers.data("y", [1], dtype="int64")
        with fluidps.device_guard("stage:0" if pipelined else None):
            for width in first:
                h = layers.fc(h, width, act="relu")
        with fluidps.device_guard("stage:1" if pipelined else None):
            for width in second:
                h = layers.fc(h, width, act="relu")
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, classes), y))
        if pipelined:
            fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), _MICRO_BATCHES).minimize(loss)
        else:
            fluidps.optimizer.SGD(0.1).minimize(loss)
    rng = np.random.default_rng(0)
    feed = {
        "x": rng.random((rows * _MICRO_BATCHES, inputs), np.float32),
        "y": np.zeros((rows * _MICRO_BATCHES, 1), np.int64),
    }
    return main, startup, feed


def _two_stage_busy(
    inputs: int, first: tuple[int, ...], second: tuple[int, ...], classes: int, rows: int, steps: int
) -> list[float]:
    """Each stage's busy seconds a step of _two_stage_program's job (RemoteExecutor, a process each)."""
    main, startup, feed = _two_stage_program(inputs, first, second, classes, rows)
    _, busy = time_stages(main, startup, [feed], steps)
    return busy


def measure_wait_factor(model: MachineModel, steps: int = 20) -> float:
    """How much slower than the model predicts it a pipeline stage runs when it waits for
    a busier peer between micro-batches (MachineModel.wait_factor), measured against the
    model itself: a second stage of four layers of 256 behind a first stage whose step
    takes about four times as long; its busy time a micro-batch, less what `model`
    charges it besides its ops (its own cost, its messages), over its ops as the profile
    times them (next to a neighbor), is the slowdown 1 + (f - 1)(1 - t / T) the model
    applies (t / T: its busy time over the first stage's); f is kept within 1-2. (Its
    ratio to the same stage measured alone, the first measure, counted twice what the
    profile's neighbor already holds.)"""
    first, second = (4096, 256), (256,) * 4
    busy = [b / _MICRO_BATCHES for b in _two_stage_busy(256, first, second, 10, 32, steps)]
    predicted, ops = _predicted_stages(model, 256, first, second, 10, 32)
    if ops[1] <= 0 or busy[0] <= busy[1]:
        return 1.0
    slowdown = (busy[1] - (predicted[1] - ops[1])) / ops[1]
    factor = 1 + (slowdown - 1) / (1 - busy[1] / busy[0])
    return min(max(factor, 1.0), 2.0)


# MachineModel's fields that a round measures: those charged to every micro-batch or message.
# A stage's own cost and a send's are read off the same job (the job's time a micro-batch,
# less its sends): a round that reads the send high reads the stage's own cost low. They
# are taken together, from the round whose sum is the median, so that the model charges
# what a job measured; the others are each their own median.
STAGE_CONSTANTS = ("send_cpu_s", "stage_overhead_s", "stage_byte_s")
LINK_CONSTANTS = ("alpha_s", "beta_s")  # (one line's intercept and slope: taken together too)
ROUND_CONSTANTS = ("wait_factor", *LINK_CONSTANTS, *STAGE_CONSTANTS)


def measure_round(model: MachineModel, calls: int = 40, steps: int = 20, link: dict | None = None) -> dict:
    """One round of ROUND_CONSTANTS: the transport (`link`: a measure_link result already
    taken, else one is taken now), then the stage jobs, which count the messages at this
    round's send cost; and the round trips the transport was fitted from."""
    link = measure_link(calls=calls) if link is None else link
    now = dataclasses.replace(
        model, alpha_s=link["alpha_s"], beta_s=link["beta_s"], send_cpu_s=link["send_cpu_s"]
    )
    overhead, per_byte = measure_stage_costs(now, steps)
    stage = dataclasses.replace(now, stage_overhead_s=overhead, stage_byte_s=per_byte)
    return {
        "alpha_s": now.alpha_s,
        "beta_s": now.beta_s,
        "send_cpu_s": now.send_cpu_s,
        "stage_overhead_s": overhead,
        "stage_byte_s": per_byte,
        "wait_factor": measure_wait_factor(stage, steps),
        "round_trips": link["round_trips"],
    }


def with_medians(model: MachineModel, rounds: Sequence[dict]) -> MachineModel:
    """`model` with ROUND_CONSTANTS from `rounds` (measure_round's): STAGE_CONSTANTS from the
    round whose stage cost a micro-batch (its own plus a send each way) is the median (the
    lower one of an even count), LINK_CONSTANTS from the round whose alpha is, and the wait
    factor its own median."""
    if not rounds:
        raise Error("with_medians needs at least one round of measure_round")
    per_micro_batch = [r["stage_overhead_s"] + 2 * r["send_cpu_s"] for r in rounds]
    stage = rounds[per_micro_batch.index(statistics.median_low(per_micro_batch))]
    alphas = [r["alpha_s"] for r in rounds]
    link = rounds[alphas.index(statistics.median_low(alphas))]
    return dataclasses.replace(
        model,
        wait_factor=statistics.median(r["wait_factor"] for r in rounds),
        **{name: link[name] for name in LINK_CONSTANTS},
        **{name: stage[name] for name in STAGE_CONSTANTS},
    )


def calibrate_machine(calls: int = 40, rounds: int = 3, steps: int = 20) -> tuple[MachineModel, list[dict]]:
    """This machine's MachineModel: its rates measured once, ROUND_CONSTANTS the medians of
    `rounds` interleaved rounds (measure_round's, also returned)."""
    if rounds < 1:
        raise Error(f"calibration needs at least one round, got rounds={rounds}")
    model, link = measure_machine(calls)
    measured = [measure_round(model, calls, steps, link)]
    measured += [measure_round(model, calls, steps) for _ in range(rounds - 1)]
    return with_medians(model, measured), measured


def _spread(rounds: Sequence[dict], name: str, unit: float) -> str:
    if len(rounds) < 2:
        return ""
    values = [r[name] * unit for r in rounds]
    return f"  ({min(values):.3g}-{max(values):.3g} over {len(values)} rounds)"


@click.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Where to store it (default: the cost model's path).",
)
@click.option("--calls", type=int, default=40, show_default=True, help="Round trips timed per message size.")
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Rounds of the per-message and per-micro-batch measures (each is their median).",
)
def calibrate(output: str | None, calls: int, rounds: int) -> None:
    """Measure this machine (one thread's matrix-product rate and memory bandwidth, an
    op's and a program run's fixed costs), a message between two processes over
    fluidps's transport (alpha + beta * bytes, and the sender's own work), and what a
    pipeline stage process spends on a micro-batch besides its ops and messages; store
    them for placement by cost (a pipeline's messages cost its stages per byte what two
    stage processes measured, not what the round trips alone say). What a stage pays per
    micro-batch and per message drifts with the host's load: those are measured in
    interleaved rounds, each the median of its rounds, their spread printed."""
    try:
        model, measured = calibrate_machine(calls, rounds)
    except Error as e:
        fail(str(e))
    path = model.save(output)
    click.echo(f"machine: {model.machine}")
    click.echo(f"  matrix product   {model.gemm_flops / 1e9:8.1f} GFLOP/s (one thread, float32)")
    click.echo(f"  memory copy      {model.bandwidth / 1e9:8.1f} GB/s")
    click.echo(f"  one op           {model.op_overhead_s * 1e6:8.2f} us")
    click.echo(f"  one program run  {model.run_overhead_s * 1e6:8.2f} us besides its ops")
    per_round = (  # (what each line says, the constant whose spread over the rounds follows, its unit)
        (f"a stage's own    {model.stage_overhead_s * 1e6:8.1f} us a micro-batch", "stage_overhead_s", 1e6),
        (f"message          {model.alpha_s * 1e6:8.1f} us + {model.beta_s * 1e9:.3f} ns/byte on its way",
         "alpha_s", 1e6),
        (f"sending one      {model.send_cpu_s * 1e6:8.1f} us of the sender's time", "send_cpu_s", 1e6),
        (f"a byte to a stage {model.stage_byte_s * 1e9:7.3f} ns at each end", "stage_byte_s", 1e9),
        (f"a waiting stage  {model.wait_factor:8.2f} x slower than the slowest", "wait_factor", 1),
    )  # fmt: skip
    for line, name, unit in per_round:
        click.echo(f"  {line}{_spread(measured, name, unit)}")
    for size, seconds in measured[0]["round_trips"]:
        click.echo(f"    round trip of {size:>9,} bytes: {seconds * 1e6:8.1f} us (first round)")
    click.echo(f"stored in {path}")
