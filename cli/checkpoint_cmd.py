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
    intact = set()  # (pserver, count) of the checkpoints that load
    for c in found:  # oldest first: a delta's base comes before it
        try:
            c.load()
            state = "ok"
            if c.base is not None and (c.pserver_id, c.base) not in intact:
                state = f"BAD: its base #{c.base} is missing or corrupt"
        except CheckpointError as e:
            state = f"BAD: {e}"
        if state == "ok":
            intact.add((c.pserver_id, c.count))
        else:
            bad += 1
        kind = "base" if c.base is None else f"delta of #{c.base}"
        click.echo(
            f"pserver {c.pserver_id} #{c.count:<4} step {c.step:<7} {c.reason:<10} {kind:<13} "
            f"{len(c.pieces):>3} vars {c.data_bytes:>12,} bytes  {state}"
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
