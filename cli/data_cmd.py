"""`fluidps data split` and `fluidps data info`: sharded datasets for coordinator tasks."""

from __future__ import annotations

import click
import numpy as np

from fluidps.cli.common import fail
from fluidps.errors import Error
from fluidps.io.dataset import Dataset, read_records


@click.group()
def data() -> None:
    """Datasets of records in shards, cut into tasks for a job's coordinator."""


@data.command("split")
@click.argument("source", metavar="INPUT")
@click.option("-o", "--output", required=True, type=click.Path(file_okay=False), help="A new directory.")
@click.option("--records-per-shard", required=True, type=click.IntRange(min=1), help="Records in each shard.")
@click.option(
    "--format", "fmt", type=click.Choice(["npz", "npy", "parquet"]), default="npz", show_default=True
)
@click.option("--field", help="The field name of a plain (unstructured) .npy INPUT.")
@click.option("--shuffle", is_flag=True, help="Shuffle the records before sharding.")
@click.option("--seed", type=int, default=0, show_default=True, help="The shuffle's seed.")
def split(
    source: str, output: str, records_per_shard: int, fmt: str, field: str | None, shuffle: bool, seed: int
) -> None:
    """Cut INPUT (a .npz, .npy or .parquet file of records, or a dataset directory)
    into shards of --records-per-shard records plus a manifest with their checksums."""
    try:
        arrays = read_records(source, field)
        if shuffle:
            order = np.random.default_rng(seed).permutation(len(next(iter(arrays.values()))))
            arrays = {name: a[order] for name, a in arrays.items()}
        dataset = Dataset.write(output, arrays, records_per_shard, fmt)
    except Error as e:
        fail(str(e))
    click.echo(f"wrote {dataset.describe()}")


@data.command("info")
@click.argument("directory", metavar="DIR")
@click.option("--records-per-task", type=click.IntRange(min=1), help="Also show how many tasks this makes.")
def info(directory: str, records_per_task: int | None) -> None:
    """Describe the dataset in DIR: fields, shards, records (and tasks)."""
    try:
        dataset = Dataset(directory)
        click.echo(dataset.describe())
        click.echo(f"fingerprint {dataset.fingerprint}")
        for shard in dataset.shards:
            click.echo(f"  {shard.file:<24} {shard.records:>10,} records  sha256 {shard.sha256 or '-'}")
        if records_per_task:
            click.echo(
                f"{len(dataset.tasks(records_per_task)):,} tasks of at most {records_per_task} records"
            )
    except Error as e:
        fail(str(e))
