"""elementwise_add / sub / mul / div / max / min with Fluid's `axis` broadcasting.

Y is aligned with X starting at dimension `axis` (-1: trailing dimensions),
then both broadcast; the gradient of a broadcast operand sums over the axes
it was broadcast along.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext, elementwise_shape, numel
from fluidps.ir.types import VarType
from fluidps.ops.broadcast import align, reduce_to, sum_pre_post
from fluidps.ops.defs import Compat, Float, In, Int, Out, Str, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.lowering import ElementForm, LoweringOp, NotLowerable, Spread, dims, product, shape
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("elementwise")

_ATTRS = (
    Int("axis", -1),
    # Data layouts and quantization scales Paddle writes at neutral values.
    Compat(Str("x_data_format", "")),
    Compat(Str("y_data_format", "")),
    Compat(Float("Scale_x", 1.0)),
    Compat(Float("Scale_y", 1.0)),
    Compat(Float("Scale_out", 1.0)),
    *backend_hints("use_mkldnn", "use_onednn", "use_quantizer", "mkldnn_data_type", "onednn_data_type"),
)


def _infer(ctx: InferContext) -> None:
    x, y = ctx.input("X"), ctx.input("Y")
    if x.dtype is not None and y.dtype is not None and x.dtype != y.dtype:
        ctx.fail(f"X and Y must have the same dtype, got {x.dtype.name} and {y.dtype.name}")
    if x.type == VarType.SELECTED_ROWS:
        # Only elementwise_mul by one scalar (gradient clipping) keeps a sparse X sparse.
        if ctx.type != "elementwise_mul" or numel(y.shape) != 1:
            ctx.fail("a SelectedRows X can only be multiplied by a one-element Y")
        ctx.share("Out", x)
        return
    ctx.set_output("Out", elementwise_shape(x.shape, y.shape, ctx.attr("axis"), ctx), x.dtype)


_BINARY = GradSpec(inputs=("X", "Y"), in_grads=("X", "Y"))
_GRADS = {
    "elementwise_add": _BINARY,
    "elementwise_sub": _BINARY,
    "elementwise_mul": _BINARY,
    # d(x/y)/dy = -out/y: the grad op reads Out too.
    "elementwise_div": GradSpec(inputs=("X", "Y"), outputs=("Out",), in_grads=("X", "Y")),
    "elementwise_max": _BINARY,
    "elementwise_min": _BINARY,
    # d(x^y)/dy = out * log(x): reads Out.
    "elementwise_pow": GradSpec(inputs=("X", "Y"), outputs=("Out",), in_grads=("X", "Y")),
}

for _type, _grad in _GRADS.items():
    family.define(
        _type, inputs=[In("X"), In("Y")], outputs=[Out("Out")], attrs=_ATTRS, grad=_grad, infer=_infer
    )


# -- kernels -----------------------------------------------------------------------------
# Operands are aligned to one rank (ops.broadcast.align); numba's array
# expressions then broadcast, keeping the operands' dtype. numba compiles each of
# these for scalars too: the forward ones, and the mul / div gradients, are also the
# element functions compiled code fuses (see the ElementForms below).


@njit(cache=True)
def _add(x, y):
    return x + y


@njit(cache=True)
def _sub(x, y):
    return x - y


@njit(cache=True)
def _mul(x, y):
    return x * y


@njit(cache=True)
def _div(x, y):
    return x / y


@njit(cache=True)
def _max(x, y):
    return np.maximum(x, y)


@njit(cache=True)
def _min(x, y):
    return np.minimum(x, y)


@njit(cache=True)
def _pow(x, y):
    return x**y


@njit(cache=True)
def _mul_grads(dout, x, y):
    return dout * y, dout * x


@njit(cache=True)
def _div_grads(dout, x, y):
    return dout / y, -dout * x / (y * y)


@njit(cache=True)
def _max_grads(dout, x, y):
    return dout * (x > y), dout * (x <= y)


@njit(cache=True)
def _min_grads(dout, x, y):
    return dout * (x < y), dout * (x >= y)


@njit(cache=True)
def _pow_grads(dout, x, y):
    return dout * y * x ** (y - 1), dout * x**y * np.log(x)


@njit(cache=True)
def _add_grads(dout, x, y):
    return dout, dout


@njit(cache=True)
def _sub_grads(dout, x, y):
    return dout, -dout


_FORWARD_FNS = {
    "elementwise_add": _add,
    "elementwise_sub": _sub,
    "elementwise_mul": _mul,
    "elementwise_div": _div,
    "elementwise_max": _max,
    "elementwise_min": _min,
    "elementwise_pow": _pow,
}
# Each returns (dL/dx, dL/dy) at the broadcast shape; reduce_to sums them back.
_GRAD_FNS = {
    "elementwise_add": _add_grads,
    "elementwise_sub": _sub_grads,
    "elementwise_mul": _mul_grads,
    "elementwise_div": _div_grads,
    "elementwise_max": _max_grads,
    "elementwise_min": _min_grads,
    "elementwise_pow": _pow_grads,
}


def _array(value, dtype: np.dtype) -> np.ndarray:
    """numba returns a Python scalar for 0-d operands; keep a 0-d array of the dtype."""
    return value if isinstance(value, np.ndarray) else np.asarray(value, dtype=dtype)


@family.kernel(*_FORWARD_FNS)
def _forward_kernel(op: KernelOp) -> Runner:
    fn = _FORWARD_FNS[op.type]
    x_name, y_name, out_name = op.input("X"), op.input("Y"), op.output("Out")
    axis = op.attr("axis")
    sparse_ok = op.type == "elementwise_mul"

    def run(env: Env) -> None:
        x, y = env[x_name], env[y_name]
        if isinstance(x, SelectedRows):
            # Gradient clipping scales a sparse gradient by a scalar.
            if not sparse_ok or y.size != 1:
                raise ExecutionError(f"{op.type} takes a SelectedRows X only with a one-element Y")
            env[out_name] = SelectedRows(x.rows, _mul(x.value, y.reshape((1,) * x.value.ndim)), x.height)
            return
        xa, ya = align(x, y, axis)
        env[out_name] = _array(fn(xa, ya), xa.dtype)

    return run


@family.kernel(*(t + "_grad" for t in _FORWARD_FNS))
def _grad_kernel(op: KernelOp) -> Runner:
    fn = _GRAD_FNS[op.type[: -len("_grad")]]
    x_name, y_name, dout_name = op.input("X"), op.input("Y"), op.input("Out@GRAD")
    dx_name, dy_name = op.output("X@GRAD"), op.output("Y@GRAD")
    axis = op.attr("axis")

    def run(env: Env) -> None:
        x, y, dout = env[x_name], env[y_name], env[dout_name]
        xa, ya = align(x, y, axis)
        dx, dy = (_array(g, xa.dtype) for g in fn(dout, xa, ya))
        if dx_name is not None:
            env[dx_name] = reduce_to(dx, xa.shape).reshape(x.shape)
        if dy_name is not None:
            env[dy_name] = reduce_to(dy, ya.shape).reshape(y.shape)

    return run


# -- lowerings: X the larger operand, Y equal to it or broadcast along X's other dims -------


class _Aligned:
    """How Y lines up with X in a lowered elementwise op (as ops.broadcast.align does),
    decided from their declared shapes; NotLowerable where only run-time sizes could
    tell (Y broadcast within its own dims, X the smaller operand)."""

    def __init__(self, op: LoweringOp):
        op.require_dense("X", "Y")
        x_shape, y_shape = op.declared("X"), op.declared("Y")
        rx, ry = len(x_shape), len(y_shape)
        if ry > rx or rx == 0:
            raise NotLowerable("Y has more dimensions than X")
        axis = op.attr("axis")
        self.start = rx - ry if axis == -1 or ry == rx else axis
        if ry == rx and axis not in (-1, 0):
            raise NotLowerable(f"axis {axis} with operands of one rank")
        for i, d in enumerate(y_shape):
            if d != x_shape[self.start + i]:
                raise NotLowerable("Y is broadcast within its own dimensions")
        self.op, self.rx, self.ry = op, rx, ry
        self.equal = ry == rx

    def y(self) -> str:
        """Y's local, viewed at X's rank."""
        y = self.op.input("Y")
        if self.equal:
            return y
        parts = ["1"] * self.start + dims(y, range(self.ry)) + ["1"] * (self.rx - self.ry - self.start)
        return f"{y}.reshape({shape(parts)})"

    def y_grad(self, full: str) -> str:
        """The gradient `full` (X's shape) summed back to Y's shape."""
        if self.equal:
            return full
        x = self.op.input("X")
        pre = product(dims(x, range(self.start)))
        post = product(dims(x, range(self.start + self.ry, self.rx)))
        view = f"{full}.reshape(({pre}, {self.op.input('Y')}.size, {post}))"
        return f"{self.op.call(sum_pre_post, view)}.reshape({self.op.input('Y')}.shape)"

    def spread(self) -> dict[str, Spread]:
        """Y (and its gradient) as broadcast along X's other dimensions, if it is."""
        if self.equal:
            return {}
        return {"Y": Spread(self.start, self.ry), "Y@GRAD": Spread(self.start, self.ry)}


@njit(cache=True)
def add_grad_element(dout):
    return dout, dout


@njit(cache=True)
def sub_grad_element(dout):
    return dout, -dout


def _spread(op: LoweringOp) -> dict[str, Spread]:
    return _Aligned(op).spread()


# The kernels above are their own element functions; add's and sub's gradients read
# only Out@GRAD, element by element. (pow, and the max / min gradients, which multiply
# by booleans, are left out: numba's scalar types differ from its arrays'.)
for _type, _fn in _FORWARD_FNS.items():
    if _type != "elementwise_pow":
        family.elementwise(_type, ElementForm(_fn, ("X", "Y"), ("Out",), _spread))
for _type, (_fn, _reads) in {
    "elementwise_add": (add_grad_element, ("Out@GRAD",)),
    "elementwise_sub": (sub_grad_element, ("Out@GRAD",)),
    "elementwise_mul": (_mul_grads, ("Out@GRAD", "X", "Y")),
    "elementwise_div": (_div_grads, ("Out@GRAD", "X", "Y")),
}.items():
    family.elementwise(_type + "_grad", ElementForm(_fn, _reads, ("X@GRAD", "Y@GRAD"), _spread))


@family.lowering(*_FORWARD_FNS)
def _forward_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    aligned = _Aligned(op)
    op.emit(f"{op.output('Out')} = {op.call(_FORWARD_FNS[op.type], op.input('X'), aligned.y())}")


@family.lowering(*(t + "_grad" for t in _FORWARD_FNS))
def _grad_lowering(op: LoweringOp) -> None:
    aligned = _Aligned(op)
    op.require_dense("Out@GRAD", "X@GRAD", "Y@GRAD")
    fn = _GRAD_FNS[op.type[: -len("_grad")]]
    dx, dy = op.output("X@GRAD"), op.output("Y@GRAD")
    if aligned.equal:  # declared alike; one broadcast at run time needs the interpreter's sum
        x, y = op.input("X"), op.input("Y")
        op.emit(f"if {x}.shape != {y}.shape:")
        op.emit(f"    raise ValueError('op {op.type}: Y is broadcast at run time')")
    gx, gy = op.temp(), op.temp()
    op.emit(f"{gx}, {gy} = {op.call(fn, op.input('Out@GRAD'), op.input('X'), aligned.y())}")
    if dx is not None:
        op.emit(f"{dx} = {gx}")
    if dy is not None:
        op.emit(f"{dy} = {aligned.y_grad(gy)}")
