"""Hashed (auto-growing) embedding tables: their creation, lookup and update ops.

- `hashed_table` (startup programs) creates the table, a SparseTable
  (fluidps.ops.sparse_table), from its settings; the variable is declared as a
  SELECTED_ROWS of shape [-1, dim]: it has no fixed number of rows.
- `lookup_sparse_table` (Paddle's name) reads the rows of int64 ids shaped [..., 1]
  (the last dimension is dropped, as lookup_table does); ids without a row read their
  initial values, and ids equal to padding_idx read zeros. Its gradient is a
  SelectedRows whose rows are the ids themselves (height 2^63 - 1).
- `sparse_table_update` applies that gradient with the table's row rule (sgd,
  adagrad, adam, ftrl): optimizer.minimize appends it for hashed tables, with the
  optimizer's hyper-parameters; the table's admission and eviction happen there.
"""

from __future__ import annotations

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext, numel
from fluidps.ir.types import EMPTY_VAR_NAME, VarType
from fluidps.ops.defs import Bool, Float, In, Int, Long, Only, Out, Str, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.hashed_table import RULES
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lookup_table import sparse_grad
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import HASHED_HEIGHT, SelectedRows
from fluidps.ops.sparse_table import INITIALIZERS, Rule, SparseTable, TableSettings

family = OpFamily("sparse_embedding")

_DEFAULTS = TableSettings(dim=1)


def _infer_table(ctx: InferContext) -> None:
    dtype = VarType.FP32 if ctx.attr("dtype") == "float32" else VarType.FP64
    ctx.set_output("Out", (-1, ctx.attr("dim")), dtype, type=VarType.SELECTED_ROWS)


family.define(
    "hashed_table",
    outputs=[Out("Out")],
    attrs=[
        Long("dim"),
        Only(Str("dtype", "float32"), "float32", "float64"),
        Only(Str("initializer", "uniform"), *INITIALIZERS),
        Float("init_a", _DEFAULTS.init_a),
        Float("init_b", _DEFAULTS.init_b),
        Long("seed", 0),
        Long("min_count", 1),
        Float("admit_probability", 1.0),
        Long("ttl_steps", 0),
        Float("score_decay", 1.0),
        Float("delete_threshold", 0.0),
        Long("shrink_every", 0),
        Long("max_rows", 0),
        Bool("evict_when_full", False),
        # Which shard of how many this table is (set by the distribute transpiler).
        Int("shard", 0),
        Int("shards", 1),
    ],
    infer=lambda ctx: _infer_table(ctx),
)


def settings_of(op) -> TableSettings:
    """A hashed_table op's settings (op: an Operator or a KernelOp)."""
    return TableSettings(**{name: op.attr(name) for name in TableSettings.names()})


@family.kernel("hashed_table")
def _hashed_table_kernel(op: KernelOp) -> Runner:
    out_name = op.output("Out")
    settings = settings_of(op).check(out_name)

    def run(env: Env) -> None:
        env[out_name] = SparseTable(out_name, settings)

    return run


# -- lookup --------------------------------------------------------------------------------


def _infer_grad(ctx: InferContext) -> None:
    dout = ctx.input("Out@GRAD")
    for name in ctx.op.output("W@GRAD"):
        if name != EMPTY_VAR_NAME:
            ctx.set_output("W@GRAD", (-1, dout.shape[-1]), dout.dtype, type=VarType.SELECTED_ROWS)


@family.op(
    "lookup_sparse_table",
    inputs=[In("W"), In("Ids")],
    outputs=[Out("Out")],
    attrs=[Long("padding_idx", -1), Bool("auto_grown_table", True), *backend_hints("is_test")],
    grad=GradSpec(inputs=("W", "Ids"), in_grads=("W",), infer=_infer_grad),
)
def _infer_lookup_sparse_table(ctx: InferContext) -> None:
    """Out[..., :] = the row of Ids[..., 0] (initial values for ids without one)."""
    w, ids = ctx.input("W"), ctx.input("Ids")
    if w.type != VarType.SELECTED_ROWS or len(w.shape) != 2:
        ctx.fail("W must be a hashed table (created by layers.sparse_embedding)")
    if ids.dtype is not None and ids.dtype not in (VarType.INT64, VarType.INT32):
        ctx.fail(f"Ids must be int64, got {ids.dtype.name}")
    if not ids.shape or ids.shape[-1] not in (1, -1):
        ctx.fail(f"Ids must have shape [..., 1], got {list(ids.shape)}")
    ctx.set_output("Out", (*ids.shape[:-1], w.shape[1]), w.dtype)


def hashed_ids(op_type: str, table: str, name: str, value) -> tuple[np.ndarray, tuple[int, ...]]:
    """Ids of a hashed-table lookup as flat int64 (>= 0 is checked by the table) and the
    shape the output keeps (the last dimension, 1, dropped)."""
    ids = np.asarray(value)
    if ids.dtype not in (np.int64, np.int32):
        raise ExecutionError(
            f"{op_type}: Ids {name!r} of hashed table {table!r} must be int64, got {ids.dtype}"
        )
    if not ids.shape or ids.shape[-1] != 1:
        raise ExecutionError(
            f"{op_type}: Ids {name!r} of hashed table {table!r} must have shape [..., 1], got {list(ids.shape)}"
        )
    return contiguous(ids, dtype=np.int64).reshape(-1), ids.shape[:-1]


def _table(op_type: str, name: str, env: Env) -> SparseTable:
    table = env[name]
    if not isinstance(table, SparseTable):
        raise ExecutionError(
            f"{op_type}: {name!r} holds {type(table).__name__}, not a hashed table: create it with "
            "layers.sparse_embedding and run the startup program"
        )
    return table


class _Padding:
    def __init__(self, op: KernelOp):
        pad = int(op.attr("padding_idx"))
        self.has_pad, self.pad = pad != -1, pad

    def real(self, ids: np.ndarray) -> np.ndarray:
        return ids[ids != self.pad] if self.has_pad else ids


@family.kernel("lookup_sparse_table")
def _lookup_kernel(op: KernelOp) -> Runner:
    w_name, ids_name, out_name = op.input("W"), op.input("Ids"), op.output("Out")
    padding = _Padding(op)

    def run(env: Env) -> None:
        table = _table(op.type, w_name, env)
        ids, shape = hashed_ids(op.type, w_name, ids_name, env[ids_name])
        real = table.check_ids(padding.real(ids), op.type)
        rows = table.lookup(real)
        if padding.has_pad:
            out = np.zeros((len(ids), table.dim), dtype=rows.dtype)
            out[ids != padding.pad] = rows
        else:
            out = rows
        env[out_name] = out.reshape((*shape, table.dim))

    return run


@family.kernel("lookup_sparse_table_grad")
def _lookup_grad_kernel(op: KernelOp) -> Runner:
    w_name, ids_name = op.input("W"), op.input("Ids")
    dout_name, dw_name = op.input("Out@GRAD"), op.output("W@GRAD")
    padding = _Padding(op)

    def run(env: Env) -> None:
        if dw_name is None:
            return
        ids, _ = hashed_ids(op.type, w_name, ids_name, env[ids_name])
        dout = contiguous(env[dout_name]).reshape(len(ids), -1)
        rows, value = sparse_grad(ids, dout, padding.has_pad, padding.pad)
        env[dw_name] = SelectedRows(rows, value, HASHED_HEIGHT)

    return run


# -- update --------------------------------------------------------------------------------


@family.op(
    "sparse_table_update",
    inputs=[In("Param"), In("Grad"), In("LearningRate")],
    outputs=[Out("ParamOut")],
    attrs=[
        Only(Str("rule", "sgd"), *RULES),
        Float("epsilon", 1e-6),
        Float("beta1", 0.9),
        Float("beta2", 0.999),
        Float("l1", 0.0),
        Float("l2", 0.0),
    ],
)
def _infer_sparse_table_update(ctx: InferContext) -> None:
    """Train the rows of the hashed table Param that Grad (a SelectedRows of ids) touches."""
    param, grad, lr = ctx.input("Param"), ctx.input("Grad"), ctx.input("LearningRate")
    if param.type != VarType.SELECTED_ROWS or grad.type != VarType.SELECTED_ROWS:
        ctx.fail("Param must be a hashed table and Grad a SelectedRows of its ids")
    if numel(lr.shape) not in (1, -1):
        ctx.fail(f"LearningRate must hold one value, got shape {list(lr.shape)}")
    ctx.share("ParamOut", param)


@family.kernel("sparse_table_update")
def _update_kernel(op: KernelOp) -> Runner:
    param, grad_name, lr_name = op.input("Param"), op.input("Grad"), op.input("LearningRate")
    out_name = op.output("ParamOut")
    rule = Rule(*(op.attr(a) for a in ("rule", "epsilon", "beta1", "beta2", "l1", "l2")))

    def run(env: Env) -> None:
        table = _table(op.type, param, env)
        grad = env[grad_name]
        if not isinstance(grad, SelectedRows):
            raise ExecutionError(
                f"{op.type}: Grad {grad_name!r} of hashed table {param!r} must be a SelectedRows"
            )
        ids = table.check_ids(grad.rows, f"{op.type} of {grad_name!r}")
        table.use_rule(rule)
        lr = float(np.asarray(env[lr_name]).reshape(-1)[0])
        table.update(ids, contiguous(grad.value).reshape(len(ids), -1), lr)
        env[out_name] = table

    return run
