"""Ops that create tensors: fill_constant, uniform_random, gaussian_random from
attributes, fill_zeros_like from another tensor's shape and dtype."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.ops.defs import Bool, Compat, Extra, Float, Hint, In, Int, Longs, Out, Str, backend_hints
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.lowering import LoweringOp, NotLowerable, shape
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("creation")

# Paddle lets a tensor input override the shape; fluidps takes it from attributes.
_SHAPE_TENSORS = (Extra("ShapeTensor"), Extra("ShapeTensorList", dup=True))
_FP32 = int(VarType.FP32)


def _infer_from_attrs(ctx: InferContext) -> None:
    ctx.set_output("Out", ctx.attr("shape"), VarType(ctx.attr("dtype")))


family.define(
    "fill_constant",
    inputs=[Extra("ValueTensor"), *_SHAPE_TENSORS],
    outputs=[Out("Out")],
    attrs=[
        Longs("shape", []),
        Int("dtype", _FP32),
        Float("value", 0.0),
        # Set by Paddle when `value` does not survive float32 (large int64s).
        Str("str_value", ""),
        Bool("force_cpu", False),
        Hint(Int("place_type", -1)),
        *backend_hints("use_mkldnn", "use_onednn"),
    ],
    infer=_infer_from_attrs,
)

family.define(
    "uniform_random",
    inputs=list(_SHAPE_TENSORS),
    outputs=[Out("Out")],
    attrs=[
        Longs("shape", []),
        Float("min", -1.0),
        Float("max", 1.0),
        Int("seed", 0),
        Int("dtype", _FP32),
        Compat(Int("diag_num", 0), hint="diagonal initialisation is not supported"),
        Hint(Int("diag_step", 0)),
        Hint(Float("diag_val", 1.0)),
    ],
    infer=_infer_from_attrs,
)

family.define(
    "gaussian_random",
    inputs=list(_SHAPE_TENSORS),
    outputs=[Out("Out")],
    attrs=[
        Longs("shape", []),
        Float("mean", 0.0),
        Float("std", 1.0),
        Int("seed", 0),
        Int("dtype", _FP32),
        *backend_hints("use_mkldnn"),
    ],
    infer=_infer_from_attrs,
)


@family.op("fill_zeros_like", inputs=[In("X")], outputs=[Out("Out")])
def _infer_fill_zeros_like(ctx: InferContext) -> None:
    """Out = zeros of X's shape and dtype (autodiff's stand-in for a missing gradient)."""
    ctx.share("Out", ctx.input("X"))


# -- kernels: creation only, no arithmetic, so numpy ------------------------------------------


def _shape(op: KernelOp) -> tuple[int, ...]:
    shape = tuple(int(d) for d in op.attr("shape"))
    if any(d < 0 for d in shape):
        raise ExecutionError(f"{op.type}: shape {list(shape)} has a negative dimension")
    return shape


def _dtype(op: KernelOp) -> np.dtype:
    return to_numpy_dtype(VarType(op.attr("dtype")))


def parse_str_value(text: str, dtype: np.dtype) -> Any:
    """fill_constant's str_value as a value of `dtype`: integers exactly (Decimal
    keeps int64s float64 would round; "3.0" and "1e3" parse too), floats with
    "inf", "-inf" and "nan" understood."""
    text = text.strip()
    if dtype.kind in "iu":
        try:
            return int(Decimal(text))
        except (InvalidOperation, ValueError, OverflowError):
            raise ExecutionError(f"fill_constant: str_value {text!r} is not a number") from None
    try:
        number = float(text)
    except ValueError:
        raise ExecutionError(f"fill_constant: str_value {text!r} is not a number") from None
    return bool(number) if dtype.kind == "b" else number


@family.kernel("fill_constant")
def _fill_constant_kernel(op: KernelOp) -> Runner:
    out_name, shape, dtype = op.output("Out"), _shape(op), _dtype(op)
    text = op.attr("str_value")
    value = parse_str_value(text, dtype) if text else op.attr("value")
    template = np.full(shape, value, dtype=dtype)

    def run(env: Env) -> None:
        # A fresh array per run: a consumer may update its input in place.
        env[out_name] = template.copy()

    return run


def _generator(op: KernelOp) -> np.random.Generator:
    """One generator per op, made when the runner is built: a nonzero seed makes
    the stream reproducible, and each run continues it."""
    seed = op.attr("seed")
    return np.random.default_rng(seed) if seed != 0 else np.random.default_rng()


@family.kernel("uniform_random")
def _uniform_kernel(op: KernelOp) -> Runner:
    out_name, shape, dtype = op.output("Out"), _shape(op), _dtype(op)
    low, high = op.attr("min"), op.attr("max")
    rng = _generator(op)

    def run(env: Env) -> None:
        env[out_name] = rng.uniform(low, high, size=shape).astype(dtype)

    return run


@family.kernel("gaussian_random")
def _gaussian_kernel(op: KernelOp) -> Runner:
    out_name, shape, dtype = op.output("Out"), _shape(op), _dtype(op)
    mean, std = op.attr("mean"), op.attr("std")
    rng = _generator(op)

    def run(env: Env) -> None:
        env[out_name] = rng.normal(mean, std, size=shape).astype(dtype)

    return run


@family.kernel("fill_zeros_like")
def _fill_zeros_like_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")

    def run(env: Env) -> None:
        x = env[x_name]
        if isinstance(x, SelectedRows):
            env[out_name] = SelectedRows(x.rows.copy(), np.zeros_like(x.value), x.height)
        else:
            env[out_name] = np.zeros_like(x)

    return run


@family.lowering("fill_constant")
def _fill_constant_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    dtype = to_numpy_dtype(VarType(op.attr("dtype")))
    if dtype.kind not in "fiu":
        raise NotLowerable(f"fill_constant of {dtype}")
    dims = [int(d) for d in op.attr("shape")]
    if any(d < 0 for d in dims):
        raise NotLowerable("a negative dimension (the kernel says what is wrong)")
    text = op.attr("str_value")
    value = parse_str_value(text, dtype) if text else op.attr("value")
    literal = repr(float(value)) if dtype.kind == "f" else repr(int(value))
    op.emit(f"{op.output('Out')} = np.full({shape([str(d) for d in dims])}, {literal}, np.{dtype.name})")
