"""`fluidps checkpoint list` and `fluidps checkpoint merge`: pserver checkpoints on disk."""

from __future__ import annotations

import click

from fluidps.cli.common import CHECK_FAILED, fail
from fluidps.errors import CheckpointError, Error
from fluidps.io.checkpoints import latest, merge_checkpoints, scan


@click.group()
def checkpoint() -> None:
    """Pserver checkpoints: check them, merge them into a whole model."""


@checkpoint.command("list")
@click.argument("directory", metavar="DIR")
def list_checkpoints(directory: str) -> None:
    """Every checkpoint in DIR, newest last, each verified against its checksum.
    Exits with 1 when one is corrupt or incomplete."""
    found = scan(directory)
    _, problems = latest(directory)
    unreadable = [p for p in problems if p.startswith("checkpoint manifest")]
    if not found and not unreadable:
        fail(f"{directory} holds no pserver checkpoint")
    bad = len(unreadable)
    for problem in unreadable:
        click.echo(f"BAD: {problem}")
    for c in found:
        try:
            c.load()
            state = "ok"
        except CheckpointError as e:
            state, bad = f"BAD: {e}", bad + 1
        click.echo(
            f"pserver {c.pserver_id} #{c.count:<4} step {c.step:<7} {c.reason:<10} {len(c.pieces):>3} vars "
            f"{c.data_bytes:>12,} bytes  {state}"
        )
    if bad:
        raise SystemExit(CHECK_FAILED)


@checkpoint.command("merge")
@click.argument("directory", metavar="DIR")
@click.option(
    "-o", "--output", required=True, type=click.Path(file_okay=False), help="Where to write the model."
)
def merge(directory: str, output: str) -> None:
    """Merge the newest intact checkpoint of every pserver in DIR into whole variables,
    one file each in Paddle's format, in OUTPUT: fluidps.io.load_persistables(exe,
    OUTPUT, main) loads them, into a job with any number of pservers."""
    try:
        values = merge_checkpoints(directory, output)
    except Error as e:
        fail(str(e))
    total = sum(v.nbytes for v in values.values())
    click.echo(f"wrote {len(values)} variables ({total:,} bytes) into {output}")
