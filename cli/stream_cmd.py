"""`fluidps stream append / tail / info`: a segment log of records, from the shell."""

from __future__ import annotations

import json
import time

import click
import numpy as np

from fluidps.cli.common import fail
from fluidps.errors import Error
from fluidps.io.dataset import read_records
from fluidps.io.stream import Records
from fluidps.io.stream_log import StreamLog


@click.group()
def stream() -> None:
    """Streams of records a streaming job trains from (an append-only segment log)."""


@stream.command("append")
@click.argument("log", metavar="LOG")
@click.argument("source", metavar="INPUT")
@click.option("--field", help="The field name of a plain (unstructured) .npy INPUT.")
@click.option("--batch", type=click.IntRange(min=1), default=4096, show_default=True, help="Records a write.")
@click.option(
    "--segment-bytes",
    type=click.IntRange(min=17),
    help="Roll segments at this size (kept in the log's manifest).",
)
@click.option("--retain-bytes", type=click.IntRange(min=1), help="Retire old segments past this many bytes.")
@click.option("--retain-seconds", type=click.FloatRange(min=0, min_open=True), help="...or past this age.")
def append(
    log: str,
    source: str,
    field: str | None,
    batch: int,
    segment_bytes: int | None,
    retain_bytes: int | None,
    retain_seconds: float | None,
) -> None:
    """Append the records of INPUT (a .npz, .npy or .parquet file, or a dataset directory)
    to the segment log in LOG (created if missing), in order."""
    try:
        arrays = read_records(source, field)
        target = StreamLog(
            log, segment_bytes=segment_bytes, retain_bytes=retain_bytes, retain_seconds=retain_seconds
        )
        rows = len(next(iter(arrays.values())))
        first = last = None
        for start in range(0, rows, batch):
            offsets = target.append({name: a[start : start + batch] for name, a in arrays.items()})
            first = offsets[0] if first is None else first
            last = offsets[-1]
    except Error as e:
        fail(str(e))
    where = "nothing appended (no records)" if first is None else f"offsets {first}..{last}"
    click.echo(f"appended {rows:,} records to {log}: {where}")


@stream.command("tail")
@click.argument("log", metavar="LOG")
@click.option(
    "--from", "start", type=click.IntRange(min=0), help="The first offset (default: the last --count)."
)
@click.option("--count", type=click.IntRange(min=1), default=10, show_default=True, help="Records to print.")
@click.option("-f", "--follow", is_flag=True, help="Then keep printing records as they are appended.")
def tail(log: str, start: int | None, count: int, follow: bool) -> None:
    """Print records of LOG as JSON lines (offset, time, fields); records that fail their
    checks go to stderr with their offset."""
    try:
        source = _existing(log)
        end = source.end_offset()
        offset = max(end - count, source.start_offset()) if start is None else start
        records = source.read(offset, count)
        _print(records)
        if follow:
            for more in source.tail(records.next_offset):
                _print(more)
    except Error as e:
        fail(str(e))
    except KeyboardInterrupt:
        pass


@stream.command("info")
@click.argument("log", metavar="LOG")
def info(log: str) -> None:
    """Describe LOG: its fields, offsets, segments, retention, and each consumer group's
    committed offset and lag (records not yet committed)."""
    try:
        source = _existing(log)
        click.echo(source.describe())
        settings = source.settings
        retain = [f"{settings['retain_bytes']:,} bytes" if settings["retain_bytes"] else None,
                  f"{settings['retain_seconds']:g} s" if settings["retain_seconds"] else None]  # fmt: skip
        click.echo(
            f"segments roll at {settings['segment_bytes']:,} bytes; retention: "
            + (", ".join(r for r in retain if r) or "none (every record is kept)")
        )
        for base, file in source.segments():
            try:
                stat = file.stat()
            except FileNotFoundError:  # (retired since the listing)
                continue
            modified = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stat.st_mtime))
            click.echo(f"  {file.name}  from offset {base:>12,}  {stat.st_size:>14,} bytes  {modified}")
        end = source.end_offset()
        for group, committed in source.groups().items():
            click.echo(f"group {group}: committed {committed:,}, lag {end - committed:,}")
    except Error as e:
        fail(str(e))


def _existing(log: str) -> StreamLog:
    source = StreamLog(log)
    if source.fields is None:
        raise Error(f"{log} is not a stream log (no stream.json); `fluidps stream append` creates one")
    return source


def _print(records: Records) -> None:
    for i, offset in enumerate(records.offsets):
        fields = {name: _plain(a[i]) for name, a in records.fields.items()}
        click.echo(json.dumps({"offset": int(offset), "time": float(records.timestamps[i]), **fields}))
    for bad in records.bad:
        click.echo(f"bad record at offset {bad.offset}: {bad.reason}", err=True)


def _plain(value: np.ndarray) -> object:
    return value.tolist() if isinstance(value, np.ndarray) else value.item()
