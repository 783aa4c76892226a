"""Unary activations: relu, sigmoid, tanh, exp, log, sqrt, square (and floor).

Each activation is written once, in the table ACTIVATIONS: its forward rule and its
gradient rule, numba functions of one element (as tinygrad and JAX keep one rule per
primitive), and which slot the gradient rule reads besides Out@GRAD. Everything else
is made from the table: the op definitions and grad makers, the array kernels (one
loop per rule, generated below), the element forms that fused compiled loops call
(the same rules, so both ways of running give the same bits), and the lowerings of
a single op.

Where the derivative is a function of the output (relu, sigmoid, tanh, exp,
sqrt) the grad op reads Out, as in Fluid, so X can be freed early; log and
square read X. floor is piecewise constant: it passes no gradient.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from fluidps.ir.infer import InferContext
from fluidps.ops.defs import In, Out, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import ElementForm, LoweringOp
from fluidps.ops.registry import OpFamily

# -- the rules: one element's forward value, and its gradient from (Out or X, Out@GRAD) --


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


class Rules(NamedTuple):
    forward: Callable[..., Any]  # x -> out
    grad: Callable[..., Any] | None  # (grad_reads's element, dout) -> dx; None: no gradient
    grad_reads: str | None  # the forward slot the gradient rule reads: "Out" or "X"


ACTIVATIONS: Mapping[str, Rules] = MappingProxyType(
    {
        "relu": Rules(relu_element, relu_grad_element, "Out"),
        "sigmoid": Rules(sigmoid_element, sigmoid_grad_element, "Out"),
        "tanh": Rules(tanh_element, tanh_grad_element, "Out"),
        "exp": Rules(exp_element, exp_grad_element, "Out"),
        "sqrt": Rules(sqrt_element, sqrt_grad_element, "Out"),
        "log": Rules(log_element, log_grad_element, "X"),
        "square": Rules(square_element, square_grad_element, "X"),
        "floor": Rules(floor_element, None, None),
    }
)
_WITH_GRAD = [t for t, rules in ACTIVATIONS.items() if rules.grad is not None]

# -- the definitions ---------------------------------------------------------------------

family = OpFamily("activation")

_ATTRS = backend_hints("use_mkldnn", "use_cudnn", "use_onednn", "mkldnn_data_type", "onednn_data_type")
_GRAD_SPECS = {
    "Out": GradSpec(outputs=("Out",), like=(("X", "Out"),)),  # X@GRAD has Out's shape
    "X": GradSpec(inputs=("X",)),
}


def _infer(ctx: InferContext) -> None:
    ctx.share("Out", ctx.input("X"))


for _type, _rules in ACTIVATIONS.items():
    _grad = _GRAD_SPECS[_rules.grad_reads] if _rules.grad_reads is not None else None
    family.define(_type, inputs=[In("X")], outputs=[Out("Out")], attrs=_ATTRS, grad=_grad, infer=_infer)

# -- the array kernels: each rule mapped over contiguous arrays, results in the input's dtype.
# numba compiles a loop per element function it calls, so each rule gets a kernel of its own:
# the code of one of these two loops, given globals in which `rule` is that rule (numba reads
# a global as a constant and compiles the call to it). A kernel is a plain function with its
# own name, and the file and line of its loop, so numba caches it (cache=True) under that
# name; a closure over the rule would not do: numba keys a closure's cache by its pickled
# cells, and a pickled dispatcher differs in every process.


def _forward_loop(x):
    out = np.empty_like(x)
    xs, os = x.reshape(-1), out.reshape(-1)
    for i in range(xs.size):
        os[i] = rule(xs[i])  # noqa: F821 (a global of each generated kernel: see _kernel)
    return out


def _grad_loop(source, dout):
    dx = np.empty_like(dout)
    s, d, r = source.reshape(-1), dout.reshape(-1), dx.reshape(-1)
    for i in range(s.size):
        r[i] = rule(s[i], d[i])  # noqa: F821 (a global of each generated kernel: see _kernel)
    return dx


def _kernel(loop: Callable[..., Any], rule: Callable[..., Any], name: str) -> Callable[..., Any]:
    """`loop`'s code as module-level function `name` calling `rule`, numba-compiled and cached."""
    fn = types.FunctionType(loop.__code__, {"__name__": __name__, "np": np, "rule": rule}, name)
    fn.__qualname__ = name  # (numba's cache file is named by it)
    return njit(cache=True)(fn)


class _Kernels(NamedTuple):
    forward: Callable[..., Any]
    grad: Callable[..., Any] | None


_KERNELS = {
    t: _Kernels(
        _kernel(_forward_loop, rules.forward, f"_{t}"),
        _kernel(_grad_loop, rules.grad, f"_{t}_grad") if rules.grad is not None else None,
    )
    for t, rules in ACTIVATIONS.items()
}
# Module attributes under their own names: compiled segments import the kernels they call by
# module and name (fluidps.executor.compiler.codegen), as they import any numba helper.
globals().update({k.__name__: k for kernels in _KERNELS.values() for k in kernels if k is not None})


@family.kernel(*ACTIVATIONS)
def _forward_kernel(op: KernelOp) -> Runner:
    fn = _KERNELS[op.type].forward
    x_name, out_name = op.input("X"), op.output("Out")

    def run(env: Env) -> None:
        env[out_name] = fn(contiguous(env[x_name]))

    return run


@family.kernel(*(t + "_grad" for t in _WITH_GRAD))
def _grad_kernel(op: KernelOp) -> Runner:
    forward = op.type[: -len("_grad")]
    fn, source = _KERNELS[forward].grad, ACTIVATIONS[forward].grad_reads
    src_name, dout_name, dx_name = op.input(source), op.input("Out@GRAD"), op.output("X@GRAD")

    def run(env: Env) -> None:
        env[dx_name] = fn(contiguous(env[src_name]), contiguous(env[dout_name]))

    return run


# -- compiled segments: fused runs call the rules; a single op calls its array kernel ----------

for _type, _rules in ACTIVATIONS.items():
    family.elementwise(_type, ElementForm(_rules.forward, ("X",), ("Out",)))
    if _rules.grad is not None:
        family.elementwise(
            _type + "_grad", ElementForm(_rules.grad, (_rules.grad_reads, "Out@GRAD"), ("X@GRAD",))
        )


@family.lowering(*ACTIVATIONS)
def _forward_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out")
    op.emit(f"{op.output('Out')} = {op.call(_KERNELS[op.type].forward, op.input('X'))}")


@family.lowering(*(t + "_grad" for t in _WITH_GRAD))
def _grad_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    forward = op.type[: -len("_grad")]
    fn, source = _KERNELS[forward].grad, ACTIVATIONS[forward].grad_reads
    op.require_dense(source, "Out@GRAD", "X@GRAD")
    op.emit(f"{op.output('X@GRAD')} = {op.call(fn, op.input(source), op.input('Out@GRAD'))}")
