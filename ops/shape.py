"""Layout ops: concat, split, reshape2, transpose2, flatten_contiguous_range.

reshape2, transpose2 and flatten record the input shape in XShape ([0] +
shape, as Fluid does) so their gradients need only XShape, not X.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext, normalize_axis, numel
from fluidps.ir.opschema import GradContext, GradOpDesc
from fluidps.ir.types import EMPTY_VAR_NAME
from fluidps.ops.defs import Compat, Extra, In, Int, Ints, Out, Str, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp, NotLowerable, dims, shape
from fluidps.ops.registry import OpFamily

family = OpFamily("shape")

_HINTS = backend_hints("use_mkldnn", "use_onednn", "use_quantizer", "mkldnn_data_type", "onednn_data_type")
_FROM_XSHAPE = GradSpec(outputs=("XShape",), like=(("X", "XShape"),))


def _record_xshape(ctx: InferContext, x_shape: tuple[int, ...], dtype) -> None:
    if ctx.has_output("XShape"):
        ctx.set_output("XShape", (0, *x_shape), dtype)


@family.op(
    "concat",
    inputs=[In("X", dup=True), Extra("AxisTensor")],
    outputs=[Out("Out")],
    attrs=[Int("axis", 0), *_HINTS],
    grad=GradSpec(inputs=("X",)),
)
def _infer_concat(ctx: InferContext) -> None:
    """Out = X_0, X_1, ... joined along `axis`."""
    xs = ctx.inputs("X")
    if not xs or any(x.shape is None for x in xs):
        ctx.fail("needs one or more inputs with known shapes")
    rank = len(xs[0].shape)
    axis = normalize_axis(ctx.attr("axis"), rank, ctx)
    out = list(xs[0].shape)
    for x in xs[1:]:
        if len(x.shape) != rank:
            ctx.fail(f"inputs must have the same rank, got {list(xs[0].shape)} and {list(x.shape)}")
        for i, (a, b) in enumerate(zip(out, x.shape, strict=True)):
            if i == axis:
                out[i] = -1 if a < 0 or b < 0 else a + b
            elif a >= 0 and b >= 0 and a != b:
                ctx.fail(f"inputs differ in dimension {i} ({a} vs {b}), not only along axis {axis}")
            elif a < 0:
                out[i] = b
    ctx.set_output("Out", out, xs[0].dtype)


def _split_grad(ctx: GradContext) -> list[GradOpDesc]:
    dx = ctx.input_grad("X")
    if not dx:
        return []
    return [GradOpDesc("concat", {"X": ctx.output_grad("Out")}, {"Out": dx}, {"axis": ctx.op.attr("axis")})]


@family.op(
    "split",
    inputs=[In("X"), Extra("AxisTensor"), Extra("SectionsTensorList", dup=True)],
    outputs=[Out("Out", dup=True)],
    attrs=[Int("axis", 0), Int("num", 0), Ints("sections", []), *_HINTS],
    grad=_split_grad,
)
def _infer_split(ctx: InferContext) -> None:
    """Out_i = X split along `axis` into `num` equal parts, or into `sections`
    (one section may be -1: the remainder)."""
    x = ctx.input("X")
    axis = normalize_axis(ctx.attr("axis"), len(x.shape), ctx)
    outs = ctx.op.output("Out")
    num, sections = ctx.attr("num"), list(ctx.attr("sections"))
    total = x.shape[axis]
    if num > len(outs):  # (before a list of `num` sections is made)
        ctx.fail(f"attribute num={num} makes {num} parts but the op has {len(outs)} outputs")
    if num > 0:
        if total >= 0 and total % num:
            ctx.fail(f"dimension {axis} of size {total} does not split into {num} equal parts")
        sections = [total // num if total >= 0 else -1] * num
    elif sections:
        if sections.count(-1) > 1:
            ctx.fail(f"at most one section may be -1, got {sections}")
        if -1 in sections and total >= 0:
            sections[sections.index(-1)] = total - sum(s for s in sections if s >= 0)
    else:
        ctx.fail("needs num > 0 or sections")
    if len(sections) != len(outs):
        ctx.fail(f"makes {len(sections)} parts but has {len(outs)} outputs")
    for i, size in enumerate(sections):
        shape = list(x.shape)
        shape[axis] = size
        ctx.set_output("Out", shape, x.dtype, index=i)


@family.op(
    "reshape2",
    inputs=[In("X"), Extra("Shape"), Extra("ShapeTensor", dup=True)],
    outputs=[Out("Out"), Out("XShape", opt=True)],
    attrs=[Ints("shape"), *_HINTS],
    grad=_FROM_XSHAPE,
)
def _infer_reshape2(ctx: InferContext) -> None:
    """Out = X with a new shape: 0 copies X's dimension, one -1 is inferred."""
    x = ctx.input("X")
    target = list(ctx.attr("shape"))
    if target.count(-1) > 1:
        ctx.fail(f"shape {target} has more than one -1")
    out = []
    for i, d in enumerate(target):
        if d == 0:
            if i >= len(x.shape):
                ctx.fail(f"shape {target} copies dimension {i} (0) but X has rank {len(x.shape)}")
            out.append(x.shape[i])
        elif d < -1:
            ctx.fail(f"shape {target} has invalid dimension {d}")
        else:
            out.append(d)
    if -1 in target:
        # Dimensions copied with 0 are equal on both sides, so they cancel: the
        # -1 is computable even when a copied dimension (the batch) is unknown.
        idx = target.index(-1)
        copied = {i for i, d in enumerate(target) if d == 0}
        x_rest = numel([d for i, d in enumerate(x.shape) if i not in copied])
        out_rest = numel([d for i, d in enumerate(out) if i not in copied and i != idx])
        if x_rest >= 0 and out_rest > 0:
            if x_rest % out_rest:
                ctx.fail(
                    f"cannot reshape {list(x.shape)} into {target}: {x_rest} elements do not divide by {out_rest}"
                )
            out[idx] = x_rest // out_rest
    elif numel(x.shape) >= 0 and numel(out) >= 0 and numel(x.shape) != numel(out):
        ctx.fail(f"cannot reshape {list(x.shape)} into {target}: element counts differ")
    ctx.set_output("Out", out, x.dtype)
    _record_xshape(ctx, x.shape, x.dtype)


@family.op(
    "transpose2",
    inputs=[In("X")],
    outputs=[Out("Out"), Out("XShape", opt=True)],
    attrs=[Ints("axis"), Compat(Str("data_format", "AnyLayout"), "AnyLayout", "NCHW"), *_HINTS],
    grad=_FROM_XSHAPE,
)
def _infer_transpose2(ctx: InferContext) -> None:
    """Out = X with its dimensions permuted by `axis`."""
    x = ctx.input("X")
    perm = [normalize_axis(a, len(x.shape), ctx) for a in ctx.attr("axis")]
    if sorted(perm) != list(range(len(x.shape))):
        ctx.fail(f"axis {ctx.attr('axis')} is not a permutation of the {len(x.shape)} dimensions")
    ctx.set_output("Out", [x.shape[a] for a in perm], x.dtype)
    _record_xshape(ctx, x.shape, x.dtype)


@family.op(
    "flatten_contiguous_range",
    inputs=[In("X")],
    outputs=[Out("Out"), Out("XShape", opt=True)],
    attrs=[Int("start_axis", 1), Int("stop_axis", 1), *_HINTS],
    grad=_FROM_XSHAPE,
)
def _infer_flatten(ctx: InferContext) -> None:
    """Out = X with dimensions start_axis..stop_axis merged into one."""
    x = ctx.input("X")
    rank = len(x.shape)
    if rank == 0:
        ctx.set_output("Out", (1,), x.dtype)
        _record_xshape(ctx, x.shape, x.dtype)
        return
    start = normalize_axis(ctx.attr("start_axis"), rank, ctx, "start_axis")
    stop = normalize_axis(ctx.attr("stop_axis"), rank, ctx, "stop_axis")
    if start > stop:
        ctx.fail(f"start_axis {start} is after stop_axis {stop}")
    out = [*x.shape[:start], numel(x.shape[start : stop + 1]), *x.shape[stop + 1 :]]
    ctx.set_output("Out", out, x.dtype)
    _record_xshape(ctx, x.shape, x.dtype)


# -- kernels: pure data movement, so numpy (views, np.concatenate, np.split) ------------------
# A reshaped view of a persistable input would change when an optimizer later
# updates that parameter in place; such outputs are copied, others are views.


def _may_share_memory(op: KernelOp, x_name: str) -> bool:
    var = op.var(x_name)
    return var is not None and not var.persistable


def _xshape(x: np.ndarray) -> np.ndarray:
    """Fluid's XShape: a zero-size array whose shape records X's after a leading 0."""
    return np.empty((0, *x.shape), x.dtype)


def _split_indices(sizes: list[int]) -> list[int]:
    return list(np.cumsum(sizes[:-1])) if sizes else []


@family.kernel("concat")
def _concat_kernel(op: KernelOp) -> Runner:
    x_names, out_name = op.inputs("X"), op.output("Out")
    axis = op.attr("axis")

    def run(env: Env) -> None:
        xs = [env[n] for n in x_names]
        env[out_name] = np.concatenate(xs, axis=axis + xs[0].ndim if axis < 0 else axis)

    return run


@family.kernel("concat_grad")
def _concat_grad_kernel(op: KernelOp) -> Runner:
    x_names, dout_name, dx_names = op.inputs("X"), op.input("Out@GRAD"), op.outputs("X@GRAD")
    axis = op.attr("axis")

    def run(env: Env) -> None:
        dout = env[dout_name]
        ax = axis + dout.ndim if axis < 0 else axis
        parts = np.split(dout, _split_indices([env[n].shape[ax] for n in x_names]), axis=ax)
        for name, part in zip(dx_names, parts, strict=True):
            if name != EMPTY_VAR_NAME:
                env[name] = contiguous(part)

    return run


@family.kernel("split")
def _split_kernel(op: KernelOp) -> Runner:
    x_name, out_names = op.input("X"), op.outputs("Out")
    axis, num, sections = op.attr("axis"), op.attr("num"), list(op.attr("sections"))

    def run(env: Env) -> None:
        x = env[x_name]
        ax = axis + x.ndim if axis < 0 else axis
        total = x.shape[ax]
        if num > len(out_names):  # (what inference says, before a list of `num` sizes is made)
            raise ExecutionError(
                f"split: attribute num={num} makes more parts than its {len(out_names)} outputs"
            )
        if num > 0:
            sizes = [total // num] * num
        else:
            sizes = list(sections)
            if -1 in sizes:
                sizes[sizes.index(-1)] = total - sum(s for s in sizes if s >= 0)
        if sum(sizes) != total or min(sizes, default=0) < 0:
            raise ExecutionError(f"split: sections {sizes} do not add up to dimension {ax} of size {total}")
        parts = np.split(x, _split_indices(sizes), axis=ax)
        for name, part in zip(out_names, parts, strict=True):
            if name != EMPTY_VAR_NAME:
                env[name] = contiguous(part)

    return run


def _reshape_target(target: list[int], x_shape: tuple[int, ...]) -> list[int]:
    """`target` with 0 replaced by X's dimension there. numpy resolves a -1, except
    beside a 0 (an empty batch): then it is resolved as for a batch of one."""
    shape = [x_shape[i] if d == 0 else d for i, d in enumerate(target)]
    if -1 in shape and 0 in shape:
        known = math.prod(max(d, 1) for d in shape if d != -1)
        shape[shape.index(-1)] = math.prod(max(d, 1) for d in x_shape) // known
    return shape


def _layout_kernel(op: KernelOp, new_shape: Callable[[tuple[int, ...]], Sequence[int]]) -> Runner:
    """Out = X viewed in new_shape(X.shape); XShape records X's shape."""
    x_name, out_name, xshape_name = op.input("X"), op.output("Out"), op.output("XShape")
    as_view = _may_share_memory(op, x_name)

    def run(env: Env) -> None:
        x = contiguous(env[x_name])
        out = x.reshape(new_shape(x.shape))
        env[out_name] = out if as_view else out.copy()
        if xshape_name is not None:
            env[xshape_name] = _xshape(x)

    return run


@family.kernel("reshape2")
def _reshape2_kernel(op: KernelOp) -> Runner:
    target = list(op.attr("shape"))
    return _layout_kernel(op, lambda shape: _reshape_target(target, shape))


@family.kernel("flatten_contiguous_range")
def _flatten_kernel(op: KernelOp) -> Runner:
    start_attr, stop_attr = op.attr("start_axis"), op.attr("stop_axis")

    def new_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
        if not shape:
            return (1,)
        start = start_attr + len(shape) if start_attr < 0 else start_attr
        stop = stop_attr + len(shape) if stop_attr < 0 else stop_attr
        return (*shape[:start], int(np.prod(shape[start : stop + 1], dtype=np.int64)), *shape[stop + 1 :])

    return _layout_kernel(op, new_shape)


@family.kernel("reshape2_grad", "flatten_contiguous_range_grad")
def _unflatten_grad_kernel(op: KernelOp) -> Runner:
    xshape_name, dout_name, dx_name = op.input("XShape"), op.input("Out@GRAD"), op.output("X@GRAD")

    def run(env: Env) -> None:
        env[dx_name] = contiguous(env[dout_name]).reshape(env[xshape_name].shape[1:])

    return run


@family.kernel("transpose2")
def _transpose2_kernel(op: KernelOp) -> Runner:
    x_name, out_name, xshape_name = op.input("X"), op.output("Out"), op.output("XShape")
    perm = list(op.attr("axis"))

    def run(env: Env) -> None:
        x = env[x_name]
        # A contiguous copy: later kernels flatten their inputs, which a strided view defeats.
        env[out_name] = contiguous(np.transpose(x, perm))
        if xshape_name is not None:
            env[xshape_name] = _xshape(x)

    return run


@family.kernel("transpose2_grad")
def _transpose2_grad_kernel(op: KernelOp) -> Runner:
    dout_name, dx_name = op.input("Out@GRAD"), op.output("X@GRAD")
    perm = list(op.attr("axis"))

    def run(env: Env) -> None:
        dout = env[dout_name]
        inverse = np.argsort([a + dout.ndim if a < 0 else a for a in perm])
        env[dx_name] = contiguous(np.transpose(dout, inverse))

    return run


# -- lowerings: the same views and copies in compiled code -------------------------------------


def _persistable_input(op: LoweringOp, slot: str) -> bool:
    return bool(op.variable(op.op.input(slot)[0]).persistable)


@family.lowering("reshape2")
def _reshape2_lowering(op: LoweringOp) -> None:
    op.require_dense("X", "Out")
    x, rank = op.input("X"), op.rank("X")
    target = list(op.attr("shape"))
    if any(d == 0 for d in target) and len(target) > rank:
        raise NotLowerable("a 0 in shape past X's dimensions")
    parts = [f"{x}.shape[{i}]" if d == 0 else str(d) for i, d in enumerate(target)]
    if -1 in target:  # numpy resolves it, but not beside a 0 (an empty batch): the kernel does
        op.emit(f"if {x}.size == 0:")
        op.emit("    raise ValueError('reshape2: an empty X, with a -1 in shape')")
    view = f"{x}.reshape({shape(parts)})"
    # As the kernel: a parameter's view would change when an optimizer updates it in place.
    op.emit(
        f"{op.output('Out')} = {view}.copy()"
        if _persistable_input(op, "X")
        else f"{op.output('Out')} = {view}"
    )
    if (xshape := op.output("XShape")) is not None:
        op.emit(f"{xshape} = np.empty({shape(['0', *dims(x, range(rank))])}, {x}.dtype)")


@family.lowering("reshape2_grad")
def _reshape2_grad_lowering(op: LoweringOp) -> None:
    op.require_dense("Out@GRAD", "X@GRAD")
    xshape, rank = op.input("XShape"), op.rank("XShape")
    target = shape([f"{xshape}.shape[{i}]" for i in range(1, rank)])
    op.emit(f"{op.output('X@GRAD')} = np.ascontiguousarray({op.input('Out@GRAD')}).reshape({target})")


def _concat_axis(op: LoweringOp) -> tuple[int, int]:
    """(axis, rank): as declared by the first input."""
    first = op.variable(op.op.input("X")[0])
    if first.shape is None:
        raise NotLowerable("X has no declared shape")
    rank, axis = len(first.shape), op.attr("axis")
    if op.has_input("AxisTensor"):
        raise NotLowerable("its axis is a tensor")
    return (axis + rank if axis < 0 else axis), rank


def _along(local: str, axis: int, rank: int, start: str, stop: str) -> str:
    """`local[..., start:stop, ...]` along dimension `axis`."""
    index = [":"] * rank
    index[axis] = f"{start}:{stop}"
    return f"{local}[{', '.join(index)}]"


@family.lowering("concat")
def _concat_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out")
    xs = op.inputs("X")
    axis, _ = _concat_axis(op)
    op.emit(f"{op.output('Out')} = np.concatenate(({', '.join(xs)},), axis={axis})")


@family.lowering("concat_grad")
def _concat_grad_lowering(op: LoweringOp) -> None:
    op.require_dense("X", "Out@GRAD", "X@GRAD")
    xs, dout = op.inputs("X"), op.input("Out@GRAD")
    axis, rank = _concat_axis(op)
    offset = op.temp()
    op.emit(f"{offset} = 0")
    for i, (x, dx) in enumerate(zip(xs, op.outputs("X@GRAD"), strict=True)):
        last = i == len(xs) - 1  # as np.split: the last part is the rest
        stop = "" if last else f"{offset} + {x}.shape[{axis}]"
        if dx is not None:
            op.emit(f"{dx} = np.ascontiguousarray({_along(dout, axis, rank, offset, stop)})")
        if not last:
            op.emit(f"{offset} = {stop}")
