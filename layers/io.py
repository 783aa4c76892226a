"""data: declare a variable the executor feeds; dataset_reader, stream_reader: or have the
program read it, from a dataset or a stream."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fluidps.errors import BuilderError
from fluidps.io.dataset import Dataset, Field
from fluidps.ir.types import VarType, to_numpy_dtype, to_vartype
from fluidps.ir.variable import Variable
from fluidps.layers.guard import current_programs
from fluidps.ops import REGISTRY


def data(
    name: str,
    shape: Sequence[int],
    dtype: Any = "float32",
    lod_level: int = 0,
    append_batch_size: bool = True,
    stop_gradient: bool = True,
) -> Variable:
    """A fed input. As in Fluid 1.x, `shape` excludes the batch dimension, which
    is prepended as -1 unless `append_batch_size=False` or a dimension is
    already -1. Fed arrays are checked against this shape and dtype."""
    main, _ = current_programs("fluidps.layers.data")
    shape = [int(d) for d in shape]
    if append_batch_size and all(d >= 0 for d in shape):
        shape = [-1, *shape]
    block = main.global_block()
    if name in block.vars:
        raise BuilderError(f"data: a variable named {name!r} already exists")
    return block.create_var(
        name,
        shape=shape,
        dtype=to_vartype(dtype),
        lod_level=lod_level,
        stop_gradient=stop_gradient,
        need_check_feed=True,
    )


def dataset_reader(
    dataset: str | os.PathLike | Dataset,
    feed_list: Sequence[Variable],
    batch_size: int,
    *,
    fields: Sequence[str] | None = None,
    passes: int = 1,
    records_per_task: int = 0,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> Variable:
    """Bind a reader of `dataset` to the data variables `feed_list`: each run of the
    main program then reads the next mini-batch into them itself, instead of being fed.

    The dataset (a directory of shards: fluidps.io.Dataset, `fluidps data split`) is
    read in tasks of `records_per_task` records (0: chosen from its size), `passes`
    times, each pass in a new order when `shuffle`. Field i of the dataset (`fields`,
    by default the variables' names) goes into `feed_list[i]`. Under a plain Executor
    the tasks come from a queue in the process; in a job with a coordinator (`fluidps
    launch --dataset`, or a RemoteExecutor) from the coordinator, which hands each
    task to one trainer and gives a failed trainer's task to another. When every pass
    is done the program raises fluidps.EOFException.

    As in Fluid, the reader's `read` op is the main program's first op: take
    `main.clone(for_test=True)` before adding a reader, or the test program reads too.
    """
    _reader_arguments("dataset_reader", batch_size)
    if passes < 1 or records_per_task < 0:
        raise BuilderError(
            f"dataset_reader: passes must be >= 1 and records_per_task >= 0, got {passes}, {records_per_task}"
        )
    opened = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
    fields = _bound_fields("dataset_reader", feed_list, fields, opened.fields, str(opened.path))
    attrs = {
        "dataset": str(opened.path.resolve()),
        "fields": fields,
        "batch_size": batch_size,
        "records_per_task": records_per_task,
        "passes": passes,
        "shuffle": shuffle,
        "seed": seed,
        "drop_last": drop_last,
    }
    return _append_reader("dataset_reader", "create_dataset_reader", attrs, feed_list)


def stream_reader(
    source: str,
    feed_list: Sequence[Variable],
    batch_size: int,
    *,
    fields: Sequence[str] | None = None,
    group: str = "trainers",
    window_records: int = 4096,
    window_seconds: float | None = None,
    follow: bool = True,
    dead_letters: str | os.PathLike | None = None,
) -> Variable:
    """Bind a reader of the stream `source` (`log:DIR`, a fluidps.io.StreamLog, or
    `redis://HOST:PORT/STREAM`) to the data variables `feed_list`: each run of the main
    program then reads the next mini-batch of the stream into them, as `dataset_reader`
    does a dataset's.

    The stream is read in windows of `window_records` records (or of what arrived
    within `window_seconds` of a window's first record, when given), from consumer group
    `group`'s committed offset on. A window's records are applied once its last batch's
    step has run; then the group's offset moves past it, so a job started again goes on
    where this one stopped. Under a plain Executor the windows are cut in this process;
    in a job with a coordinator the coordinator hands each window to one trainer.

    `follow=True` reads without end, waiting for records as they arrive, until
    `Executor.stop_streams()` (SIGTERM in a launched job) drains it: the window in hand
    finishes, then the program raises fluidps.EOFException. `follow=False` reads what
    the stream holds when reading starts (the last window shorter), then raises it.

    Records that fail their checks (a bad CRC, the wrong fields) are never trained on:
    each is appended to the dead-letter file `dead_letters` (JSON Lines: the stream,
    window, offset, reason and raw bytes; None: FLUIDPS_DEAD_LETTERS, which `fluidps
    launch` sets, else nowhere) and counted, and the reader says so on stderr.
    """
    from fluidps.io.stream import canonical_spec, check_group, open_stream

    _reader_arguments("stream_reader", batch_size)
    if window_records < 1 or (window_seconds is not None and not window_seconds > 0):
        raise BuilderError(
            f"stream_reader: window_records must be >= 1 and window_seconds > 0 or None, got "
            f"{window_records}, {window_seconds}"
        )
    check_group(group)
    source = canonical_spec(source)
    stream = open_stream(source)
    try:
        known = stream.fields  # (None until its first append: the read op checks then)
    finally:
        stream.close()
    fields = _bound_fields("stream_reader", feed_list, fields, known, source)
    attrs = {
        "source": source,
        "fields": fields,
        "batch_size": batch_size,
        "group": group,
        "window_records": window_records,
        "window_seconds": float(window_seconds or 0.0),
        "follow": follow,
        "dead_letters": os.path.abspath(dead_letters) if dead_letters is not None else "",
    }
    return _append_reader("stream_reader", "create_stream_reader", attrs, feed_list)


def _reader_arguments(layer: str, batch_size: int) -> None:
    _, startup = current_programs(f"fluidps.layers.{layer}")
    if startup is None:
        raise BuilderError(f"{layer} needs a startup program (program_guard(main, startup))")
    if batch_size < 1:
        raise BuilderError(f"{layer}: batch_size must be >= 1, got {batch_size}")


def _bound_fields(
    layer: str,
    feed_list: Sequence[Variable],
    fields: Sequence[str] | None,
    known: Mapping[str, Field] | None,
    where: str,
) -> list[str]:
    """The field each data variable of `feed_list` reads (`fields`, by default the
    variables' names), checked against the fields `where` holds (`known`; None: not
    known yet)."""
    main, _ = current_programs(f"fluidps.layers.{layer}")
    feed_list = list(feed_list)
    fields = list(fields) if fields is not None else [v.name for v in feed_list]
    if len(fields) != len(feed_list) or not feed_list:
        raise BuilderError(f"{layer}: {len(fields)} fields for {len(feed_list)} data variables")
    block = main.global_block()
    for var, name in zip(feed_list, fields, strict=True):
        if block.find_var(var.name) is not var:
            raise BuilderError(f"{layer}: {var.name!r} is not a variable of the main program")
        if known is None:
            continue
        field = known.get(name)
        if field is None:
            raise BuilderError(
                f"{layer}: {where} has no field {name!r} for {var.name!r} (its fields: {', '.join(known)})"
            )
        shape = var.shape or ()
        if to_numpy_dtype(var.dtype) != field.dtype or tuple(shape[1:]) != field.shape:
            raise BuilderError(
                f"{layer}: field {field.describe()} does not fit data variable {var.name!r} "
                f"{np.dtype(to_numpy_dtype(var.dtype))}{list(shape)} (one record per row)"
            )
    return fields


def _append_reader(
    layer: str, op_type: str, attrs: dict[str, Any], feed_list: Sequence[Variable]
) -> Variable:
    """The READER variable, made by `op_type` in the startup program and read by the main
    program's first op."""
    main, startup = current_programs(f"fluidps.layers.{layer}")
    assert startup is not None
    block = main.global_block()
    name = main.unique_name(layer)
    for program in (main, startup):
        program.global_block().create_var(name, type=VarType.READER, persistable=True)
    REGISTRY.append_op(startup.global_block(), op_type, {}, {"Out": [name]}, attrs)
    REGISTRY.append_op(block, "read", {"Reader": [name]}, {"Out": [v.name for v in feed_list]}, index=0)
    return block.var(name)
