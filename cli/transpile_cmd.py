"""`fluidps transpile`: split a training program into a parameter-server job's programs."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fluidps.cli.common import fail, load_program
from fluidps.errors import Error
from fluidps.io.atomic import write_atomic
from fluidps.ir.graph import to_dot
from fluidps.transpiler import DistributeTranspiler, DistributeTranspilerConfig
from fluidps.transpiler.config import MODES, SPLIT_METHODS


@click.command()
@click.argument("main_file", metavar="MAIN.pb")
@click.option("--startup", "startup_file", required=True, metavar="STARTUP.pb", help="The startup program.")
@click.option("--pservers", required=True, help="Comma-separated pserver endpoints, host:port.")
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
    startup_file: str,
    pservers: str,
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
    placement table (placement.txt, placement.json) into OUTPUT."""
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
    files = {f"{name}.pb": program.serialize_to_string() for name, program in programs.items()}
    files |= {f"{name}.dot": to_dot(program).encode() for name, program in programs.items()}
    files["placement.txt"] = (plan.summary() + "\n").encode()
    files["placement.json"] = (json.dumps(plan.to_dict(), indent=1) + "\n").encode()
    try:
        out.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            write_atomic(str(out / name), [data])
    except (OSError, Error) as e:
        fail(f"cannot write into {output}: {e}")
    click.echo(plan.summary())
    click.echo(f"wrote {len(programs)} programs (.pb and .dot) and placement.txt / placement.json into {out}")
