"""`fluidps calibrate` (measure this machine and its transport for the cost model) and
`fluidps place` (choose a training program's pipeline cuts by that model)."""

from __future__ import annotations

import json
import warnings

import click
import numpy as np

from fluidps.cli.common import fail, load_program
from fluidps.errors import Error
from fluidps.io.atomic import write_atomic
from fluidps.ir.devices import SCHEDULES
from fluidps.ir.program import Program
from fluidps.ir.types import to_numpy_dtype
from fluidps.transpiler.cost_model import CostModel, CostModelWarning, load_machine, load_profile
from fluidps.transpiler.partition import Placement, place_pipeline, placed


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
    op's fixed cost) and a message between two processes over fluidps's transport
    (alpha + beta * bytes), and store them for placement by cost."""
    from fluidps.executor.calibrate import calibrate as measure

    try:
        model, fitted = measure(calls)
    except Error as e:
        fail(str(e))
    path = model.save(output)
    click.echo(f"machine: {model.machine}")
    click.echo(f"  matrix product   {model.gemm_flops / 1e9:8.1f} GFLOP/s (one thread, float32)")
    click.echo(f"  memory copy      {model.bandwidth / 1e9:8.1f} GB/s")
    click.echo(f"  one op           {model.op_overhead_s * 1e6:8.2f} us")
    click.echo(f"  one program run  {model.run_overhead_s * 1e6:8.2f} us besides its ops")
    click.echo(f"  message          {model.alpha_s * 1e6:8.1f} us + {model.beta_s * 1e9:.3f} ns/byte on its way")
    click.echo(f"  sending one      {model.send_cpu_s * 1e6:8.1f} us of the sender's time")
    for size, seconds in fitted["round_trips"]:
        click.echo(f"    round trip of {size:>9,} bytes: {seconds * 1e6:8.1f} us")
    click.echo(f"stored in {path}")


@click.command()
@click.argument("main_file", metavar="MAIN.pb")
@click.option("--stages", type=int, required=True, help="Pipeline stages.")
@click.option("--micro-batches", type=int, default=1, show_default=True, help="Micro-batches per mini-batch.")
@click.option("--batch-size", type=int, help="Rows of a mini-batch (default: 32 per micro-batch).")
@click.option("--schedule", type=click.Choice(SCHEDULES), default="1F1B", show_default=True)
@click.option("--memory-cap", type=int, help="The most bytes a stage may keep.")
@click.option("--calibration", type=click.Path(dir_okay=False), help="A `fluidps calibrate` file.")
@click.option("--profile", "profile_file", type=click.Path(dir_okay=False), help="An op profile file.")
@click.option(
    "--measure",
    is_flag=True,
    help="Time the program's ops first (it needs --startup), and use those times; "
    "the profile is stored for later runs.",
)
@click.option("--startup", "startup_file", metavar="STARTUP.pb", help="The startup program (for --measure).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), help="Write the placed program here.")
@click.option("--json", "as_json", is_flag=True, help="Print the placement as JSON.")
def place(
    main_file: str,
    stages: int,
    micro_batches: int,
    batch_size: int | None,
    schedule: str,
    memory_cap: int | None,
    calibration: str | None,
    profile_file: str | None,
    measure: bool,
    startup_file: str | None,
    output: str | None,
    as_json: bool,
) -> None:
    """Choose where MAIN.pb's forward ops run on a pipeline of --stages stages: the cuts
    that minimize the predicted step (ops with an op_device keep it). Prints each stage's
    ops, predicted compute, messages and memory, and the predicted step."""
    main = load_program(main_file)
    rows = batch_size or 32 * micro_batches
    if stages < 1 or micro_batches < 1:
        fail("--stages and --micro-batches must be at least 1")
    if measure and startup_file is None:
        fail("--measure runs the program: give its --startup program")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CostModelWarning)
        try:
            machine = load_machine(calibration)
            profile = load_profile(profile_file)
            if measure:
                profile = _measure(main, load_program(startup_file), rows // micro_batches)
            cost = CostModel(machine, profile)
            placement = place_pipeline(main, stages, micro_batches, cost, rows, schedule, memory_cap)
        except Error as e:
            fail(str(e))
    for warning in caught:
        click.echo(f"fluidps: warning: {warning.message}", err=True)
    click.echo(json.dumps(_to_dict(placement), indent=1) if as_json else placement.summary())
    if output:
        write_atomic(output, [placed(main, placement).serialize_to_string()])
        click.echo(f"wrote the placed program to {output}")


def _measure(main: Program, startup: Program, rows: int):
    """Time every op of `main` on `rows` rows of made-up data (a float feed uniform in
    [0, 1), an integer one zeros), and store the times."""
    from fluidps.executor.op_profile import profile_ops

    block = main.global_block()
    fed = {n for op in block.ops for n in op.input_arg_names} - {
        n for op in block.ops for n in op.output_arg_names
    }
    rng = np.random.default_rng(0)
    feed = {}
    for name in sorted(fed):
        var = block.find_var(name)
        if var is None or var.persistable or var.dtype is None:
            continue
        shape = tuple(rows if d < 0 else d for d in (var.shape or ()))
        dtype = to_numpy_dtype(var.dtype)
        feed[name] = rng.random(shape).astype(dtype) if dtype.kind == "f" else np.zeros(shape, dtype)
    profile = profile_ops(main, startup, feed)
    path = profile.save()
    click.echo(f"timed {len(profile.seconds)} op signatures on {rows} rows; stored in {path}")
    return profile


def _to_dict(p: Placement) -> dict:
    return {
        "num_stages": p.num_stages,
        "micro_batches": p.micro_batches,
        "schedule": p.schedule_mode,
        "rows": p.rows,
        "predicted_step_ms": round(p.predicted_step_s * 1e3, 4),
        "stages": [
            {
                "stage": k,
                "ops": list(p.forward_ops[p.cuts[k] : p.cuts[k + 1]]),
                "compute_ms": round(p.compute_s[k] * 1e3, 4),
                "messages_ms": round(p.message_s[k] * 1e3, 4),
                "waits_ms": round(p.wait_s[k] * 1e3, 4),
                "memory_bytes": p.memory_bytes[k],
            }
            for k in range(p.num_stages)
        ],
    }
