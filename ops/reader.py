"""Reading data inside the program: a reader bound to `layers.data` variables, of a
dataset (create_dataset_reader) or of a stream (create_stream_reader).

As in Fluid's reader design, the startup program creates the reader (a
READER variable) and the main program's first op, `read`, fills the data
variables with the next mini-batch each time the program runs, instead of
the caller feeding them. The reader itself is the runtime's (`KernelOp.runtime.readers`,
fluidps.executor.tasks in fluidps): it reads a sharded dataset task by task, from
the job's coordinator when it has one, from a queue in this process otherwise;
a stream reader reads windows of a stream the same way (fluidps.executor.tasks.stream_reader).
When every pass is done, or the stream reader is stopped, `read` raises EOFException.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.ops.defs import Bool, Float, In, Int, Out, Str, Strs
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.registry import OpFamily

family = OpFamily("reader")


@dataclass(frozen=True)
class ReaderSpec:
    """What a reader reads: create_dataset_reader's attributes."""

    dataset: str
    fields: tuple[str, ...]
    batch_size: int
    records_per_task: int = 0  # 0: chosen from the dataset's size and the batch size
    passes: int = 1
    shuffle: bool = True
    seed: int = 0
    drop_last: bool = False


@family.op(
    "create_dataset_reader",
    outputs=[Out("Out")],
    attrs=[
        Str("dataset"),
        Strs("fields"),
        Int("batch_size", 1, lambda n: n >= 1, "batch_size must be >= 1"),
        Int("records_per_task", 0, lambda n: n >= 0, "records_per_task must be >= 0 (0: automatic)"),
        Int("passes", 1, lambda n: n >= 1, "passes must be >= 1"),
        Bool("shuffle", True),
        Int("seed", 0),
        Bool("drop_last", False),
    ],
)
def _infer_create(ctx: InferContext) -> None:
    """Out: a reader of `dataset`'s `fields`, `batch_size` records at a time."""
    if not ctx.attr("dataset") or not ctx.attr("fields"):
        ctx.fail("a dataset reader needs a dataset directory and at least one field")
    ctx.set_output("Out", (), None, type=VarType.READER)


@dataclass(frozen=True)
class StreamReaderSpec:
    """What a stream reader reads: create_stream_reader's attributes."""

    source: str  # open_stream's spec: log:DIR or redis://HOST:PORT/STREAM
    fields: tuple[str, ...]
    batch_size: int
    group: str = "trainers"
    window_records: int = 4096
    window_seconds: float | None = None  # None: windows close on their record count only
    follow: bool = True  # False: read what the stream holds when reading starts, then end
    dead_letters: str | None = None  # the records it cannot train on go there (None: FLUIDPS_DEAD_LETTERS)


@family.op(
    "create_stream_reader",
    outputs=[Out("Out")],
    attrs=[
        Str("source"),
        Strs("fields"),
        Int("batch_size", 1, lambda n: n >= 1, "batch_size must be >= 1"),
        Str("group", "trainers"),
        Int("window_records", 4096, lambda n: n >= 1, "window_records must be >= 1"),
        Float("window_seconds", 0.0, lambda s: s >= 0, "window_seconds must be >= 0 (0: by count only)"),
        Bool("follow", True),
        Str("dead_letters", ""),
    ],
)
def _infer_create_stream(ctx: InferContext) -> None:
    """Out: a reader of the stream `source`'s `fields`, in windows of `window_records`
    records (or of what arrived in `window_seconds`), `batch_size` records at a time."""
    if not ctx.attr("source") or not ctx.attr("fields"):
        ctx.fail(
            "a stream reader needs a stream (log:DIR or redis://HOST:PORT/STREAM) and at least one field"
        )
    ctx.set_output("Out", (), None, type=VarType.READER)


@family.op("read", inputs=[In("Reader")], outputs=[Out("Out", dup=True)], attrs=[Bool("throw_eof_exp", True)])
def _infer_read(ctx: InferContext) -> None:
    """Out_i: field i of the reader's next mini-batch (the data variables keep their
    declared shapes, with a batch dimension of -1)."""


@family.kernel("create_dataset_reader")
def _create_kernel(op: KernelOp) -> Runner:
    out = op.output("Out")
    spec = ReaderSpec(
        op.attr("dataset"),
        tuple(op.attr("fields")),
        op.attr("batch_size"),
        op.attr("records_per_task"),
        op.attr("passes"),
        op.attr("shuffle"),
        op.attr("seed"),
        op.attr("drop_last"),
    )

    readers = op.runtime.readers

    def run(env: Env) -> None:
        # Running the startup again starts reading afresh: the runtime closes the reader
        # this variable held (its task finished or given back).
        env[out] = readers.open(out, spec)

    return run


@family.kernel("create_stream_reader")
def _create_stream_kernel(op: KernelOp) -> Runner:
    out = op.output("Out")
    seconds = op.attr("window_seconds")
    spec = StreamReaderSpec(
        op.attr("source"),
        tuple(op.attr("fields")),
        op.attr("batch_size"),
        op.attr("group"),
        op.attr("window_records"),
        seconds if seconds > 0 else None,
        op.attr("follow"),
        op.attr("dead_letters") or None,
    )
    readers = op.runtime.readers

    def run(env: Env) -> None:
        env[out] = readers.open(out, spec)

    return run


@family.kernel("read")
def _read_kernel(op: KernelOp) -> Runner:
    reader_name, outs = op.input("Reader"), op.outputs("Out")
    block = op.op.block
    declared = {n: block.find_var(n) for n in outs}
    checked = False

    def run(env: Env) -> None:
        nonlocal checked
        reader = env.get(reader_name)
        if reader is None or not hasattr(reader, "next_batch"):
            raise ExecutionError(f"{reader_name!r} holds no reader: run the startup program first")
        if len(reader.spec.fields) != len(outs):
            raise ExecutionError(f"the reader has {len(reader.spec.fields)} fields for {len(outs)} outputs")
        batch = reader.next_batch()
        for name, field in zip(outs, reader.spec.fields, strict=True):
            value = batch[field]
            var = declared[name]
            if not checked and var is not None and var.dtype is not None:
                want = to_numpy_dtype(var.dtype)
                shape = var.shape or ()
                if (
                    value.dtype != want
                    or len(value.shape) != len(shape)
                    or any(d >= 0 and d != s for d, s in zip(shape, value.shape, strict=True))
                ):
                    raise ExecutionError(
                        f"dataset field {field!r} is {value.dtype}{list(value.shape[1:])} per record, but data "
                        f"variable {name!r} is {np.dtype(want)}{list(shape)}: store the field with that dtype "
                        "and shape, or declare the variable to match"
                    )
            env[name] = value
        checked = True

    return run
