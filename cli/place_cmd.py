"""`fluidps place`: choose a training program's pipeline cuts by the cost model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import click
import numpy as np

from fluidps.cli.common import fail, load_program
from fluidps.errors import Error
from fluidps.io.atomic import write_atomic
from fluidps.ir.devices import SCHEDULES
from fluidps.ir.program import Program
from fluidps.ir.types import to_numpy_dtype
from fluidps.transpiler.cost_model import CostModel, CostModelWarning, OpProfile, load_machine, load_profile
from fluidps.transpiler.partition import Placement, place_pipeline, placed

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


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
    help="Time the program's ops first (it needs --startup) and place with those times (the "
    "profile is stored for later runs); then run the placed program as a job of one process per "
    "stage, and print each stage's measured time next to the predicted one.",
)
@click.option("--startup", "startup_file", metavar="STARTUP.pb", help="The startup program (for --measure).")
@click.option(
    "--neighbors",
    type=int,
    help="Busy processes the ops are timed next to (for --measure; default: one for each other stage "
    "this host's cores hold; 0 when each stage runs on a host of its own).",
)
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
    neighbors: int | None,
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
    if neighbors is not None and neighbors < 0:
        fail(f"--neighbors must be 0 or more, got {neighbors}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CostModelWarning)
        try:
            machine = load_machine(calibration)
            profile = load_profile(profile_file)
            if measure:
                startup = load_program(startup_file)
                profile = _measure(main, startup, rows // micro_batches, micro_batches, stages, neighbors)
            cost = CostModel(machine, profile)
            placement = place_pipeline(main, stages, micro_batches, cost, rows, schedule, memory_cap)
        except Error as e:
            fail(str(e))
    for warning in caught:
        click.echo(f"fluidps: warning: {warning.message}", err=True)
    report = _to_dict(placement)
    if measure:
        step, busy = _run(placed(main, placement), startup, rows)
        report["measured_step_ms"] = round(step * 1e3, 3)
        for stage, seconds in zip(report["stages"], busy, strict=True):
            stage["measured_ms_per_step"] = round(seconds * 1e3, 3)
            stage["predicted_ms_per_step"] = round(placement.stage_s[stage["stage"]] * micro_batches * 1e3, 3)
    click.echo(json.dumps(report, indent=1) if as_json else placement.summary())
    if measure and not as_json:
        click.echo(f"measured as a job: step {report['measured_step_ms']:.3f} ms "
                   f"(predicted {report['predicted_step_ms']:.3f} ms)")  # fmt: skip
        for stage in report["stages"]:
            click.echo(f"  stage {stage['stage']}: busy {stage['measured_ms_per_step']:.3f} ms a step, "
                       f"predicted {stage['predicted_ms_per_step']:.3f} ms")  # fmt: skip
    if output:
        write_atomic(output, [placed(main, placement).serialize_to_string()])
        click.echo(f"wrote the placed program to {output}")


def _measure(
    main: Program, startup: Program, rows: int, micro_batches: int, stages: int, neighbors: int | None
) -> OpProfile:
    """Time every op of `main` on `rows` rows of made-up data, scaled to a stage's step of
    `micro_batches` micro-batches (fluidps.executor.measure.op_profile), in a process threaded as
    each stage's will be (the cores shared by the stages), next to a busy neighbor for each
    other stage that runs at the same time on this host, and store the times."""
    cores = os.cpu_count() or 1
    threads = max(cores // stages, 1)
    if neighbors is None:
        neighbors = min(stages, max(cores // threads, 1)) - 1
    env = {**os.environ, **dict.fromkeys(_THREAD_VARS, str(threads))}
    with tempfile.TemporaryDirectory(prefix="fluidps-profile-") as work:
        files = {name: Path(work) / name for name in ("main.pb", "startup.pb", "feed.npz", "profile.json")}
        files["main.pb"].write_bytes(main.serialize_to_string())
        files["startup.pb"].write_bytes(startup.serialize_to_string())
        np.savez(files["feed.npz"], **made_up_feed(main, rows))
        command = [sys.executable, "-m", "fluidps.executor.measure.op_profile", *map(str, files.values())]
        try:
            done = subprocess.run(
                [*command, "--micro-batches", str(micro_batches), "--neighbors", str(neighbors)],
                env=env,
                capture_output=True,
                text=True,
                timeout=1800,
            )
        except subprocess.TimeoutExpired:
            fail("timing the program's ops took over 30 minutes: give a smaller --batch-size, or a --profile")
        if done.returncode != 0:
            fail(f"timing the program's ops failed: {done.stderr.strip()[-800:]}")
        profile = OpProfile.load(files["profile.json"])
    path = profile.save()
    click.echo(
        f"timed {len(profile.seconds)} op signatures on {rows} rows, {threads} thread(s), next to "
        f"{neighbors} busy neighbor(s); stored in {path}"
    )
    return profile


def _run(program: Program, startup: Program, rows: int) -> tuple[float, list[float]]:
    """(seconds a step, each stage's busy seconds a step) of the placed program as a job."""
    from fluidps.cli.stage_timing import time_stages

    return time_stages(program, startup, [made_up_feed(program, rows)], steps=5)


def made_up_feed(main: Program, rows: int) -> dict[str, np.ndarray]:
    """`rows` rows of each variable `main` reads and no op writes: a float uniform in [0, 1),
    an integer zeros (a valid class, a valid id)."""
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
    return feed


def _to_dict(p: Placement) -> dict:
    return {
        "num_stages": p.num_stages,
        "micro_batches": p.micro_batches,
        "schedule": p.schedule_mode,
        "rows": p.rows,
        "method": p.method,
        "predicted_step_ms": round(p.predicted_step_s * 1e3, 4),
        "stages": [
            {
                "stage": k,
                "ops": p.ops_of(k),
                "compute_ms": round(p.compute_s[k] * 1e3, 4),
                "messages_ms": round(p.message_s[k] * 1e3, 4),
                "waits_ms": round(p.wait_s[k] * 1e3, 4),
                "memory_bytes": p.memory_bytes[k],
            }
            for k in range(p.num_stages)
        ],
    }
