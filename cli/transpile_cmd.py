"""`fluidps transpile`: split a training program into a parameter-server job's programs,
or (`--pipeline`) into one program per pipeline stage."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fluidps.cli.common import fail, load_program
from fluidps.errors import Error
from fluidps.io.atomic import write_atomic
from fluidps.ir.devices import SCHEDULES, PipelineConfig
from fluidps.ir.graph import to_dot
from fluidps.ir.program import Program
from fluidps.ir.stages import assign_stages
from fluidps.transpiler import DistributeTranspiler, DistributeTranspilerConfig, PipelineTranspiler
from fluidps.transpiler.config import MODES, SPLIT_METHODS
from fluidps.transpiler.pipeline_plan import placement_table, plan_to_dict


@click.command()
@click.argument("main_file", metavar="MAIN.pb")
@click.option(
    "--startup", "startup_file", metavar="STARTUP.pb", help="The startup program (not with --pipeline)."
)
@click.option("--pservers", help="Comma-separated pserver endpoints, host:port (not with --pipeline).")
@click.option(
    "--pipeline",
    is_flag=True,
    help="Cut the program into its pipeline stages (the stages its ops' op_device name) instead.",
)
@click.option(
    "--microbatches", type=int, default=1, show_default=True, help="--pipeline: micro-batches per mini-batch."
)
@click.option(
    "--schedule",
    type=click.Choice(SCHEDULES),
    default="1F1B",
    show_default=True,
    help="--pipeline: the schedule.",
)
@click.option("--trainers", type=int, default=1, show_default=True, help="How many trainers.")
@click.option(
    "--trainer-id", type=int, default=0, show_default=True, help="Which trainer's programs to write."
)
@click.option("--mode", type=click.Choice(MODES), default="sync", show_default=True)
@click.option("--staleness", type=int, default=0, help="SSP: steps a trainer may run ahead.")
@click.option("--send-interval", type=int, default=1, help="Async: upload gradients every n mini-batches.")
@click.option("--recv-interval", type=int, default=1, help="Async: download parameters every m mini-batches.")
@click.option("--split-method", type=click.Choice(SPLIT_METHODS), default="RoundRobin", show_default=True)
@click.option(
    "--min-block-size", type=int, default=8192, show_default=True, help="Fewest elements per slice."
)
@click.option("--no-slice", is_flag=True, help="Keep every parameter whole on one pserver.")
@click.option(
    "--distributed-table-min-rows",
    type=int,
    default=0,
    show_default=True,
    help="Sparse tables of at least this many rows stay on the pservers (trainers prefetch their rows); "
    "0: only tables marked is_distributed.",
)
@click.option(
    "-o", "--output", required=True, type=click.Path(file_okay=False), help="Directory to write into."
)
def transpile(
    main_file: str,
    startup_file: str | None,
    pservers: str | None,
    pipeline: bool,
    microbatches: int,
    schedule: str,
    trainers: int,
    trainer_id: int,
    mode: str,
    staleness: int,
    send_interval: int,
    recv_interval: int,
    split_method: str,
    min_block_size: int,
    no_slice: bool,
    distributed_table_min_rows: int,
    output: str,
) -> None:
    """Write the trainer's and every pserver's programs (.pb and .dot) and the
    placement table (placement.txt, placement.json) into OUTPUT; with --pipeline,
    each stage's program and which op runs on which stage."""
    if pipeline:
        _write_pipeline(load_program(main_file), microbatches, schedule, output)
        return
    if startup_file is None or pservers is None:
        fail("--startup and --pservers are needed to transpile for pservers (or say --pipeline)")
    main, startup = load_program(main_file), load_program(startup_file)
    try:
        config = DistributeTranspilerConfig(
            slice_var_up=not no_slice,
            split_method=split_method,
            min_block_size=min_block_size,
            mode=mode,
            staleness=staleness,
            send_interval=send_interval,
            recv_interval=recv_interval,
            distributed_table_min_rows=distributed_table_min_rows,
        )
        plan = DistributeTranspiler(config).transpile(
            trainer_id, main, pservers, trainers=trainers, startup_program=startup
        )
    except Error as e:
        fail(str(e))
    out = Path(output)
    programs = {"trainer": plan.trainer_program, "trainer_startup": plan.trainer_startup}
    for i, ep in enumerate(plan.endpoints):
        programs[f"pserver_{i}"] = plan.pserver_programs[ep]
        programs[f"pserver_{i}_startup"] = plan.pserver_startups[ep]
    _write(out, programs, plan.summary(), plan.to_dict())
    click.echo(plan.summary())
    click.echo(f"wrote {len(programs)} programs (.pb and .dot) and placement.txt / placement.json into {out}")


def _write_pipeline(main: Program, microbatches: int, schedule: str, output: str) -> None:
    try:
        stages = assign_stages(main).num_stages
        plan = PipelineTranspiler().transpile(main, PipelineConfig(microbatches, schedule, stages))
    except Error as e:
        fail(str(e))
    programs = {f"stage_{s.stage}": s.program for s in plan.stages}
    text = f"{plan.summary()}\n\n{placement_table(plan)}"
    _write(Path(output), programs, text, plan_to_dict(plan))
    click.echo(plan.summary())
    click.echo(
        f"wrote {len(programs)} stage programs (.pb and .dot) and placement.txt / placement.json into {output}"
    )


def _write(out: Path, programs: dict[str, Program], placement: str, data: dict) -> None:
    files = {f"{name}.pb": program.serialize_to_string() for name, program in programs.items()}
    files |= {f"{name}.dot": to_dot(program).encode() for name, program in programs.items()}
    files["placement.txt"] = (placement + "\n").encode()
    files["placement.json"] = (json.dumps(data, indent=1) + "\n").encode()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, content in files.items():
            write_atomic(str(out / name), [content])
    except (OSError, Error) as e:
        fail(f"cannot write into {out}: {e}")
