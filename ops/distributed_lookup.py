"""distributed_lookup_table: an embedding lookup into a table that lives on the pservers.

The distribute transpiler puts it where a lookup_table of a distributed table was
(`fluidps.transpiler.tables`). The table is cut into row blocks, block k
(`table_names[k]`, `height_sections[k]` rows) on pserver `endpoints[k]`. Each run
takes the batch's ids, keeps each id once, asks every pserver owning some of them
for their rows (one message per pserver, through the runtime's trainer channel)
and scatters the rows back to the batch's order. Its gradient op,
distributed_lookup_table_grad, gives the table's gradient as a SelectedRows of the
looked-up rows, exactly as lookup_table_grad with is_sparse does, without the
table: trainers never hold it. Ids equal to padding_idx read zeros and get no
gradient, as in lookup_table.
"""

from __future__ import annotations

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ir.types import EMPTY_VAR_NAME, VarType, to_numpy_dtype
from fluidps.ops.defs import In, Int, Long, Longs, Only, Out, Str, Strs
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lookup_table import first_bad_id, sparse_grad
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("distributed_lookup")

_ATTRS = (
    Str("table_name"),  # the table of the original program (for messages)
    Strs("table_names"),  # its blocks' variables on the pservers, in row order
    Strs("endpoints"),  # the pserver of each block
    Longs("height_sections"),  # rows of each block
    Long("padding_idx", -1),
    # lookup_table: ids shaped [..., 1]; lookup_table_v2: ids of any shape.
    Only(Str("lookup_table_version", "lookup_table"), "lookup_table", "lookup_table_v2"),
    Int("trainer_id", 0),
)


def _check(ctx: InferContext) -> list[int]:
    names, endpoints = ctx.attr("table_names"), ctx.attr("endpoints")
    sections = [int(s) for s in ctx.attr("height_sections")]
    if not names or len(endpoints) != len(names) or len(sections) != len(names):
        ctx.fail(
            f"table_names, endpoints and height_sections must have one entry per block, got "
            f"{len(names)}, {len(endpoints)} and {len(sections)}"
        )
    if any(s <= 0 for s in sections):
        ctx.fail(f"height_sections must be positive row counts, got {sections}")
    if len(ctx.op.input("Ids")) != len(ctx.op.output("Outputs")):
        ctx.fail("Ids and Outputs must have as many variables each")
    return sections


def _infer_grad(ctx: InferContext) -> None:
    sections = _check_grad(ctx)
    douts = ctx.inputs("Outputs@GRAD")
    width = douts[0].shape[-1] if douts and douts[0].shape else -1
    for name in ctx.op.output("W@GRAD"):
        if name != EMPTY_VAR_NAME:
            ctx.set_output("W@GRAD", (sum(sections), width), douts[0].dtype, type=VarType.SELECTED_ROWS)


def _check_grad(ctx: InferContext) -> list[int]:
    sections = [int(s) for s in ctx.attr("height_sections")]
    if not sections or any(s <= 0 for s in sections):
        ctx.fail(f"height_sections must be positive row counts, got {sections}")
    return sections


_GRAD = GradSpec(inputs=("Ids",), out_grads=("Outputs",), in_grads=("W",), infer=_infer_grad)


@family.op(
    "distributed_lookup_table",
    # W is Fluid's slot; the transpiler leaves it empty, as trainers never hold the table.
    inputs=[In("Ids", dup=True), In("W", opt=True)],
    outputs=[Out("Outputs", dup=True)],
    attrs=_ATTRS,
    grad=_GRAD,
)
def _infer_distributed_lookup_table(ctx: InferContext) -> None:
    """Outputs[i] = the table's rows of Ids[i] (shaped as lookup_table_version says)."""
    _check(ctx)
    v1 = ctx.attr("lookup_table_version") == "lookup_table"
    for i, (ids, out_name) in enumerate(zip(ctx.inputs("Ids"), ctx.op.output("Outputs"), strict=True)):
        if ids.dtype is not None and ids.dtype not in (VarType.INT64, VarType.INT32):
            ctx.fail(f"Ids must be int64 or int32, got {ids.dtype.name}")
        out = ctx.lookup(out_name)  # declared with the table's width and dtype
        if out is None or not out.shape or ids.shape is None:
            ctx.fail(f"Outputs {out_name!r} must be declared with the table's width")
        shape = ids.shape[:-1] if v1 else ids.shape
        ctx.set_output("Outputs", (*shape, out.shape[-1]), out.dtype, index=i)


# -- kernels -----------------------------------------------------------------------------


class _Blocks:
    """What the forward and grad kernels share: the table's blocks, padding, id checks."""

    def __init__(self, op: KernelOp):
        self.op_type = op.type.removesuffix("_grad")
        self.table = op.attr("table_name")
        self.names, self.endpoints = list(op.attr("table_names")), list(op.attr("endpoints"))
        self.offsets = np.cumsum([0, *op.attr("height_sections")]).astype(np.int64)
        self.height = int(self.offsets[-1])
        self.v1 = op.attr("lookup_table_version") == "lookup_table"
        pad = int(op.attr("padding_idx"))
        self.has_pad, self.pad = pad != -1, pad
        self.trainer_id = op.attr("trainer_id")

    def ids(self, env: Env, name: str) -> tuple[np.ndarray, tuple[int, ...]]:
        """The ids of `name`, flat and checked, and the shape an output keeps."""
        ids = np.asarray(env[name])
        if ids.dtype not in (np.int64, np.int32):
            raise ExecutionError(
                f"{self.op_type}: Ids {name!r} of table {self.table!r} must be int64 or int32, got {ids.dtype}"
            )
        shape = ids.shape
        if self.v1:
            if not shape or shape[-1] != 1:
                raise ExecutionError(
                    f"{self.op_type}: Ids {name!r} of table {self.table!r} must have shape [..., 1], "
                    f"got {list(shape)}"
                )
            shape = shape[:-1]
        flat = contiguous(ids, dtype=np.int64).reshape(-1)
        bad = first_bad_id(flat, self.height, self.has_pad, self.pad)
        if bad >= 0:
            raise ExecutionError(
                f"{self.op_type}: id {int(flat[bad])} in Ids {name!r} is out of range for the distributed "
                f"table {self.table!r} of {self.height} rows: ids must be in [0, {self.height}); "
                "map raw feature ids into the table (or use a bigger table)"
            )
        return flat, shape


@family.kernel("distributed_lookup_table")
def _distributed_lookup_kernel(op: KernelOp) -> Runner:
    spec = _Blocks(op)
    ids_names, out_names = op.inputs("Ids"), op.outputs("Outputs")
    declared = op.var(out_names[0])
    if declared is None or not declared.shape or declared.shape[-1] < 1 or declared.dtype is None:
        raise ExecutionError(f"{op.type}: Outputs {out_names[0]!r} needs a declared width and dtype")
    width, dtype = int(declared.shape[-1]), to_numpy_dtype(declared.dtype)
    trainer = op.runtime.trainer

    def run(env: Env) -> None:
        checked = [spec.ids(env, name) for name in ids_names]
        flat = np.concatenate([ids for ids, _ in checked]) if len(checked) > 1 else checked[0][0]
        wanted = flat[flat != spec.pad] if spec.has_pad else flat
        unique, inverse = np.unique(wanted, return_inverse=True)
        cuts = np.searchsorted(unique, spec.offsets)  # unique[cuts[k]:cuts[k+1]] live in block k
        blocks = [k for k in range(len(spec.names)) if cuts[k + 1] > cuts[k]]
        items = [
            (spec.endpoints[k], spec.names[k], unique[cuts[k] : cuts[k + 1]] - spec.offsets[k])
            for k in blocks
        ]
        rows = np.empty((len(unique), width), dtype=dtype)
        replies = trainer.prefetch(items, spec.trainer_id) if items else []
        for k, (endpoint, name, asked), got in zip(blocks, items, replies, strict=True):
            if got.shape != (len(asked), width) or got.dtype != dtype:
                raise ExecutionError(
                    f"{op.type}: pserver {endpoint} answered {got.dtype}{list(got.shape)} for {len(asked)} rows of "
                    f"{name!r} (table {spec.table!r}), expected {np.dtype(dtype)}{[len(asked), width]}: "
                    "the pserver's program does not match this trainer's; transpile them together"
                )
            rows[cuts[k] : cuts[k + 1]] = got
        if spec.has_pad:
            gathered = np.zeros((len(flat), width), dtype=dtype)
            gathered[flat != spec.pad] = rows[inverse.reshape(-1)]
        else:
            gathered = rows[inverse.reshape(-1)]
        start = 0
        for out_name, (ids, shape) in zip(out_names, checked, strict=True):
            env[out_name] = gathered[start : start + len(ids)].reshape((*shape, width))
            start += len(ids)

    return run


@family.kernel("distributed_lookup_table_grad")
def _distributed_lookup_grad_kernel(op: KernelOp) -> Runner:
    spec = _Blocks(op)
    ids_names, dout_names, dw_name = op.inputs("Ids"), op.inputs("Outputs@GRAD"), op.output("W@GRAD")

    def run(env: Env) -> None:
        if dw_name is None:
            return
        ids = [spec.ids(env, name)[0] for name in ids_names]
        douts = [contiguous(env[name]).reshape(len(i), -1) for name, i in zip(dout_names, ids, strict=True)]
        flat = np.concatenate(ids) if len(ids) > 1 else ids[0]
        dout = np.concatenate(douts) if len(douts) > 1 else douts[0]
        rows, value = sparse_grad(flat, contiguous(dout), spec.has_pad, spec.pad)
        env[dw_name] = SelectedRows(rows, value, spec.height)

    return run
