"""scale, sum and increment: the arithmetic autodiff and optimizers build on."""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext, numel
from fluidps.ir.opschema import GradContext, GradOpDesc
from fluidps.ir.types import EMPTY_VAR_NAME, VarType, to_numpy_dtype
from fluidps.ops.defs import Bool, Extra, Float, In, Out, backend_hints
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp, NotLowerable
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows, scatter_add

family = OpFamily("arith")


def _scale_grad(ctx: GradContext) -> list[GradOpDesc]:
    dx = ctx.input_grad("X")
    if not dx:
        return []
    attrs = {"scale": ctx.op.attr("scale"), "bias": 0.0, "bias_after_scale": True}
    return [GradOpDesc("scale", {"X": ctx.output_grad("Out")}, {"Out": dx}, attrs)]


@family.op(
    "scale",
    inputs=[In("X"), Extra("ScaleTensor")],
    outputs=[Out("Out")],
    attrs=[
        Float("scale", 1.0),
        Float("bias", 0.0),
        Bool("bias_after_scale", True),
        *backend_hints("use_mkldnn", "use_onednn"),
    ],
    grad=_scale_grad,
)
def _infer_scale(ctx: InferContext) -> None:
    """Out = scale * X + bias (or scale * (X + bias)); SelectedRows stay sparse."""
    ctx.share("Out", ctx.input("X"))


def _sum_grad(ctx: GradContext) -> list[GradOpDesc]:
    # d(sum)/dX_i is the identity: one scale-by-1 per wanted input, as Fluid does.
    dout = ctx.output_grad("Out")
    return [
        GradOpDesc("scale", {"X": dout}, {"Out": [dx]}, {"scale": 1.0, "bias": 0.0, "bias_after_scale": True})
        for dx in ctx.input_grad("X")
        if dx != EMPTY_VAR_NAME
    ]


@family.op(
    "sum",
    inputs=[In("X", dup=True)],
    outputs=[Out("Out")],
    attrs=[*backend_hints("use_mkldnn", "use_onednn", "mkldnn_data_type")],
    grad=_sum_grad,
)
def _infer_sum(ctx: InferContext) -> None:
    """Out = X_0 + X_1 + ...; all SelectedRows give SelectedRows (rows concatenated)."""
    xs = ctx.inputs("X")
    if not xs:
        ctx.fail("needs at least one input")
    shape = xs[0].shape
    for x in xs[1:]:
        if x.shape is not None and shape is not None and len(x.shape) != len(shape):
            ctx.fail(f"inputs must have the same shape, got {list(shape)} and {list(x.shape)}")
    all_sparse = all(x.type == VarType.SELECTED_ROWS for x in xs)
    kind = VarType.SELECTED_ROWS if all_sparse else VarType.LOD_TENSOR
    dense = next((x for x in xs if x.type == VarType.LOD_TENSOR), xs[0])
    ctx.set_output("Out", dense.shape, dense.dtype, type=kind)


@family.op("increment", inputs=[In("X")], outputs=[Out("Out")], attrs=[Float("step", 1.0)])
def _infer_increment(ctx: InferContext) -> None:
    """Out = X + step, for a one-element counter."""
    x = ctx.input("X")
    if numel(x.shape) not in (1, -1):
        ctx.fail(f"X must hold one element, got shape {list(x.shape)}")
    ctx.share("Out", x)


# -- kernels -----------------------------------------------------------------------------
# Attribute constants are converted to X's dtype first (Fluid's static_cast<T>),
# so float32 stays float32 inside the numba loops.


@njit(cache=True)
def _scale(x, scale, bias, bias_after_scale):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    if bias_after_scale:
        for i in range(xs.size):
            os[i] = scale * xs[i] + bias
    else:
        for i in range(xs.size):
            os[i] = scale * (xs[i] + bias)
    return out


@njit(cache=True)
def _add_into(acc, x):
    """acc += x over flat, equally long arrays."""
    for i in range(acc.size):
        acc[i] += x[i]


@njit(cache=True)
def _increment(x, step):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = xs[i] + step
    return out


def _scaled(x: np.ndarray, scale: float, bias: float, bias_after_scale: bool) -> np.ndarray:
    x = contiguous(x)
    cast = x.dtype.type
    return _scale(x, cast(scale), cast(bias), bias_after_scale)


@family.kernel("scale")
def _scale_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")
    scale, bias, after = op.attr("scale"), op.attr("bias"), op.attr("bias_after_scale")

    def run(env: Env) -> None:
        x = env[x_name]
        if isinstance(x, SelectedRows):
            env[out_name] = SelectedRows(x.rows.copy(), _scaled(x.value, scale, bias, after), x.height)
        else:
            env[out_name] = _scaled(x, scale, bias, after)

    return run


def _sum(values: list) -> np.ndarray | SelectedRows:
    sparse = [v for v in values if isinstance(v, SelectedRows)]
    dense = [v for v in values if not isinstance(v, SelectedRows)]
    if not dense:
        # Fluid concatenates sparse addends; duplicate rows are summed when used.
        return SelectedRows(
            np.concatenate([s.rows for s in sparse]),
            np.concatenate([s.value for s in sparse]),
            sparse[0].height,
        )
    out = np.array(dense[0], copy=True, order="C")
    flat = out.reshape(-1)
    for v in dense[1:]:
        v = contiguous(v)
        if v.shape != out.shape:
            raise ExecutionError(f"sum: inputs have shapes {list(out.shape)} and {list(v.shape)}")
        _add_into(flat, v.reshape(-1))
    if sparse:
        height = out.shape[0] if out.ndim else 0
        table = out.reshape(height, -1)
        for s in sparse:
            if s.height != height or s.value.size != s.rows.size * table.shape[1]:
                raise ExecutionError(f"sum: {s!r} does not fit a dense addend of shape {list(out.shape)}")
            value = contiguous(s.value).reshape(s.rows.size, table.shape[1])
            scatter_add(table, s.rows, value)
    return out


@family.kernel("sum")
def _sum_kernel(op: KernelOp) -> Runner:
    x_names = [n for n in op.inputs("X") if n != EMPTY_VAR_NAME]
    out_name = op.output("Out")

    def run(env: Env) -> None:
        env[out_name] = _sum([env[n] for n in x_names])

    return run


@family.kernel("increment")
def _increment_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")
    step = op.attr("step")

    def run(env: Env) -> None:
        x = contiguous(env[x_name])
        env[out_name] = _increment(x, x.dtype.type(step))

    return run


# -- lowerings: dense operands (a pserver's sum of trainers' gradients, a loss scale) -----------


@njit(cache=True)
def add_same_shape(acc, x):
    """acc += x for arrays of one shape; raises (numba checks no bounds) when they differ,
    so that the interpreter says which."""
    if acc.shape != x.shape:
        raise ValueError("sum: inputs of different shapes")
    _add_into(acc.reshape(-1), x.reshape(-1))


@family.lowering("scale")
def _scale_lowering(op: LoweringOp) -> None:
    op.require_dense("X", "Out")
    if op.has_input("ScaleTensor"):
        raise NotLowerable("its scale is a tensor")
    op.new_arrays()
    t = f"np.{to_numpy_dtype(op.declared_dtype('X')).name}"
    scale, bias = f"{t}({op.attr('scale')!r})", f"{t}({op.attr('bias')!r})"
    op.emit(
        f"{op.output('Out')} = {op.call(_scale, op.input('X'), scale, bias, repr(op.attr('bias_after_scale')))}"
    )


@family.lowering("sum")
def _sum_lowering(op: LoweringOp) -> None:
    xs = op.inputs("X")
    op.require_dense("X", "Out")
    out = op.output("Out")
    first = op.op.input("X")[0]
    if (
        op.op.output("Out") == [first]
        and op.variable(first).persistable
        and first not in op.op.input("X")[1:]
    ):
        # Persistable state summed into itself (a pipeline's gradient sums over micro-batches):
        # added in place, as an optimizer updates its parameter, in the kernel's order.
        for x in xs[1:]:
            op.emit(op.call(add_same_shape, out, x))
        return
    op.new_arrays()
    op.emit(f"{out} = {xs[0]}.copy()")  # as the kernel: the first addend, then the others in order
    for x in xs[1:]:
        op.emit(op.call(add_same_shape, out, x))
