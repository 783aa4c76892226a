"""mul and matmul: the matrix products fc and attention are built from."""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.ir.infer import InferContext, broadcast_dim, numel
from fluidps.ops.defs import Bool, Compat, Float, Floats, In, Int, Out, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp, dims, product, shape
from fluidps.ops.registry import OpFamily

family = OpFamily("matmul")


def _compatible(a: int, b: int) -> bool:
    return a == b or a < 0 or b < 0


@family.op(
    "mul",
    inputs=[In("X"), In("Y")],
    outputs=[Out("Out")],
    attrs=[
        Int("x_num_col_dims", 1),
        Int("y_num_col_dims", 1),
        # Quantization scales and output casts Paddle writes at neutral values.
        Compat(Float("scale_x", 1.0)),
        Compat(Floats("scale_y", [1.0])),
        Compat(Float("scale_out", 1.0)),
        Compat(Bool("force_fp32_output", False)),
        *backend_hints("use_mkldnn", "use_onednn"),
    ],
    grad=GradSpec(inputs=("X", "Y"), in_grads=("X", "Y")),
)
def _infer_mul(ctx: InferContext) -> None:
    """Out = flatten(X, x_num_col_dims) @ flatten(Y, y_num_col_dims), unflattened:
    Out.shape = X.shape[:x_num_col_dims] + Y.shape[y_num_col_dims:]."""
    x, y = ctx.input("X"), ctx.input("Y")
    xn, yn = ctx.attr("x_num_col_dims"), ctx.attr("y_num_col_dims")
    if not 0 < xn < len(x.shape):
        ctx.fail(f"x_num_col_dims={xn} must be in [1, rank(X)={len(x.shape)})")
    if not 0 < yn < len(y.shape):
        ctx.fail(f"y_num_col_dims={yn} must be in [1, rank(Y)={len(y.shape)})")
    inner_x, inner_y = numel(x.shape[xn:]), numel(y.shape[:yn])
    if not _compatible(inner_x, inner_y):
        ctx.fail(f"X flattened to [.., {inner_x}] cannot multiply Y flattened to [{inner_y}, ..]")
    ctx.set_output("Out", x.shape[:xn] + y.shape[yn:], x.dtype)


@family.op(
    "matmul",
    inputs=[In("X"), In("Y")],
    outputs=[Out("Out")],
    attrs=[
        Bool("transpose_X", False),
        Bool("transpose_Y", False),
        Float("alpha", 1.0),
        Compat(Int("head_number", 1), hint="multi-head matmul is not supported"),
        Compat(Bool("force_fp32_output", False)),
        *backend_hints("use_mkldnn", "use_onednn"),
    ],
    grad=GradSpec(inputs=("X", "Y"), in_grads=("X", "Y")),
)
def _infer_matmul(ctx: InferContext) -> None:
    """Out = alpha * op(X) @ op(Y), batched over leading dimensions (broadcast);
    a rank-1 X is a row vector and a rank-1 Y a column vector, dropped from Out."""
    x, y = ctx.input("X"), ctx.input("Y")
    xs, ys = list(x.shape), list(y.shape)
    if not xs or not ys:
        ctx.fail("matmul needs inputs of rank >= 1")
    x_vec, y_vec = len(xs) == 1, len(ys) == 1
    if x_vec:
        xs = [1, xs[0]]
    if y_vec:
        ys = [ys[0], 1]
    if ctx.attr("transpose_X") and not x_vec:
        xs[-1], xs[-2] = xs[-2], xs[-1]
    if ctx.attr("transpose_Y") and not y_vec:
        ys[-1], ys[-2] = ys[-2], ys[-1]
    if not _compatible(xs[-1], ys[-2]):
        ctx.fail(f"inner dimensions differ: {xs[-1]} vs {ys[-2]}")
    bx, by = xs[:-2], ys[:-2]
    rank = max(len(bx), len(by))
    bx, by = [1] * (rank - len(bx)) + bx, [1] * (rank - len(by)) + by
    batch = []
    for a, b in zip(bx, by, strict=True):
        d = broadcast_dim(a, b)
        if d is None:
            ctx.fail(f"batch dimensions {bx} and {by} do not broadcast")
        batch.append(d)
    out = batch + ([] if x_vec else [xs[-2]]) + ([] if y_vec else [ys[-1]])
    ctx.set_output("Out", out or [1], x.dtype)


# -- kernels -----------------------------------------------------------------------------
# np.dot inside numba calls BLAS (through SciPy), so a matrix product costs
# what numpy's does, without leaving compiled code for batched products.


@njit(cache=True)
def _gemm(a, b):
    return np.dot(a, b)


@njit(cache=True)
def _bmm(a, b):
    """(B, M, K) @ (B, K, N) -> (B, M, N) for C-contiguous batches."""
    out = np.empty((a.shape[0], a.shape[1], b.shape[2]), dtype=a.dtype)
    for i in range(a.shape[0]):
        out[i] = np.dot(a[i], b[i])
    return out


def _matrix(x: np.ndarray, num_col_dims: int) -> np.ndarray:
    rows = int(np.prod(x.shape[:num_col_dims], dtype=np.int64))
    cols = int(np.prod(x.shape[num_col_dims:], dtype=np.int64))  # (not -1: rows may be 0)
    return contiguous(x).reshape(rows, cols)


@family.kernel("mul")
def _mul_kernel(op: KernelOp) -> Runner:
    x_name, y_name, out_name = op.input("X"), op.input("Y"), op.output("Out")
    xn, yn = op.attr("x_num_col_dims"), op.attr("y_num_col_dims")

    def run(env: Env) -> None:
        x, y = env[x_name], env[y_name]
        out = _gemm(_matrix(x, xn), _matrix(y, yn))
        env[out_name] = out.reshape(x.shape[:xn] + y.shape[yn:])

    return run


@family.kernel("mul_grad")
def _mul_grad_kernel(op: KernelOp) -> Runner:
    x_name, y_name, dout_name = op.input("X"), op.input("Y"), op.input("Out@GRAD")
    dx_name, dy_name = op.output("X@GRAD"), op.output("Y@GRAD")
    xn, yn = op.attr("x_num_col_dims"), op.attr("y_num_col_dims")

    def run(env: Env) -> None:
        x, y, dout = env[x_name], env[y_name], env[dout_name]
        x2, y2 = _matrix(x, xn), _matrix(y, yn)
        d2 = contiguous(dout).reshape(x2.shape[0], y2.shape[1])
        if dx_name is not None:
            env[dx_name] = _gemm(d2, y2.T).reshape(x.shape)
        if dy_name is not None:
            env[dy_name] = _gemm(x2.T, d2).reshape(y.shape)

    return run


def _matrix_expr(op: LoweringOp, slot: str, num_col_dims: int) -> str:
    """`slot`'s local viewed as the matrix mul multiplies (as _matrix does)."""
    local, rank = op.input(slot), op.rank(slot)
    rows, cols = product(dims(local, range(num_col_dims))), product(dims(local, range(num_col_dims, rank)))
    return f"{local}.reshape(({rows}, {cols}))"


@family.lowering("mul")
def _mul_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Y", "Out")
    xn, yn = op.attr("x_num_col_dims"), op.attr("y_num_col_dims")
    x, y = op.input("X"), op.input("Y")
    product_ = op.call(_gemm, _matrix_expr(op, "X", xn), _matrix_expr(op, "Y", yn))
    out_shape = shape(dims(x, range(xn)) + dims(y, range(yn, op.rank("Y"))))
    op.emit(f"{op.output('Out')} = {product_}.reshape({out_shape})")


@family.lowering("mul_grad")
def _mul_grad_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Y", "Out@GRAD", "X@GRAD", "Y@GRAD")
    xn, yn = op.attr("x_num_col_dims"), op.attr("y_num_col_dims")
    x, y, dout = op.input("X"), op.input("Y"), op.input("Out@GRAD")
    x2, y2 = _matrix_expr(op, "X", xn), _matrix_expr(op, "Y", yn)
    rows, cols = product(dims(x, range(xn))), product(dims(y, range(yn, op.rank("Y"))))
    d2 = f"{dout}.reshape(({rows}, {cols}))"
    if (dx := op.output("X@GRAD")) is not None:
        op.emit(f"{dx} = {op.call(_gemm, d2, f'{y2}.T')}.reshape({x}.shape)")
    if (dy := op.output("Y@GRAD")) is not None:
        op.emit(f"{dy} = {op.call(_gemm, f'{x2}.T', d2)}.reshape({y}.shape)")


def _as_batched(m: np.ndarray, batch: tuple[int, ...]) -> np.ndarray:
    """m (..., R, C) broadcast to batch + (R, C), as a contiguous (B, R, C) array."""
    full = np.broadcast_to(m, batch + m.shape[-2:])
    return contiguous(full).reshape((-1, *m.shape[-2:]))


def _operands(x: np.ndarray, y: np.ndarray, tx: bool, ty: bool):
    """The effective matrices A = op(X), B = op(Y) and the shared batch shape."""
    a = x.reshape(1, -1) if x.ndim == 1 else (np.swapaxes(x, -1, -2) if tx else x)
    b = y.reshape(-1, 1) if y.ndim == 1 else (np.swapaxes(y, -1, -2) if ty else y)
    batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return a, b, batch


def _unbatch(g: np.ndarray, like: np.ndarray) -> np.ndarray:
    """Sum a (batch..., R, C) gradient over the batch dimensions `like` was broadcast along."""
    extra = g.ndim - like.ndim
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(i for i in range(g.ndim - 2) if like.shape[i] == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


@family.kernel("matmul")
def _matmul_kernel(op: KernelOp) -> Runner:
    x_name, y_name, out_name = op.input("X"), op.input("Y"), op.output("Out")
    tx, ty, alpha = op.attr("transpose_X"), op.attr("transpose_Y"), op.attr("alpha")

    def run(env: Env) -> None:
        x, y = env[x_name], env[y_name]
        a, b, batch = _operands(x, y, tx, ty)
        out = _bmm(_as_batched(a, batch), _as_batched(b, batch)).reshape((*batch, a.shape[-2], b.shape[-1]))
        if alpha != 1.0:
            out *= alpha
        dims = batch + ((a.shape[-2],) if x.ndim > 1 else ()) + ((b.shape[-1],) if y.ndim > 1 else ())
        env[out_name] = out.reshape(dims or (1,))

    return run


@family.kernel("matmul_grad")
def _matmul_grad_kernel(op: KernelOp) -> Runner:
    x_name, y_name, dout_name = op.input("X"), op.input("Y"), op.input("Out@GRAD")
    dx_name, dy_name = op.output("X@GRAD"), op.output("Y@GRAD")
    tx, ty, alpha = op.attr("transpose_X"), op.attr("transpose_Y"), op.attr("alpha")

    def run(env: Env) -> None:
        x, y, dout = env[x_name], env[y_name], env[dout_name]
        a, b, batch = _operands(x, y, tx, ty)
        m, n = a.shape[-2], b.shape[-1]
        d = _as_batched(np.asarray(dout).reshape((*batch, m, n)), batch)
        if alpha != 1.0:
            d = d * np.asarray(alpha, dtype=d.dtype)
        if dx_name is not None:
            da = _bmm(d, contiguous(np.swapaxes(_as_batched(b, batch), 1, 2)))
            da = da.reshape((*batch, m, a.shape[-1]))
            dx = _unbatch(np.swapaxes(da, -1, -2) if (tx and x.ndim > 1) else da, x if x.ndim > 1 else a)
            env[dx_name] = contiguous(dx).reshape(x.shape)
        if dy_name is not None:
            db = _bmm(contiguous(np.swapaxes(_as_batched(a, batch), 1, 2)), d)
            db = db.reshape((*batch, b.shape[-2], n))
            dy = _unbatch(np.swapaxes(db, -1, -2) if (ty and y.ndim > 1) else db, y if y.ndim > 1 else b)
            env[dy_name] = contiguous(dy).reshape(y.shape)

    return run
