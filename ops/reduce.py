"""mean, reduce_sum and reduce_mean.

A full reduction gives a 0-d tensor, as in Paddle 2.5+ (Fluid 1.x wrote [1];
verify treats the two as the same scalar).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from fluidps.ir.infer import InferContext, normalize_axis
from fluidps.ops.defs import Bool, Compat, In, Int, Ints, Out, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp
from fluidps.ops.registry import OpFamily

family = OpFamily("reduce")


@family.op(
    "mean",
    inputs=[In("X")],
    outputs=[Out("Out")],
    attrs=backend_hints("use_mkldnn", "use_onednn"),
    grad=GradSpec(inputs=("X",)),
)
def _infer_mean(ctx: InferContext) -> None:
    """Out = the mean of every element of X, a 0-d tensor."""
    ctx.set_output("Out", (), ctx.input("X").dtype)


def reduced_dims(ctx: InferContext, rank: int) -> list[int]:
    """The dimensions a reduce op reduces: all when reduce_all or dim is empty."""
    dims = ctx.attr("dim")
    if ctx.attr("reduce_all") or not dims:
        return list(range(rank))
    return sorted({normalize_axis(d, rank, ctx, "dim") for d in dims})


def _infer_reduce(ctx: InferContext) -> None:
    x = ctx.input("X")
    dims = set(reduced_dims(ctx, len(x.shape)))
    if ctx.attr("keep_dim"):
        shape = [1 if i in dims else d for i, d in enumerate(x.shape)]
    else:
        shape = [d for i, d in enumerate(x.shape) if i not in dims]
    ctx.set_output("Out", shape, x.dtype)


_REDUCE_ATTRS = (
    Ints("dim", [0]),
    Bool("keep_dim", False),
    Bool("reduce_all", False),
    Compat(Int("in_dtype", -1), hint="reduce with a dtype cast is not supported; cast first"),
    Compat(Int("out_dtype", -1), hint="reduce with a dtype cast is not supported; cast the result"),
    *backend_hints("use_mkldnn", "use_onednn"),
)

for _type in ("reduce_sum", "reduce_mean"):
    family.define(
        _type,
        inputs=[In("X")],
        outputs=[Out("Out")],
        attrs=_REDUCE_ATTRS,
        grad=GradSpec(inputs=("X",)),
        infer=_infer_reduce,
    )


# -- kernels -----------------------------------------------------------------------------
# A reduction runs on a (pre, n, post) view that sums over n. When the reduced
# dimensions are adjacent (one dim, reduce_all, a leading or trailing block)
# that view is a free reshape; otherwise X is transposed once so the reduced
# dimensions come last (post = 1). Sums accumulate in float64 and are stored in
# X's dtype.


@njit(cache=True)
def _reduce(x, scale):
    """out[i, k] = scale * sum_j x[i, j, k]."""
    pre, n, post = x.shape
    out = np.empty((pre, post), dtype=x.dtype)
    acc = np.zeros(post)
    for i in range(pre):
        acc[:] = 0.0
        for j in range(n):
            for k in range(post):
                acc[k] += x[i, j, k]
        for k in range(post):
            out[i, k] = acc[k] * scale
    return out


@njit(cache=True)
def _expand(dout, n, scale):
    """dx[i, j, k] = scale * dout[i, k]: the gradient of _reduce."""
    pre, post = dout.shape
    dx = np.empty((pre, n, post), dtype=dout.dtype)
    for i in range(pre):
        for j in range(n):
            for k in range(post):
                dx[i, j, k] = dout[i, k] * scale
    return dx


class _Plan:
    """How to view an X of `shape` reduced over `dims` as (pre, n, post)."""

    def __init__(self, shape: tuple[int, ...], dims: list[int]):
        self.shape = shape
        kept = [i for i in range(len(shape)) if i not in dims]
        if not dims or dims == list(range(dims[0], dims[-1] + 1)):
            self.perm = None
            first, last = (dims[0], dims[-1] + 1) if dims else (len(shape), len(shape))
            self.pre = math.prod(shape[:first])
            self.n = math.prod(shape[first:last])
            self.post = math.prod(shape[last:])
        else:
            self.perm = kept + dims
            self.pre, self.n, self.post = (
                math.prod(shape[i] for i in kept),
                math.prod(shape[i] for i in dims),
                1,
            )

    def view(self, x: np.ndarray) -> np.ndarray:
        if self.perm is not None:
            x = contiguous(x.transpose(self.perm))
        return x.reshape(self.pre, self.n, self.post)

    def unview(self, dx: np.ndarray) -> np.ndarray:
        """A (pre, n, post) array back in X's layout."""
        if self.perm is None:
            return dx.reshape(self.shape)
        dx = dx.reshape([self.shape[i] for i in self.perm]).transpose(np.argsort(self.perm))
        return contiguous(dx)


def _dims(op: KernelOp, rank: int) -> list[int]:
    """The reduced dimensions, as `reduced_dims` infers them (the attributes were checked then)."""
    dims = op.attr("dim")
    if op.attr("reduce_all") or not dims or rank == 0:
        return list(range(rank))
    return sorted({d + rank if d < 0 else d for d in dims})


def _scale(op_type: str, n: int) -> float:
    if op_type.startswith("reduce_sum"):
        return 1.0
    return 1.0 / n if n else float("nan")


@family.kernel("mean", "reduce_sum", "reduce_mean")
def _reduce_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")
    is_mean = op.type == "mean"
    keep_dim = False if is_mean else op.attr("keep_dim")

    def run(env: Env) -> None:
        x = contiguous(env[x_name])
        dims = list(range(x.ndim)) if is_mean else _dims(op, x.ndim)
        plan = _Plan(x.shape, dims)
        out = _reduce(plan.view(x), _scale(op.type, plan.n))
        if keep_dim:
            shape = [1 if i in dims else d for i, d in enumerate(x.shape)]
        else:
            shape = [d for i, d in enumerate(x.shape) if i not in dims]
        env[out_name] = out.reshape(shape)

    return run


@family.kernel("mean_grad", "reduce_sum_grad", "reduce_mean_grad")
def _reduce_grad_kernel(op: KernelOp) -> Runner:
    x_name, dout_name, dx_name = op.input("X"), op.input("Out@GRAD"), op.output("X@GRAD")
    is_mean = op.type == "mean_grad"

    def run(env: Env) -> None:
        shape = np.shape(env[x_name])
        dims = list(range(len(shape))) if is_mean else _dims(op, len(shape))
        plan = _Plan(shape, dims)
        dout = contiguous(env[dout_name]).reshape(plan.pre, plan.post)
        env[dx_name] = plan.unview(_expand(dout, plan.n, _scale(op.type, plan.n)))

    return run


@family.lowering("mean")
def _mean_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out")
    x = op.input("X")
    op.emit(
        f"{op.output('Out')} = {op.call(_reduce, f'{x}.reshape((1, {x}.size, 1))', f'1.0 / {x}.size')}.reshape(())"
    )


@family.lowering("mean_grad")
def _mean_grad_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out@GRAD", "X@GRAD")
    x, dout = op.input("X"), op.input("Out@GRAD")
    grad = op.call(_expand, f"{dout}.reshape((1, 1))", f"{x}.size", f"1.0 / {x}.size")
    op.emit(f"{op.output('X@GRAD')} = {grad}.reshape({x}.shape)")
