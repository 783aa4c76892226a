"""lookup_table and lookup_table_v2: embedding lookups, with sparse gradients.

lookup_table (Fluid 1.x `layers.embedding`) takes ids shaped [..., 1] and
drops that last dimension; lookup_table_v2 (`fluid.embedding`, Paddle 2's
`embedding`) keeps every id dimension. With `is_sparse` the gradient of W is
a SelectedRows holding only the looked-up rows.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ir.types import EMPTY_VAR_NAME, VarType
from fluidps.ops.defs import Bool, Compat, Hint, In, Int, Long, Longs, Out, Str, Strs
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp, NotLowerable, dims, shape
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("lookup_table")

_ATTRS = (
    Bool("is_sparse", False),
    # A table sharded over pservers; the distribute transpiler reads this.
    Bool("is_distributed", False),
    # Rows equal to padding_idx look up zeros and get no gradient; -1 disables it.
    Long("padding_idx", -1),
    # Fluid 1.x remote-prefetch settings; fluidps places tables itself.
    Hint(Bool("remote_prefetch", False)),
    Compat(Longs("height_sections", []), hint="remote prefetch is not supported"),
    Compat(Strs("epmap", []), hint="remote prefetch is not supported"),
    Compat(Strs("table_names", []), hint="remote prefetch is not supported"),
    Hint(Int("trainer_id", 0)),
    Hint(Int("slot", 0)),
    Hint(Bool("grad_inplace", False)),
    Hint(Str("entry_config", "")),
)


def _infer_grad(ctx: InferContext) -> None:
    w = ctx.input("W")
    kind = VarType.SELECTED_ROWS if ctx.attr("is_sparse") else VarType.LOD_TENSOR
    for name in ctx.op.output("W@GRAD"):
        if name != EMPTY_VAR_NAME:
            ctx.set_output("W@GRAD", w.shape, w.dtype, type=kind)


_GRAD = GradSpec(inputs=("W", "Ids"), in_grads=("W",), infer=_infer_grad)


def _check(ctx: InferContext):
    w, ids = ctx.input("W"), ctx.input("Ids")
    if len(w.shape) != 2:
        ctx.fail(f"W must be a [rows, width] table, got shape {list(w.shape)}")
    if ids.dtype is not None and ids.dtype not in (VarType.INT64, VarType.INT32):
        ctx.fail(f"Ids must be int64 or int32, got {ids.dtype.name}")
    return w, ids


@family.op("lookup_table", inputs=[In("W"), In("Ids")], outputs=[Out("Out")], attrs=_ATTRS, grad=_GRAD)
def _infer_lookup_table(ctx: InferContext) -> None:
    """Out[..., :] = W[Ids[..., 0], :]; Ids' last dimension must be 1."""
    w, ids = _check(ctx)
    if not ids.shape or ids.shape[-1] not in (1, -1):
        ctx.fail(f"Ids must have shape [..., 1], got {list(ids.shape)}")
    ctx.set_output("Out", (*ids.shape[:-1], w.shape[1]), w.dtype)


@family.op("lookup_table_v2", inputs=[In("W"), In("Ids")], outputs=[Out("Out")], attrs=_ATTRS, grad=_GRAD)
def _infer_lookup_table_v2(ctx: InferContext) -> None:
    """Out[..., :] = W[Ids[...], :]."""
    w, ids = _check(ctx)
    ctx.set_output("Out", (*ids.shape, w.shape[1]), w.dtype)


# -- kernels -----------------------------------------------------------------------------
# Ids are flattened to one dimension and the table seen as [rows, width]; the
# loops touch only the looked-up rows, so a lookup into a million-row table
# costs what the batch costs. An id is checked before it is used: numba does
# not bounds-check, and a bad id would otherwise read or write past the table.


@njit(cache=True)
def first_bad_id(ids, rows, has_pad, pad):
    """Position of the first id outside [0, rows) that is not padding_idx, or -1."""
    for i in range(ids.shape[0]):
        r = ids[i]
        if (r < 0 or r >= rows) and not (has_pad and r == pad):
            return i
    return -1


@njit(cache=True)
def _gather(table, ids, has_pad, pad):
    out = np.empty((ids.shape[0], table.shape[1]), dtype=table.dtype)
    for i in range(ids.shape[0]):
        r = ids[i]
        if has_pad and r == pad:
            for j in range(table.shape[1]):
                out[i, j] = 0
        else:
            for j in range(table.shape[1]):
                out[i, j] = table[r, j]
    return out


@njit(cache=True)
def _scatter_grad(ids, dout, rows, has_pad, pad):
    """The dense table gradient: zeros, plus each looked-up row's output gradient."""
    dw = np.zeros((rows, dout.shape[1]), dtype=dout.dtype)
    for i in range(ids.shape[0]):
        r = ids[i]
        if has_pad and r == pad:
            continue
        for j in range(dout.shape[1]):
            dw[r, j] += dout[i, j]
    return dw


@njit(cache=True)
def sparse_grad(ids, dout, has_pad, pad):
    """(rows, value) of the SelectedRows table gradient, padding entries left out."""
    n = 0
    for i in range(ids.shape[0]):
        if not (has_pad and ids[i] == pad):
            n += 1
    rows = np.empty(n, dtype=np.int64)
    value = np.empty((n, dout.shape[1]), dtype=dout.dtype)
    k = 0
    for i in range(ids.shape[0]):
        if has_pad and ids[i] == pad:
            continue
        rows[k] = ids[i]
        for j in range(dout.shape[1]):
            value[k, j] = dout[i, j]
        k += 1
    return rows, value


class _Lookup:
    """What the forward and grad kernels share: names, padding, id checks."""

    def __init__(self, op: KernelOp):
        self.op_type = op.type.removesuffix("_grad")
        self.v1 = self.op_type == "lookup_table"
        self.w_name, self.ids_name = op.input("W"), op.input("Ids")
        pad = int(op.attr("padding_idx"))
        # -1 means "no padding" (Fluid's kNoPadding); a flag keeps an id of -1 an error.
        self.has_pad, self.pad = pad != -1, pad

    def ids(self, env: Env, rows: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """The ids as a flat int array (checked) and the id shape the output keeps."""
        ids = np.asarray(env[self.ids_name])
        if ids.dtype not in (np.int64, np.int32):
            raise ExecutionError(
                f"{self.op_type}: Ids {self.ids_name!r} must be int64 or int32, got {ids.dtype}"
            )
        shape = ids.shape
        if self.v1:
            if not shape or shape[-1] != 1:
                raise ExecutionError(
                    f"{self.op_type}: Ids {self.ids_name!r} must have shape [..., 1], got {list(shape)}"
                )
            shape = shape[:-1]
        flat = contiguous(ids).reshape(-1)
        bad = first_bad_id(flat, rows, self.has_pad, self.pad)
        if bad >= 0:
            raise ExecutionError(
                f"{self.op_type}: id {int(flat[bad])} in Ids {self.ids_name!r} is out of range for table "
                f"{self.w_name!r} of {rows} rows (ids must be in [0, {rows}))"
            )
        return flat, shape

    def table(self, env: Env) -> np.ndarray:
        w = np.asarray(env[self.w_name])
        if w.ndim != 2:
            raise ExecutionError(f"{self.op_type}: W {self.w_name!r} must be 2-D, got shape {list(w.shape)}")
        return w

    def table_shape(self, env: Env, op: KernelOp) -> tuple[int, int]:
        """W's [rows, width]; the grad op needs only the shape (Fluid does not even
        keep W's buffer for it), so a declared shape serves when W has no value."""
        if self.w_name in env:
            rows, width = self.table(env).shape
            return rows, width
        var = op.var(self.w_name)
        if var is None or var.shape is None or len(var.shape) != 2 or min(var.shape) < 0:
            raise ExecutionError(
                f"{op.type}: W {self.w_name!r} has no value and no known [rows, width] shape"
            )
        return int(var.shape[0]), int(var.shape[1])


@family.kernel("lookup_table", "lookup_table_v2")
def _lookup_kernel(op: KernelOp) -> Runner:
    spec, out_name = _Lookup(op), op.output("Out")

    def run(env: Env) -> None:
        w = spec.table(env)
        ids, shape = spec.ids(env, w.shape[0])
        out = _gather(contiguous(w), ids, spec.has_pad, spec.pad)
        env[out_name] = out.reshape((*shape, w.shape[1]))

    return run


@family.kernel("lookup_table_grad", "lookup_table_v2_grad")
def _lookup_grad_kernel(op: KernelOp) -> Runner:
    spec = _Lookup(op)
    dout_name, dw_name = op.input("Out@GRAD"), op.output("W@GRAD")
    is_sparse = bool(op.attr("is_sparse"))

    def run(env: Env) -> None:
        if dw_name is None:
            return
        rows, width = spec.table_shape(env, op)
        ids, _ = spec.ids(env, rows)
        dout = contiguous(env[dout_name]).reshape(ids.shape[0], width)
        if is_sparse:
            sel_rows, value = sparse_grad(ids, dout, spec.has_pad, spec.pad)
            env[dw_name] = SelectedRows(sel_rows, value, rows)
        else:
            env[dw_name] = _scatter_grad(ids, dout, rows, spec.has_pad, spec.pad)

    return run


@family.lowering("lookup_table", "lookup_table_v2")
def _lookup_lowering(op: LoweringOp) -> None:
    """The forward gather from a dense table; a bad id raises, and the interpreter then
    names it (its gradient, sparse or a dense scatter, runs interpreted)."""
    op.new_arrays()
    op.require_dense("W", "Ids", "Out")
    if op.declared_dtype("Ids") not in (VarType.INT64, VarType.INT32):
        raise NotLowerable("Ids are not int64 or int32")
    if op.rank("W") != 2:
        raise NotLowerable("W is not [rows, width]")
    w, ids, rank = op.input("W"), op.input("Ids"), op.rank("Ids")
    v1 = op.type == "lookup_table"
    kept = rank - 1 if v1 else rank  # v1's ids end in a dimension of 1
    if v1 and rank == 0:
        raise NotLowerable("v1 Ids without their last dimension of 1")
    pad = int(op.attr("padding_idx"))
    has_pad = pad != -1
    flat = op.temp()
    if v1:
        op.emit(f"if {ids}.shape[{rank - 1}] != 1:")
        op.emit("    raise ValueError('lookup_table: Ids must end in a dimension of 1')")
    op.emit(f"{flat} = np.ascontiguousarray({ids}).reshape(-1)")
    op.emit(f"if {op.call(first_bad_id, flat, f'{w}.shape[0]', str(has_pad), str(pad))} >= 0:")
    op.emit("    raise ValueError('lookup_table: an id out of range')")
    gathered = op.call(_gather, f"np.ascontiguousarray({w})", flat, str(has_pad), str(pad))
    op.emit(f"{op.output('Out')} = {gathered}.reshape({shape([*dims(ids, range(kept)), f'{w}.shape[1]'])})")
