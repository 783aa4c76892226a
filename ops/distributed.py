"""The ops the distribute transpiler inserts.

Trainer side: split_byref / split_selected_rows cut a gradient into the
row ranges the pservers own; send ships them (the transpiler puts one right
after each gradient's last writer; the runtime batches them per pserver);
send_barrier ends a step's sends (sync mode); recv pulls parameter slices;
fetch_barrier ends the step's receives; concat (ops.shape) puts a parameter
back together. How many messages these make is the runtime's business (the
barrier and the recv ride on the step's last send to each pserver).

Pserver side: listen_and_serv is the server loop. It receives gradients,
runs the optimize sub-blocks (one per parameter slice; grad_to_block_id says
which gradient feeds which), runs the learning-rate block once per step, and
serves parameters. In async and SSP modes each gradient has a queue: the
gradient's receive block `enqueue`s what arrives, its optimize block
`dequeue`s and applies it.

Here are their definitions, the kernels of the two local ones (the splits),
and the kernels of the others, which hand the work to the runtime the
executor gives them (`fluidps.ops.runtime_api`).
"""

from __future__ import annotations

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ir.types import DISTRIBUTED_MODES, VarType
from fluidps.ops.defs import Blocks, Bool, Float, In, Int, Ints, Long, Longs, Out, Str, Strs
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.registry import OpFamily
from fluidps.ops.runtime_api import Communicate
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("distributed")

MODE_NAMES = DISTRIBUTED_MODES
MODE_NUMBERS = {name: number for number, name in DISTRIBUTED_MODES.items()}
SYNC = MODE_NUMBERS["sync"]

_RPC_ATTRS = (Strs("epmap", []), Int("trainer_id", 0))


def _rows_of(ctx: InferContext, x, attr: str) -> list[int]:
    sections = [int(s) for s in ctx.attr(attr)]
    if not sections or any(s <= 0 for s in sections):
        ctx.fail(f"{attr} must be positive row counts, got {sections}")
    if x.shape and x.shape[0] >= 0 and sum(sections) != x.shape[0]:
        ctx.fail(f"{attr} {sections} add up to {sum(sections)} rows, but X has {x.shape[0]}")
    if len(sections) != len(ctx.op.output("Out")):
        ctx.fail(f"{attr} has {len(sections)} sections but Out has {len(ctx.op.output('Out'))} variables")
    return sections


@family.op(
    "split_byref",
    inputs=[In("X")],
    outputs=[Out("Out", dup=True)],
    attrs=[Ints("sections"), Int("num", 0), Int("axis", 0)],
)
def _infer_split_byref(ctx: InferContext) -> None:
    """Out_i = rows [offset_i, offset_i + sections[i]) of X: a dense gradient cut
    into the slices the pservers own (Fluid splits by reference; fluidps by view)."""
    x = ctx.input("X")
    if ctx.attr("axis") != 0:
        ctx.fail("split_byref splits along dimension 0 only")
    for i, rows in enumerate(_rows_of(ctx, x, "sections")):
        ctx.set_output("Out", (rows, *x.shape[1:]), x.dtype, index=i)


@family.op(
    "split_selected_rows",
    inputs=[In("X")],
    outputs=[Out("Out", dup=True)],
    attrs=[Longs("height_sections")],
)
def _infer_split_selected_rows(ctx: InferContext) -> None:
    """Out_i holds the rows of the SelectedRows X that fall in slice i, renumbered
    from the slice's first row: only touched rows travel to each pserver."""
    x = ctx.input("X")
    if x.type != VarType.SELECTED_ROWS:
        ctx.fail(f"X must be a SelectedRows, got {x.type.name}")
    for i, rows in enumerate(_rows_of(ctx, x, "height_sections")):
        ctx.set_output("Out", (rows, *x.shape[1:]), x.dtype, index=i, type=VarType.SELECTED_ROWS)


family.define(
    "send",
    inputs=[In("X", dup=True)],
    outputs=[Out("Out", dup=True, opt=True)],
    attrs=[
        *_RPC_ATTRS,
        # The name each X has on its pserver (X may be a local alias).
        Strs("send_varnames", []),
        # Async mode: accumulate gradients locally and upload every n mini-batches.
        Int("send_interval", 1, lambda n: n >= 1, "send_interval must be >= 1"),
        Bool("sync_mode", True),
        # Gradients are held per pserver until this many bytes are, or until the step's
        # next exchange with it (0: sent at once); see DistributeTranspilerConfig.
        Int("bucket_bytes", 0, lambda n: n >= 0, "bucket_bytes must be >= 0"),
        # Async mode: the gradients go through the trainer's communicator thread, merged
        # by merge_mode ("sum" or "mean"); see DistributeTranspilerConfig.communicator.
        Bool("use_communicator", False),
        Str("merge_mode", "mean", lambda m: m in ("sum", "mean"), "merge_mode must be 'sum' or 'mean'"),
        Int("max_merge_var_num", 20, lambda n: n >= 1, "max_merge_var_num must be >= 1"),
        Int("send_queue_size", 20, lambda n: n >= 1, "send_queue_size must be >= 1"),
    ],
)

family.define(
    "recv",
    inputs=[In("X", dup=True, opt=True)],
    outputs=[Out("Out", dup=True)],
    attrs=[
        *_RPC_ATTRS,
        Strs("recv_varnames", []),
        # Async mode: download parameters every m mini-batches.
        Int("recv_interval", 1, lambda n: n >= 1, "recv_interval must be >= 1"),
        # SSP: how many steps this trainer may run ahead of the slowest one.
        Int("staleness", 0, lambda n: n >= 0, "staleness must be >= 0"),
        Bool("sync_mode", True),
        # Async mode: pulled by the trainer's communicator thread; the step takes the last
        # values it pulled and does not wait.
        Bool("use_communicator", False),
    ],
)

for _barrier in ("send_barrier", "fetch_barrier"):
    family.define(
        _barrier,
        inputs=[In("X", dup=True, opt=True)],
        outputs=[Out("Out", dup=True, opt=True)],
        attrs=[Strs("endpoints", []), Int("trainer_id", 0), Bool("half_async", False)],
    )

family.define(
    "listen_and_serv",
    inputs=[In("X", dup=True, opt=True)],
    attrs=[
        Str("endpoint"),
        Int("pserver_id", 0),
        Int("Fanin", 1, lambda n: n >= 1, "Fanin (the number of trainers) must be >= 1"),
        # One sub-block per parameter slice, and which gradient feeds which ("name:block").
        Blocks("optimize_blocks", []),
        Strs("grad_to_block_id", []),
        Strs("sparse_grad_to_param", []),
        # Blocks of distributed tables here: trainers PREFETCH their rows instead of pulling them.
        Strs("distributed_tables", []),
        Int(
            "distributed_mode",
            SYNC,
            lambda m: m in MODE_NAMES,
            "distributed_mode must be 0 (sync), 1 (async) or 4 (ssp)",
        ),
        Int("lr_decay_block_id", -1),
        Int("checkpoint_block_id", -1),
        # Async / SSP: the block that enqueues each arriving gradient.
        Strs("grad_to_queue_block_id", []),
        Int("staleness", 0),
        Long("rpc_timeout_ms", 30000),
        # Checkpoints: where, how often (0: never), how many to keep; FLUIDPS_CHECKPOINT_* override.
        Str("checkpoint_dir", ""),
        Int("checkpoint_every_steps", 0, lambda n: n >= 0, "checkpoint_every_steps must be >= 0"),
        Float("checkpoint_every_seconds", 0.0, lambda s: s >= 0, "checkpoint_every_seconds must be >= 0"),
        Int("checkpoint_keep", 3, lambda n: n >= 1, "checkpoint_keep must be >= 1"),
        # Of every n scheduled checkpoints the first is a base, the others deltas of it.
        Int("checkpoint_base_every", 1, lambda n: n >= 1, "checkpoint_base_every must be >= 1"),
        # What a checkpoint holds: each persistable variable here, the variable of the original
        # program it is (part of), and its first row there (-1: all of it).
        Strs("checkpoint_vars", []),
        Strs("checkpoint_origins", []),
        Longs("checkpoint_offsets", []),
        Longs("checkpoint_origin_rows", []),  # rows of each original variable (-1: a scalar)
    ],
)

family.define(
    "enqueue",
    inputs=[In("X")],
    attrs=[Str("queue_name")],
)


@family.op("dequeue", outputs=[Out("Out")], attrs=[Str("queue_name")])
def _infer_dequeue(ctx: InferContext) -> None:
    """Out = the oldest value in the named queue (blocking until one arrives)."""


# -- kernels of the local splits ---------------------------------------------------------


@family.kernel("split_byref")
def _split_byref_kernel(op: KernelOp) -> Runner:
    x_name, out_names = op.input("X"), op.outputs("Out")
    offsets = np.cumsum([0, *op.attr("sections")])

    def run(env: Env) -> None:
        x = contiguous(env[x_name])
        if x.shape[0] != offsets[-1]:
            raise ExecutionError(f"split_byref: X has {x.shape[0]} rows, sections cover {offsets[-1]}")
        for name, start, stop in zip(out_names, offsets[:-1], offsets[1:], strict=True):
            env[name] = x[start:stop]

    return run


@family.kernel("split_selected_rows")
def _split_selected_rows_kernel(op: KernelOp) -> Runner:
    x_name, out_names = op.input("X"), op.outputs("Out")
    offsets = np.cumsum([0, *op.attr("height_sections")])

    def run(env: Env) -> None:
        x = env[x_name]
        if not isinstance(x, SelectedRows):
            raise ExecutionError(f"split_selected_rows: {x_name!r} is not a SelectedRows")
        if x.height != offsets[-1]:
            raise ExecutionError(
                f"split_selected_rows: X has height {x.height}, sections cover {offsets[-1]}"
            )
        owner = np.searchsorted(offsets, x.rows, side="right") - 1
        for i, name in enumerate(out_names):
            mask = owner == i
            env[name] = SelectedRows(
                x.rows[mask] - offsets[i], x.value[mask], int(offsets[i + 1] - offsets[i])
            )

    return run


# -- kernels of the communication ops: they call the runtime the executor gives them ------
# (KernelOp.runtime, typed by fluidps.ops.runtime_api; ops never import the executor).


@family.kernel("send")
def _send_kernel(op: KernelOp) -> Runner:
    names = op.inputs("X")
    remote = op.attr("send_varnames") or names
    epmap, trainer_id, interval = op.attr("epmap"), op.attr("trainer_id"), op.attr("send_interval")
    bucket = op.attr("bucket_bytes")
    communicate = None
    if op.attr("use_communicator"):
        if op.attr("sync_mode"):
            raise ExecutionError("send: use_communicator is for async mode (sync_mode is set)")
        communicate = Communicate(
            op.attr("merge_mode"), op.attr("max_merge_var_num"), op.attr("send_queue_size")
        )
    if len(epmap) != len(names) or len(remote) != len(names):
        raise ExecutionError(f"send: {len(names)} variables but {len(epmap)} endpoints / {len(remote)} names")
    trainer = op.runtime.trainer

    def run(env: Env) -> None:
        # Async with send_interval n: the runtime uploads the mean of n steps' gradients
        # every n steps (it keeps the sum, so it survives this program being prepared again).
        items = list(zip(epmap, remote, [env[n] for n in names], strict=True))
        trainer.send(items, trainer_id, every=interval, bucket_bytes=bucket, communicate=communicate)

    return run


@family.kernel("recv")
def _recv_kernel(op: KernelOp) -> Runner:
    outs = op.outputs("Out")
    remote = op.attr("recv_varnames") or outs
    epmap, trainer_id, interval = op.attr("epmap"), op.attr("trainer_id"), op.attr("recv_interval")
    background = op.attr("use_communicator")
    if background and op.attr("sync_mode"):
        raise ExecutionError("recv: use_communicator is for async mode (sync_mode is set)")
    if len(epmap) != len(outs) or len(remote) != len(outs):
        raise ExecutionError(f"recv: {len(outs)} variables but {len(epmap)} endpoints / {len(remote)} names")
    trainer = op.runtime.trainer

    def run(env: Env) -> None:
        # Async with recv_interval m: downloads every m steps (and whenever nothing was yet).
        values = trainer.get(
            list(zip(epmap, remote, strict=True)), trainer_id, every=interval, background=background
        )
        for name, value in zip(outs, values, strict=True):
            env[name] = value

    return run


@family.kernel("send_barrier")
def _send_barrier_kernel(op: KernelOp) -> Runner:
    endpoints, trainer_id, trainer = op.attr("endpoints"), op.attr("trainer_id"), op.runtime.trainer
    trainer.in_sync_job(endpoints, trainer_id)  # (before a reader of its first step waits for a task)

    def run(env: Env) -> None:
        trainer.send_barrier(endpoints, trainer_id)

    return run


@family.kernel("fetch_barrier")
def _fetch_barrier_kernel(op: KernelOp) -> Runner:
    endpoints, trainer_id, trainer = op.attr("endpoints"), op.attr("trainer_id"), op.runtime.trainer

    def run(env: Env) -> None:
        trainer.fetch_barrier(endpoints, trainer_id)

    return run


@family.kernel("listen_and_serv")
def _listen_and_serv_kernel(op: KernelOp) -> Runner:
    host = op.runtime.pserver

    def run(env: Env) -> None:
        host.serve(op.op, env)

    return run


@family.kernel("enqueue")
def _enqueue_kernel(op: KernelOp) -> Runner:
    x_name, queue = op.input("X"), op.runtime.pserver.queue(op.attr("queue_name"))

    def run(env: Env) -> None:
        queue.put(env[x_name])

    return run


@family.kernel("dequeue")
def _dequeue_kernel(op: KernelOp) -> Runner:
    out_name, queue = op.output("Out"), op.runtime.pserver.queue(op.attr("queue_name"))

    def run(env: Env) -> None:
        env[out_name] = queue.pop()

    return run
