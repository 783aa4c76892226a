"""What an op computes and moves, from its type, attributes and shapes: the analytic
half of the cost model (fluidps.transpiler.cost_model), for ops no profile measured.

`work(op, shapes)` gives (floating-point operations, bytes read and written) for one
run; `shapes` maps each variable the op names to its shape with the batch's rows in
place of -1. Matrix products and convolutions count their multiply-adds (two FLOPs
each; a gradient op its two products); everything else counts the bytes it touches,
which bound elementwise ops, reductions and optimizer updates on a CPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from fluidps.ir.operator import Operator
from fluidps.ir.types import EMPTY_VAR_NAME

Shapes = Mapping[str, tuple[int, ...]]
_PRODUCTS = ("mul", "matmul", "matmul_v2")
_CONVS = ("conv2d", "depthwise_conv2d")


def work(op: Operator, shapes: Shapes, itemsize: Mapping[str, int]) -> tuple[float, float]:
    """(FLOPs, bytes) of one run of `op`."""
    moved = float(
        _bytes(op.input_arg_names, shapes, itemsize) + _bytes(op.output_arg_names, shapes, itemsize)
    )
    base = op.type.removesuffix("_grad")
    grads = 2 if op.type.endswith("_grad") else 1  # a gradient op: the product for each input
    if base in _PRODUCTS:
        return grads * _product_flops(op, shapes), moved
    if base in _CONVS:
        return grads * _conv_flops(op, shapes), moved
    elements = max((_numel(shapes.get(n, ())) for n in _names(op.output_arg_names)), default=0)
    return float(elements), moved


def _names(names: Sequence[str]) -> list[str]:
    return [n for n in names if n != EMPTY_VAR_NAME]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(max(d, 1) for d in shape)


def _bytes(names: Sequence[str], shapes: Shapes, itemsize: Mapping[str, int]) -> int:
    return sum(_numel(shapes.get(n, ())) * itemsize.get(n, 4) for n in dict.fromkeys(_names(names)))


def _product_flops(op: Operator, shapes: Shapes) -> float:
    x, y = (shapes.get(op.input(slot)[0], ()) for slot in ("X", "Y"))
    if not x or not y:
        return 0.0
    if op.type.startswith("mul"):
        xn = op.attr("x_num_col_dims") if op.has_attr("x_num_col_dims") else 1
        yn = op.attr("y_num_col_dims") if op.has_attr("y_num_col_dims") else 1
        m, k, n = _numel(x[:xn]), _numel(x[xn:]), _numel(y[yn:])
        return 2.0 * m * k * n
    # matmul: batch dims broadcast, the last two multiplied (after any transpose)
    tx = _flag(op, "transpose_X", "trans_x")
    ty = _flag(op, "transpose_Y", "trans_y")
    x2 = (1, *x) if len(x) == 1 else x
    y2 = (*y, 1) if len(y) == 1 else y
    m, k = (x2[-1], x2[-2]) if tx else (x2[-2], x2[-1])
    n = y2[-2] if ty else y2[-1]
    batch = max(_numel(x2[:-2]), _numel(y2[:-2]))
    return 2.0 * batch * m * k * n


def _flag(op: Operator, *names: str) -> bool:
    return any(op.has_attr(n) and bool(op.attr(n)) for n in names)


def _conv_flops(op: Operator, shapes: Shapes) -> float:
    """2 x output elements x (input channels per group x kernel area)."""
    outs = op.input("Output@GRAD") if op.type.endswith("_grad") else op.output("Output")
    filt = shapes.get(op.input("Filter")[0], ()) if op.input("Filter") else ()
    out = shapes.get(outs[0], ()) if outs else ()
    if len(filt) != 4 or len(out) != 4:
        return 0.0
    return 2.0 * _numel(out) * filt[1] * filt[2] * filt[3]
