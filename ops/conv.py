"""conv2d: 2-D convolution over NCHW tensors with groups, strides, dilations, padding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ops.defs import Bool, Compat, Extra, Hint, In, Int, Ints, Only, Out, Str, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.registry import OpFamily

family = OpFamily("conv")

LAYOUTS = ("NCHW", "AnyLayout")


def resolve_paddings(
    algorithm: str,
    paddings: Sequence[int],
    in_hw: Sequence[int],
    kernel_hw: Sequence[int],
    strides: Sequence[int],
) -> list[int]:
    """[top, bottom, left, right] for `padding_algorithm`: EXPLICIT takes `paddings`
    ([h, w] or [top, bottom, left, right]); SAME pads so that output = ceil(input /
    stride), the extra unit at the end; VALID pads nothing. As in Fluid, SAME sizes
    the padding with the undilated kernel (and conv2d then runs undilated, see
    `effective_dilations`). Unknown (negative) input sizes get no padding.
    Raises ValueError for a paddings list of another length."""
    if algorithm == "VALID":
        return [0, 0, 0, 0]
    if algorithm == "SAME":
        pads = []
        for size, k, s in zip(in_hw, kernel_hw, strides, strict=True):
            if size < 0:
                pads += [0, 0]
                continue
            out = -(-size // s)
            total = max((out - 1) * s + k - size, 0)
            pads += [total // 2, total - total // 2]
        return pads
    paddings = list(paddings)
    if len(paddings) == 2:
        return [paddings[0], paddings[0], paddings[1], paddings[1]]
    if len(paddings) == 4:
        return paddings
    raise ValueError(f"paddings must have 2 or 4 values, got {paddings}")


def effective_dilations(algorithm: str, dilations: Sequence[int]) -> list[int]:
    """Fluid resets the dilations to 1 when padding_algorithm is SAME."""
    return [1, 1] if algorithm == "SAME" else list(dilations)


def explicit_paddings(ctx: InferContext, in_hw, kernel_hw, strides, dilations=(1, 1)) -> list[int]:
    """`resolve_paddings` with the op's attributes; a bad paddings list fails inference.
    (`dilations` is accepted for compatibility: SAME ignores them, as in Fluid.)"""
    given = ctx.attr("paddings")
    if any(p < 0 for p in given):
        ctx.fail(f"paddings={given} must be >= 0 (a window cannot start inside the input's edge)")
    try:
        return resolve_paddings(
            ctx.attr("padding_algorithm"), ctx.attr("paddings"), in_hw, kernel_hw, strides
        )
    except ValueError as e:
        ctx.fail(str(e))


def window_output(
    size: int, kernel: int, stride: int, pad: tuple[int, int], dilation: int = 1, ceil: bool = False
) -> int:
    """Output length of a sliding window; -1 if the input length is unknown."""
    if size < 0:
        return -1
    span = size + pad[0] + pad[1] - (dilation * (kernel - 1) + 1)
    return (span + (stride - 1 if ceil else 0)) // stride + 1


@family.op(
    "conv2d",
    inputs=[In("Input"), In("Filter"), Extra("Bias"), Extra("ResidualData")],
    outputs=[Out("Output")],
    attrs=[
        Ints("strides", [1, 1]),
        Ints("paddings", [0, 0]),
        Only(Str("padding_algorithm", "EXPLICIT"), "EXPLICIT", "SAME", "VALID"),
        Int("groups", 1),
        Ints("dilations", [1, 1]),
        Only(Str("data_format", "NCHW"), *LAYOUTS, hint="only NCHW is supported"),
        Hint(Bool("exhaustive_search", False)),
        Hint(Int("workspace_size_MB", 512)),
        Compat(Bool("fuse_relu_before_depthwise_conv", False)),
        Compat(Bool("use_addto", False)),
        *backend_hints(
            "is_test", "use_cudnn", "use_mkldnn", "use_onednn", "use_quantizer", "mkldnn_data_type"
        ),
    ],
    grad=GradSpec(inputs=("Input", "Filter"), out_grads=("Output",), in_grads=("Input", "Filter")),
)
def _infer_conv2d(ctx: InferContext) -> None:
    """Output[n, m] = sum over the group's channels of Input[n, c] correlated with Filter[m, c]."""
    x, w = ctx.input("Input"), ctx.input("Filter")
    if len(x.shape) != 4 or len(w.shape) != 4:
        ctx.fail("Input and Filter must be 4-D (NCHW and [out_c, in_c / groups, kh, kw])")
    groups = ctx.attr("groups")
    strides, dilations = ctx.attr("strides"), ctx.attr("dilations")
    if groups < 1 or len(strides) != 2 or len(dilations) != 2 or min(strides + dilations) < 1:
        ctx.fail(f"bad groups={groups}, strides={strides} or dilations={dilations}")
    channels = x.shape[1]
    if channels >= 0 and channels != w.shape[1] * groups:
        ctx.fail(f"Input has {channels} channels but Filter expects {w.shape[1]} x groups {groups}")
    if w.shape[0] % groups:
        ctx.fail(f"Filter's {w.shape[0]} output channels do not divide into {groups} groups")
    pads = explicit_paddings(ctx, x.shape[2:], w.shape[2:], strides)
    dilations = effective_dilations(ctx.attr("padding_algorithm"), dilations)
    out_hw = [
        window_output(
            x.shape[2 + i], w.shape[2 + i], strides[i], (pads[2 * i], pads[2 * i + 1]), dilations[i]
        )
        for i in range(2)
    ]
    if any(0 <= d < 1 for d in out_hw):
        ctx.fail(f"the kernel is larger than the padded input (output would be {out_hw})")
    ctx.set_output("Output", (x.shape[0], w.shape[0], *out_hw), x.dtype)


# -- kernels -----------------------------------------------------------------------------
# im2col + GEMM. A chunk of samples is unrolled into col [cg*kh*kw, nb*oh*ow] (one
# column block per sample) so each group costs one large BLAS call (np.dot inside
# numba goes to SciPy's BLAS) instead of one small call per sample; the chunk caps
# col's size so big images do not blow up memory.

_COL_ELEMENTS = 1 << 21  # largest col buffer, in elements, before samples are chunked


@njit(cache=True)
def _valid_range(offset, stride, size, out_len):
    """[lo, hi): the output positions o with 0 <= o * stride + offset < size."""
    lo = max(0, -(offset // stride))  # ceil(-offset / stride)
    hi = min(out_len, (size - 1 - offset) // stride + 1)
    return lo, max(lo, hi)


@njit(cache=True)
def _im2col(x, n0, nb, c0, cg, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, col):
    """col[(c, i, j), (b, y, z)] = x[n0 + b, c0 + c, y*sh - pt + i*dh, z*sw - pl + j*dw]
    (zero where that falls in the padding)."""
    height, width = x.shape[2], x.shape[3]
    ohw = oh * ow
    for c in range(cg):
        for i in range(kh):
            for j in range(kw):
                row = col[(c * kh + i) * kw + j]
                off = j * dw - pl
                lo, hi = _valid_range(off, sw, width, ow)
                for b in range(nb):
                    img = x[n0 + b, c0 + c]
                    for y in range(oh):
                        base = b * ohw + y * ow
                        h = y * sh - pt + i * dh
                        if h < 0 or h >= height:
                            row[base : base + ow] = 0
                            continue
                        src = img[h]
                        row[base : base + lo] = 0
                        for z in range(lo, hi):
                            row[base + z] = src[z * sw + off]
                        row[base + hi : base + ow] = 0


@njit(cache=True)
def _col2im(col, n0, nb, c0, cg, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, dx):
    """The adjoint of _im2col: adds col back onto the pixels it was read from."""
    height, width = dx.shape[2], dx.shape[3]
    ohw = oh * ow
    for c in range(cg):
        for i in range(kh):
            for j in range(kw):
                row = col[(c * kh + i) * kw + j]
                off = j * dw - pl
                lo, hi = _valid_range(off, sw, width, ow)
                for b in range(nb):
                    img = dx[n0 + b, c0 + c]
                    for y in range(oh):
                        h = y * sh - pt + i * dh
                        if h < 0 or h >= height:
                            continue
                        base = b * ohw + y * ow
                        dst = img[h]
                        for z in range(lo, hi):
                            dst[z * sw + off] += row[base + z]


@njit(cache=True)
def _gather_out_grad(d3, n0, nb, m0, mg):
    """dOut's channels [m0, m0 + mg) of samples [n0, n0 + nb) as [mg, nb*oh*ow]."""
    ohw = d3.shape[2]
    d = np.empty((mg, nb * ohw), dtype=d3.dtype)
    for b in range(nb):
        for m in range(mg):
            d[m, b * ohw : (b + 1) * ohw] = d3[n0 + b, m0 + m]
    return d


@njit(cache=True)
def _conv2d(x, w, groups, sh, sw, pt, pl, dh, dw, oh, ow, chunk):
    n, m, kh, kw = x.shape[0], w.shape[0], w.shape[2], w.shape[3]
    cg, mg = x.shape[1] // groups, m // groups
    k, ohw = cg * kh * kw, oh * ow
    wg = w.reshape(groups, mg, k)
    out = np.empty((n, m, oh, ow), dtype=x.dtype)
    o3 = out.reshape(n, m, ohw)
    for n0 in range(0, n, chunk):
        nb = min(chunk, n - n0)
        col = np.empty((k, nb * ohw), dtype=x.dtype)
        for g in range(groups):
            _im2col(x, n0, nb, g * cg, cg, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, col)
            res = np.dot(wg[g], col)
            for b in range(nb):
                for j in range(mg):
                    o3[n0 + b, g * mg + j] = res[j, b * ohw : (b + 1) * ohw]
    return out


@njit(cache=True)
def _conv2d_grad_filter(x, dout, kh, kw, groups, sh, sw, pt, pl, dh, dw, chunk):
    """dW[g] = sum over chunks of dOut_g [mg, nb*ohw] @ col^T [nb*ohw, k]."""
    n, m, oh, ow = dout.shape[0], dout.shape[1], dout.shape[2], dout.shape[3]
    cg, mg = x.shape[1] // groups, m // groups
    k, ohw = cg * kh * kw, oh * ow
    dw_ = np.zeros((groups, mg, k), dtype=x.dtype)
    d3 = dout.reshape(n, m, ohw)
    for n0 in range(0, n, chunk):
        nb = min(chunk, n - n0)
        col = np.empty((k, nb * ohw), dtype=x.dtype)
        for g in range(groups):
            _im2col(x, n0, nb, g * cg, cg, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, col)
            dw_[g] += np.dot(_gather_out_grad(d3, n0, nb, g * mg, mg), col.T)
    return dw_.reshape(m, cg, kh, kw)


@njit(cache=True)
def _conv2d_grad_input(w, dout, height, width, groups, sh, sw, pt, pl, dh, dw, chunk):
    """dX = col2im(W_g^T [k, mg] @ dOut_g [mg, nb*ohw]) per chunk and group."""
    n, m, oh, ow = dout.shape[0], dout.shape[1], dout.shape[2], dout.shape[3]
    cg, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    mg, k, ohw = m // groups, cg * kh * kw, oh * ow
    wg = w.reshape(groups, mg, k)
    dx = np.zeros((n, cg * groups, height, width), dtype=dout.dtype)
    d3 = dout.reshape(n, m, ohw)
    for n0 in range(0, n, chunk):
        nb = min(chunk, n - n0)
        for g in range(groups):
            col = np.dot(wg[g].T, _gather_out_grad(d3, n0, nb, g * mg, mg))
            _col2im(col, n0, nb, g * cg, cg, kh, kw, sh, sw, pt, pl, dh, dw, oh, ow, dx)
    return dx


class _Geometry:
    """An op's strides, dilations and padding rule; resolved per input size at run time
    (SAME depends on it), with the output size computed as the infer function does."""

    def __init__(self, op: KernelOp):
        self.op_type = op.type
        self.groups = op.attr("groups")
        self.strides = list(op.attr("strides"))
        self.algorithm = op.attr("padding_algorithm")
        self.paddings = list(op.attr("paddings"))
        self.dilations = effective_dilations(self.algorithm, op.attr("dilations"))

    def resolve(self, x_shape, w_shape) -> tuple:
        """(pad_top, pad_left, dilation_h, dilation_w, out_h, out_w, chunk)."""
        try:
            pads = resolve_paddings(self.algorithm, self.paddings, x_shape[2:], w_shape[2:], self.strides)
        except ValueError as e:
            raise ExecutionError(f"{self.op_type}: {e}") from None
        if x_shape[1] != w_shape[1] * self.groups or w_shape[0] % self.groups:
            raise ExecutionError(
                f"{self.op_type}: Input {list(x_shape)} does not fit Filter {list(w_shape)} "
                f"with groups={self.groups}"
            )
        out_hw = [
            window_output(
                x_shape[2 + i],
                w_shape[2 + i],
                self.strides[i],
                (pads[2 * i], pads[2 * i + 1]),
                self.dilations[i],
            )
            for i in range(2)
        ]
        if min(out_hw) < 1:
            raise ExecutionError(f"{self.op_type}: the kernel is larger than the padded input ({out_hw})")
        per_sample = w_shape[1] * w_shape[2] * w_shape[3] * out_hw[0] * out_hw[1]
        chunk = max(1, min(x_shape[0], _COL_ELEMENTS // max(per_sample, 1)))
        return pads[0], pads[2], *self.dilations, *out_hw, chunk


def _operands(env: Env, x_name: str, w_name: str) -> tuple[np.ndarray, np.ndarray]:
    x = contiguous(env[x_name])
    # BLAS needs one dtype: the filter follows the input.
    return x, contiguous(env[w_name], dtype=x.dtype)


@family.kernel("conv2d")
def _conv2d_kernel(op: KernelOp) -> Runner:
    x_name, w_name, out_name = op.input("Input"), op.input("Filter"), op.output("Output")
    geo = _Geometry(op)
    sh, sw = geo.strides

    def run(env: Env) -> None:
        x, w = _operands(env, x_name, w_name)
        pt, pl, dh, dw, oh, ow, chunk = geo.resolve(x.shape, w.shape)
        env[out_name] = _conv2d(x, w, geo.groups, sh, sw, pt, pl, dh, dw, oh, ow, chunk)

    return run


@family.kernel("conv2d_grad")
def _conv2d_grad_kernel(op: KernelOp) -> Runner:
    x_name, w_name, dout_name = op.input("Input"), op.input("Filter"), op.input("Output@GRAD")
    dx_name, dw_name = op.output("Input@GRAD"), op.output("Filter@GRAD")
    geo = _Geometry(op)
    sh, sw = geo.strides

    def run(env: Env) -> None:
        x, w = _operands(env, x_name, w_name)
        dout = contiguous(env[dout_name], dtype=x.dtype)
        pt, pl, dh, dw, oh, ow, chunk = geo.resolve(x.shape, w.shape)
        if dout.shape != (x.shape[0], w.shape[0], oh, ow):
            raise ExecutionError(
                f"conv2d_grad: Output@GRAD has shape {list(dout.shape)}, expected "
                f"{[x.shape[0], w.shape[0], oh, ow]}"
            )
        args = (geo.groups, sh, sw, pt, pl, dh, dw, chunk)
        if dw_name is not None:
            kh, kw = w.shape[2], w.shape[3]
            env[dw_name] = _conv2d_grad_filter(x, dout, kh, kw, *args).astype(env[w_name].dtype, copy=False)
        if dx_name is not None:
            env[dx_name] = _conv2d_grad_input(w, dout, x.shape[2], x.shape[3], *args)

    return run
