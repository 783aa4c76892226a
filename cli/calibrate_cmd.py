"""`fluidps calibrate`: measure this machine, its transport and a pipeline stage's own
cost per micro-batch for the cost model (fluidps.transpiler.cost_model), and store them."""

from __future__ import annotations

import dataclasses
import statistics

import click
import numpy as np

import fluidps
from fluidps import layers
from fluidps.cli.common import fail
from fluidps.cli.stage_timing import time_stages
from fluidps.errors import Error
from fluidps.transpiler.cost_model import MachineModel

_MICRO_BATCHES = 8


def measure_stage_overhead(model: MachineModel, steps: int = 20) -> float:
    """Seconds a pipeline stage process spends on a micro-batch besides its ops and
    messages: a two-stage job (`RemoteExecutor`, one process per stage) of a model too
    small to compute anything, each stage's busy time a micro-batch, less its two
    messages' own work and its ops' fixed costs as `model` counts them."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        y = layers.data("y", [1], dtype="int64")
        with fluidps.device_guard("stage:0"):
            h = layers.fc(x, 4, act="relu")
        with fluidps.device_guard("stage:1"):
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 2), y))
        fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), _MICRO_BATCHES).minimize(loss)
    ops = len(main.global_block().ops) / 2  # (each stage's share of them, about)
    rng = np.random.default_rng(0)
    feed = {
        "x": rng.random((2 * _MICRO_BATCHES, 4), np.float32),
        "y": np.zeros((2 * _MICRO_BATCHES, 1), np.int64),
    }
    _, busy = time_stages(main, startup, [feed], steps)
    per_micro_batch = statistics.mean(busy) / _MICRO_BATCHES
    accounted = 2 * model.message_cpu_seconds(4 * 4 * 2) + ops * model.op_overhead_s
    return max(per_micro_batch - accounted, 0.0)


@click.command()
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False),
    help="Where to store it (default: the cost model's path).",
)
@click.option("--calls", type=int, default=40, show_default=True, help="Round trips timed per message size.")
def calibrate(output: str | None, calls: int) -> None:
    """Measure this machine (one thread's matrix-product rate and memory bandwidth, an
    op's and a program run's fixed costs), a message between two processes over
    fluidps's transport (alpha + beta * bytes, and the sender's own work), and what a
    pipeline stage process spends on a micro-batch besides its ops and messages; store
    them for placement by cost."""
    from fluidps.executor.calibrate import calibrate as measure

    try:
        model, fitted = measure(calls)
        model = dataclasses.replace(model, stage_overhead_s=measure_stage_overhead(model))
    except Error as e:
        fail(str(e))
    path = model.save(output)
    click.echo(f"machine: {model.machine}")
    click.echo(f"  matrix product   {model.gemm_flops / 1e9:8.1f} GFLOP/s (one thread, float32)")
    click.echo(f"  memory copy      {model.bandwidth / 1e9:8.1f} GB/s")
    click.echo(f"  one op           {model.op_overhead_s * 1e6:8.2f} us")
    click.echo(f"  one program run  {model.run_overhead_s * 1e6:8.2f} us besides its ops")
    click.echo(f"  a stage's own    {model.stage_overhead_s * 1e6:8.1f} us a micro-batch")
    click.echo(
        f"  message          {model.alpha_s * 1e6:8.1f} us + {model.beta_s * 1e9:.3f} ns/byte on its way"
    )
    click.echo(f"  sending one      {model.send_cpu_s * 1e6:8.1f} us of the sender's time")
    for size, seconds in fitted["round_trips"]:
        click.echo(f"    round trip of {size:>9,} bytes: {seconds * 1e6:8.1f} us")
    click.echo(f"stored in {path}")
