"""data: declare a variable the executor feeds; dataset_reader: or have the program read it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from fluidps.errors import BuilderError
from fluidps.io.dataset import Dataset
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
    main, startup = current_programs("fluidps.layers.dataset_reader")
    if startup is None:
        raise BuilderError("dataset_reader needs a startup program (program_guard(main, startup))")
    if batch_size < 1 or passes < 1 or records_per_task < 0:
        raise BuilderError(
            f"dataset_reader: batch_size and passes must be >= 1 and records_per_task >= 0, got "
            f"{batch_size}, {passes}, {records_per_task}"
        )
    opened = dataset if isinstance(dataset, Dataset) else Dataset(dataset)
    feed_list = list(feed_list)
    fields = list(fields) if fields is not None else [v.name for v in feed_list]
    if len(fields) != len(feed_list) or not feed_list:
        raise BuilderError(f"dataset_reader: {len(fields)} fields for {len(feed_list)} data variables")
    block = main.global_block()
    for var, name in zip(feed_list, fields, strict=True):
        if block.find_var(var.name) is not var:
            raise BuilderError(f"dataset_reader: {var.name!r} is not a variable of the main program")
        field = opened.fields.get(name)
        if field is None:
            raise BuilderError(
                f"dataset_reader: {opened.path} has no field {name!r} for {var.name!r} "
                f"(its fields: {', '.join(opened.fields)})"
            )
        shape = var.shape or ()
        if to_numpy_dtype(var.dtype) != field.dtype or tuple(shape[1:]) != field.shape:
            raise BuilderError(
                f"dataset_reader: field {field.describe()} does not fit data variable {var.name!r} "
                f"{np.dtype(to_numpy_dtype(var.dtype))}{list(shape)} (one record per row)"
            )
    name = main.unique_name("dataset_reader")
    for program in (main, startup):
        program.global_block().create_var(name, type=VarType.READER, persistable=True)
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
    REGISTRY.append_op(startup.global_block(), "create_dataset_reader", {}, {"Out": [name]}, attrs)
    REGISTRY.append_op(block, "read", {"Reader": [name]}, {"Out": [v.name for v in feed_list]}, index=0)
    return block.var(name)
