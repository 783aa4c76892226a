"""Unary activations: relu, sigmoid, tanh, exp, log, sqrt, square (and floor).

Where the derivative is a function of the output (relu, sigmoid, tanh, exp,
sqrt) the grad op reads Out, as in Fluid, so X can be freed early; log and
square read X. floor is piecewise constant: it passes no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from fluidps.ir.infer import InferContext
from fluidps.ops.defs import In, Out, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import ElementForm, LoweringOp
from fluidps.ops.registry import OpFamily

family = OpFamily("activation")

_ATTRS = backend_hints("use_mkldnn", "use_cudnn", "use_onednn", "mkldnn_data_type", "onednn_data_type")
_FROM_OUT = GradSpec(outputs=("Out",), like=(("X", "Out"),))
_FROM_X = GradSpec(inputs=("X",))
_GRADS = {
    "relu": _FROM_OUT,
    "sigmoid": _FROM_OUT,
    "tanh": _FROM_OUT,
    "exp": _FROM_OUT,
    "sqrt": _FROM_OUT,
    "log": _FROM_X,
    "square": _FROM_X,
    "floor": None,
}


def _infer(ctx: InferContext) -> None:
    ctx.share("Out", ctx.input("X"))


for _type, _grad in _GRADS.items():
    family.define(_type, inputs=[In("X")], outputs=[Out("Out")], attrs=_ATTRS, grad=_grad, infer=_infer)


# -- kernels: one element's function per op (what fused compiled loops call too, so both
# give the same bits), mapped over contiguous arrays; results stored in the input's dtype.


@njit(cache=True)
def relu_element(x):
    return x if x > 0 else 0


@njit(cache=True)
def relu_grad_element(out, dout):
    return dout if out > 0 else 0


@njit(cache=True)
def sigmoid_element(x):
    return 1.0 / (1.0 + np.exp(-x))


@njit(cache=True)
def sigmoid_grad_element(out, dout):
    return dout * out * (1 - out)


@njit(cache=True)
def tanh_element(x):
    return np.tanh(x)


@njit(cache=True)
def tanh_grad_element(out, dout):
    return dout * (1 - out * out)


@njit(cache=True)
def exp_element(x):
    return np.exp(x)


@njit(cache=True)
def exp_grad_element(out, dout):
    return dout * out


@njit(cache=True)
def sqrt_element(x):
    return np.sqrt(x)


@njit(cache=True)
def sqrt_grad_element(out, dout):
    return dout * 0.5 / out


@njit(cache=True)
def log_element(x):
    return np.log(x)


@njit(cache=True)
def log_grad_element(x, dout):
    return dout / x


@njit(cache=True)
def square_element(x):
    return x * x


@njit(cache=True)
def square_grad_element(x, dout):
    return 2 * dout * x


@njit(cache=True)
def floor_element(x):
    return np.floor(x)


# (numba compiles a kernel per element function it calls: one loop each, written out)


@njit(cache=True)
def _relu(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = relu_element(xs[i])
    return out


@njit(cache=True)
def _relu_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = relu_grad_element(o[i], d[i])
    return dx


@njit(cache=True)
def _sigmoid(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = sigmoid_element(xs[i])
    return out


@njit(cache=True)
def _sigmoid_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = sigmoid_grad_element(o[i], d[i])
    return dx


@njit(cache=True)
def _tanh(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = tanh_element(xs[i])
    return out


@njit(cache=True)
def _tanh_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = tanh_grad_element(o[i], d[i])
    return dx


@njit(cache=True)
def _exp(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = exp_element(xs[i])
    return out


@njit(cache=True)
def _exp_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = exp_grad_element(o[i], d[i])
    return dx


@njit(cache=True)
def _sqrt(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = sqrt_element(xs[i])
    return out


@njit(cache=True)
def _sqrt_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = sqrt_grad_element(o[i], d[i])
    return dx


@njit(cache=True)
def _log(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = log_element(xs[i])
    return out


@njit(cache=True)
def _log_grad(x, dout):
    dx = np.empty_like(dout)
    xs, d, r = x.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(xs.size):
        r[i] = log_grad_element(xs[i], d[i])
    return dx


@njit(cache=True)
def _square(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = square_element(xs[i])
    return out


@njit(cache=True)
def _square_grad(x, dout):
    dx = np.empty_like(dout)
    xs, d, r = x.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(xs.size):
        r[i] = square_grad_element(xs[i], d[i])
    return dx


@njit(cache=True)
def _floor(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = floor_element(xs[i])
    return out


class _Activation(NamedTuple):
    forward: Callable[..., Any]  # array kernels
    grad: Callable[..., Any] | None
    grad_reads: str | None  # the slot the grad reads besides Out@GRAD
    element: Callable[..., Any]  # their element functions
    grad_element: Callable[..., Any] | None


_KERNELS = {
    "relu": _Activation(_relu, _relu_grad, "Out", relu_element, relu_grad_element),
    "sigmoid": _Activation(_sigmoid, _sigmoid_grad, "Out", sigmoid_element, sigmoid_grad_element),
    "tanh": _Activation(_tanh, _tanh_grad, "Out", tanh_element, tanh_grad_element),
    "exp": _Activation(_exp, _exp_grad, "Out", exp_element, exp_grad_element),
    "sqrt": _Activation(_sqrt, _sqrt_grad, "Out", sqrt_element, sqrt_grad_element),
    "log": _Activation(_log, _log_grad, "X", log_element, log_grad_element),
    "square": _Activation(_square, _square_grad, "X", square_element, square_grad_element),
    "floor": _Activation(_floor, None, None, floor_element, None),
}
_WITH_GRAD = [t for t, kernels in _KERNELS.items() if kernels.grad is not None]


@family.kernel(*_KERNELS)
def _forward_kernel(op: KernelOp) -> Runner:
    fn = _KERNELS[op.type].forward
    x_name, out_name = op.input("X"), op.output("Out")

    def run(env: Env) -> None:
        env[out_name] = fn(contiguous(env[x_name]))

    return run


@family.kernel(*(t + "_grad" for t in _WITH_GRAD))
def _grad_kernel(op: KernelOp) -> Runner:
    kernels = _KERNELS[op.type[: -len("_grad")]]
    fn, source = kernels.grad, kernels.grad_reads
    src_name, dout_name, dx_name = op.input(source), op.input("Out@GRAD"), op.output("X@GRAD")

    def run(env: Env) -> None:
        env[dx_name] = fn(contiguous(env[src_name]), contiguous(env[dout_name]))

    return run


for _type, _kernels in _KERNELS.items():
    family.elementwise(_type, ElementForm(_kernels.element, ("X",), ("Out",)))
    if _kernels.grad_element is not None:
        family.elementwise(
            _type + "_grad",
            ElementForm(_kernels.grad_element, (_kernels.grad_reads, "Out@GRAD"), ("X@GRAD",)),
        )


@family.lowering(*_KERNELS)
def _forward_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out")
    op.emit(f"{op.output('Out')} = {op.call(_KERNELS[op.type].forward, op.input('X'))}")


@family.lowering(*(t + "_grad" for t in _WITH_GRAD))
def _grad_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    kernels = _KERNELS[op.type[: -len("_grad")]]
    fn, source = kernels.grad, kernels.grad_reads
    op.require_dense(source, "Out@GRAD", "X@GRAD")
    op.emit(f"{op.output('X@GRAD')} = {op.call(fn, op.input(source), op.input('Out@GRAD'))}")
