"""Unary activations: relu, sigmoid, tanh, exp, log, sqrt, square (and floor).

Where the derivative is a function of the output (relu, sigmoid, tanh, exp,
sqrt) the grad op reads Out, as in Fluid, so X can be freed early; log and
square read X. floor is piecewise constant: it passes no gradient.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.ir.infer import InferContext
from fluidps.ops.defs import In, Out, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp
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


# -- kernels: flat loops over contiguous arrays; results stored in the input's dtype -------


@njit(cache=True)
def _relu(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = xs[i] if xs[i] > 0 else 0
    return out


@njit(cache=True)
def _relu_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = d[i] if o[i] > 0 else 0
    return dx


@njit(cache=True)
def _sigmoid(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = 1.0 / (1.0 + np.exp(-xs[i]))
    return out


@njit(cache=True)
def _sigmoid_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = d[i] * o[i] * (1 - o[i])
    return dx


@njit(cache=True)
def _tanh(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = np.tanh(xs[i])
    return out


@njit(cache=True)
def _tanh_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = d[i] * (1 - o[i] * o[i])
    return dx


@njit(cache=True)
def _exp(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = np.exp(xs[i])
    return out


@njit(cache=True)
def _exp_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = d[i] * o[i]
    return dx


@njit(cache=True)
def _sqrt(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = np.sqrt(xs[i])
    return out


@njit(cache=True)
def _sqrt_grad(out, dout):
    dx = np.empty_like(dout)
    o, d, r = out.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(o.size):
        r[i] = d[i] * 0.5 / o[i]
    return dx


@njit(cache=True)
def _log(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = np.log(xs[i])
    return out


@njit(cache=True)
def _log_grad(x, dout):
    dx = np.empty_like(dout)
    xs, d, r = x.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(xs.size):
        r[i] = d[i] / xs[i]
    return dx


@njit(cache=True)
def _square(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = xs[i] * xs[i]
    return out


@njit(cache=True)
def _square_grad(x, dout):
    dx = np.empty_like(dout)
    xs, d, r = x.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(xs.size):
        r[i] = 2 * d[i] * xs[i]
    return dx


@njit(cache=True)
def _floor(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = np.floor(xs[i])
    return out


# op type -> (forward, grad, slot the grad reads besides Out@GRAD)
_KERNELS = {
    "relu": (_relu, _relu_grad, "Out"),
    "sigmoid": (_sigmoid, _sigmoid_grad, "Out"),
    "tanh": (_tanh, _tanh_grad, "Out"),
    "exp": (_exp, _exp_grad, "Out"),
    "sqrt": (_sqrt, _sqrt_grad, "Out"),
    "log": (_log, _log_grad, "X"),
    "square": (_square, _square_grad, "X"),
    "floor": (_floor, None, None),
}


@family.kernel(*_KERNELS)
def _forward_kernel(op: KernelOp) -> Runner:
    fn = _KERNELS[op.type][0]
    x_name, out_name = op.input("X"), op.output("Out")

    def run(env: Env) -> None:
        env[out_name] = fn(contiguous(env[x_name]))

    return run


@family.kernel(*(t + "_grad" for t, (_, grad, _) in _KERNELS.items() if grad is not None))
def _grad_kernel(op: KernelOp) -> Runner:
    _, fn, source = _KERNELS[op.type[: -len("_grad")]]
    src_name, dout_name, dx_name = op.input(source), op.input("Out@GRAD"), op.output("X@GRAD")

    def run(env: Env) -> None:
        env[dx_name] = fn(contiguous(env[src_name]), contiguous(env[dout_name]))

    return run


@family.lowering(*_KERNELS)
def _forward_lowering(op: LoweringOp) -> None:
    op.require_dense("X", "Out")
    op.emit(f"{op.output('Out')} = {op.call(_KERNELS[op.type][0], op.input('X'))}")


@family.lowering(*(t + "_grad" for t, (_, grad, _) in _KERNELS.items() if grad is not None))
def _grad_lowering(op: LoweringOp) -> None:
    _, fn, source = _KERNELS[op.type[: -len("_grad")]]
    op.require_dense(source, "Out@GRAD", "X@GRAD")
    op.emit(f"{op.output('X@GRAD')} = {op.call(fn, op.input(source), op.input('Out@GRAD'))}")
