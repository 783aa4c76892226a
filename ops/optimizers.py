"""Optimizer ops: sgd, momentum, adam, adagrad, ftrl.

Each updates a parameter in place (ParamOut names the same variable as
Param) from a dense or SelectedRows gradient. Paddle's mixed-precision
master weights and its tensor-valued hyper-parameters are accepted only when
unused.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.ir.infer import InferContext, numel
from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.ops.defs import Bool, Compat, Extra, Float, Hint, In, Long, Only, Out, Str, backend_hints
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.lowering import BatchForm, LoweringOp, NotLowerable
from fluidps.ops.optimizer_rows import AHEAD, RowSlots, Step, prefetch_row, update_loop
from fluidps.ops.registry import OpFamily

family = OpFamily("optimizers")

_NO_MASTER = Compat(Bool("multi_precision", False), hint="mixed-precision master weights are not supported")


# One-value inputs: compiled updates read (and write) their element [0] unchecked.
_SCALARS = ("LearningRate", "Beta1Pow", "Beta2Pow")


def _infer_update(*state: str, accumulators: tuple[str, ...] = ()):
    """Outputs `<slot>Out` share their input slot's shape; the gradient and each state
    input (`state`, and `accumulators`, whose outputs are named otherwise) must have
    Param's elements, as the kernels index them by Param's; scalars must hold one value."""

    def infer(ctx: InferContext) -> None:
        param, grad = ctx.input("Param"), ctx.input("Grad")
        size = numel(param.shape)
        for slot in ("LearningRate", *state, *accumulators):
            info, scalar = ctx.input(slot), slot in _SCALARS
            if numel(info.shape) not in (1, -1) if scalar else -1 < numel(info.shape) != size > -1:
                ctx.fail(
                    f"{slot} {info.describe()} must hold {'one value' if scalar else 'as many elements as Param'}"
                )
        if (
            grad.shape[1:] != param.shape[1:]
            if grad.type == VarType.SELECTED_ROWS
            else len(grad.shape) != len(param.shape) or -1 < numel(grad.shape) != size > -1
        ):
            ctx.fail(
                f"Grad {grad.describe()} does not match Param of shape {list(param.shape)} ({param.name})"
            )
        for slot in ("Param", *state):
            if ctx.has_output(slot + "Out"):
                ctx.share(slot + "Out", ctx.input(slot))

    return infer


family.define(
    "sgd",
    inputs=[In("Param"), In("Grad"), In("LearningRate"), Extra("MasterParam")],
    outputs=[Out("ParamOut"), Extra("MasterParamOut")],
    attrs=[_NO_MASTER, *backend_hints("use_mkldnn", "use_onednn")],
    infer=_infer_update(),
)

family.define(
    "momentum",
    inputs=[In("Param"), In("Grad"), In("Velocity"), In("LearningRate"), Extra("MasterParam")],
    outputs=[Out("ParamOut"), Out("VelocityOut"), Extra("MasterParamOut")],
    attrs=[
        Float("mu"),
        Bool("use_nesterov", False),
        # Paddle 2 can fold L2 decay into the update: grad + coeff * param.
        Compat(Str("regularization_method", ""), "", "l2_decay"),
        Hint(Float("regularization_coeff", 0.0)),
        Hint(Float("rescale_grad", 1.0)),
        _NO_MASTER,
    ],
    infer=_infer_update("Velocity"),
)

family.define(
    "adam",
    inputs=[
        In("Param"),
        In("Grad"),
        In("LearningRate"),
        In("Moment1"),
        In("Moment2"),
        In("Beta1Pow"),
        In("Beta2Pow"),
        Extra("MasterParam"),
        Extra("Beta1Tensor"),
        Extra("Beta2Tensor"),
        Extra("EpsilonTensor"),
        Extra("SkipUpdate"),
        Extra("Moment2Max"),
    ],
    outputs=[
        Out("ParamOut"),
        Out("Moment1Out"),
        Out("Moment2Out"),
        Out("Beta1PowOut", opt=True),
        Out("Beta2PowOut", opt=True),
        Extra("MasterParamOut"),
        Extra("Moment2MaxOut"),
    ],
    attrs=[
        Float("beta1", 0.9),
        Float("beta2", 0.999),
        Float("epsilon", 1e-8),
        # Sparse gradients update only their rows' moments (Fluid's lazy Adam).
        Bool("lazy_mode", False),
        Hint(Long("min_row_size_to_use_multithread", 1000)),
        _NO_MASTER,
        Compat(Bool("use_global_beta_pow", False), hint="global beta powers are not supported"),
        Compat(Bool("amsgrad", False), hint="AMSGrad is not supported"),
    ],
    infer=_infer_update("Moment1", "Moment2", "Beta1Pow", "Beta2Pow"),
)

family.define(
    "adagrad",
    inputs=[In("Param"), In("Grad"), In("Moment"), In("LearningRate"), Extra("MasterParam")],
    outputs=[Out("ParamOut"), Out("MomentOut"), Extra("MasterParamOut")],
    attrs=[Float("epsilon", 1e-6), _NO_MASTER],
    infer=_infer_update("Moment"),
)


family.define(
    "ftrl",
    inputs=[
        In("Param"),
        In("SquaredAccumulator"),
        In("LinearAccumulator"),
        In("Grad"),
        In("LearningRate"),
    ],
    outputs=[Out("ParamOut"), Out("SquaredAccumOut"), Out("LinearAccumOut")],
    attrs=[
        Float("l1", 0.0),
        Float("l2", 0.0),
        Only(Float("lr_power", -0.5), hint="fluidps's FTRL supports only lr_power -0.5"),
    ],
    infer=_infer_update(accumulators=("SquaredAccumulator", "LinearAccumulator")),
)

# -- kernels -----------------------------------------------------------------------------
# Every update is a row update of the parameter seen as a [rows, width] table
# (optimizer_rows.py: a dense gradient is the one row [0]). Scalars (learning rate,
# betas, epsilon, bias corrections) are numpy scalars of the parameter's dtype,
# computed in Python as Fluid computes them in T, so float32 arithmetic stays
# float32 inside the loops.

# The rules whose sparse kernels sum a gradient's repeated rows before applying them
# (sgd applies each in turn). For these, rows summed earlier (a distributed table's
# trainer does) update the parameter bit for bit as the repeated rows would.
SUMS_REPEATED_ROWS = frozenset({"momentum", "adagrad", "ftrl", "adam"})


@update_loop
def _sgd_rows(p, rows, g, lr):
    # Rows are not merged: a repeated row takes each of its gradients in turn.
    for k in range(rows.shape[0]):
        if k + AHEAD < rows.shape[0]:
            prefetch_row(p, rows[k + AHEAD])
        r = rows[k]
        for j in range(p.shape[1]):
            p[r, j] -= lr * g[k, j]


@update_loop
def _momentum_rows(p, v, rows, g, lr, mu, rescale, use_l2, l2, nesterov):
    for k in range(rows.shape[0]):
        if k + AHEAD < rows.shape[0]:
            prefetch_row(p, rows[k + AHEAD])
            prefetch_row(v, rows[k + AHEAD])
        r = rows[k]
        for j in range(p.shape[1]):
            gj = g[k, j] * rescale
            if use_l2:
                gj = gj + l2 * p[r, j]
            vj = v[r, j] * mu + gj
            v[r, j] = vj
            if nesterov:
                p[r, j] -= (gj + vj * mu) * lr
            else:
                p[r, j] -= lr * vj


@update_loop
def _adagrad_rows(p, m, rows, g, lr, eps):
    for k in range(rows.shape[0]):
        if k + AHEAD < rows.shape[0]:
            prefetch_row(p, rows[k + AHEAD])
            prefetch_row(m, rows[k + AHEAD])
        r = rows[k]
        for j in range(p.shape[1]):
            gj = g[k, j]
            mj = m[r, j] + gj * gj
            m[r, j] = mj
            p[r, j] -= lr * gj / (np.sqrt(mj) + eps)


@update_loop
def _ftrl_rows(p, squared, linear, rows, g, lr, l1, l2):
    """FTRL-proximal with learning-rate power -1/2, Paddle's formula."""
    for k in range(rows.shape[0]):
        r = rows[k]
        for j in range(p.shape[1]):
            gj = g[k, j]
            old = squared[r, j]
            new = old + gj * gj
            lin = linear[r, j] + gj - (np.sqrt(new) - np.sqrt(old)) / lr * p[r, j]
            if abs(lin) > l1:
                sign = 1 if lin > 0 else -1
                p[r, j] = (l1 * sign - lin) / (np.sqrt(new) / lr + 2 * l2)
            else:
                p[r, j] = 0
            squared[r, j] = new
            linear[r, j] = lin


@update_loop
def _adam_row(p, m1, m2, r, g, lr_t, b1, b2, one_b1, one_b2, eps_t):
    for j in range(p.shape[1]):
        gj = g[j]
        a = b1 * m1[r, j] + one_b1 * gj
        b = b2 * m2[r, j] + one_b2 * gj * gj
        m1[r, j] = a
        m2[r, j] = b
        p[r, j] -= lr_t * (a / (np.sqrt(b) + eps_t))


@update_loop
def _adam_rows(p, m1, m2, rows, g, lr_t, b1, b2, one_b1, one_b2, eps_t, every_row):
    """Adam over `rows` (unique); with every_row (rows then sorted), also over every
    other row with a zero gradient (Fluid's non-lazy sparse Adam: the dense update)."""
    if not every_row:
        for k in range(rows.shape[0]):
            if k + AHEAD < rows.shape[0]:
                ahead = rows[k + AHEAD]
                prefetch_row(p, ahead)
                prefetch_row(m1, ahead)
                prefetch_row(m2, ahead)
            _adam_row(p, m1, m2, rows[k], g[k], lr_t, b1, b2, one_b1, one_b2, eps_t)
        return
    zero = np.zeros(p.shape[1], dtype=g.dtype)
    k = 0
    for r in range(p.shape[0]):
        if k < rows.shape[0] and rows[k] == r:
            _adam_row(p, m1, m2, r, g[k], lr_t, b1, b2, one_b1, one_b2, eps_t)
            k += 1
        else:
            _adam_row(p, m1, m2, r, zero, lr_t, b1, b2, one_b1, one_b2, eps_t)


@family.kernel("sgd")
def _sgd_kernel(op: KernelOp) -> Runner:
    def run(env: Env) -> None:
        step = Step(op, env)
        lr = step.value("LearningRate")
        rows, g, view, _ = step.grad(merge=False)
        _sgd_rows(step.state("Param").reshape(view), rows, g, lr)

    return run


@family.kernel("momentum")
def _momentum_kernel(op: KernelOp) -> Runner:
    mu, nesterov = op.attr("mu"), bool(op.attr("use_nesterov"))
    use_l2 = op.attr("regularization_method") == "l2_decay"
    coeff, rescale = op.attr("regularization_coeff"), op.attr("rescale_grad")

    slots = RowSlots()

    def run(env: Env) -> None:
        step = Step(op, env, slots)
        lr, t = step.value("LearningRate"), step.scalar
        rows, g, view, _ = step.grad(merge=True)
        p, v = step.state("Param").reshape(view), step.state("Velocity").reshape(view)
        # A sparse gradient updates only its (merged) rows, as DESIGN section 4 asks. Fluid's
        # kernel instead walks every row, decaying the velocity of rows absent from the
        # gradient: the two agree where that velocity is zero. Empty: nothing changes (as Fluid).
        _momentum_rows(p, v, rows, g, lr, t(mu), t(rescale), use_l2, t(coeff), nesterov)

    return run


@family.kernel("adagrad")
def _adagrad_kernel(op: KernelOp) -> Runner:
    epsilon = op.attr("epsilon")

    slots = RowSlots()

    def run(env: Env) -> None:
        step = Step(op, env, slots)
        lr = step.value("LearningRate")
        rows, g, view, _ = step.grad(merge=True)
        p, m = step.state("Param").reshape(view), step.state("Moment").reshape(view)
        _adagrad_rows(p, m, rows, g, lr, step.scalar(epsilon))

    return run


@family.kernel("ftrl")
def _ftrl_kernel(op: KernelOp) -> Runner:
    l1, l2 = op.attr("l1"), op.attr("l2")
    slots = RowSlots()

    def run(env: Env) -> None:
        step = Step(op, env, slots)
        lr = step.value("LearningRate")
        rows, g, view, _ = step.grad(merge=True)
        p = step.state("Param").reshape(view)
        squared = step.state("SquaredAccumulator", "SquaredAccumOut").reshape(view)
        linear = step.state("LinearAccumulator", "LinearAccumOut").reshape(view)
        _ftrl_rows(p, squared, linear, rows, g, lr, step.scalar(l1), step.scalar(l2))

    return run


@family.kernel("adam")
def _adam_kernel(op: KernelOp) -> Runner:
    beta1, beta2, epsilon = op.attr("beta1"), op.attr("beta2"), op.attr("epsilon")
    lazy = bool(op.attr("lazy_mode"))

    slots = RowSlots()

    def run(env: Env) -> None:
        step = Step(op, env, slots)
        t = step.scalar
        lr, b1_pow, b2_pow = step.value("LearningRate"), step.value("Beta1Pow"), step.value("Beta2Pow")
        # The non-lazy sparse update walks every row, matching the gradient's rows in order.
        rows, g, view, sparse = step.grad(merge=True, sort=not lazy)
        p, m1 = step.state("Param").reshape(view), step.state("Moment1").reshape(view)
        m2 = step.state("Moment2").reshape(view)
        b1, b2, one = t(beta1), t(beta2), t(1)
        # Fluid skips the whole step, beta powers included, for an empty sparse gradient.
        advance = not (sparse and rows.shape[0] == 0)
        if advance:
            # Fluid's sparse kernel writes Beta{1,2}PowOut before it updates and then reads
            # Beta{1,2}Pow, so when the output is the input variable (every Fluid program)
            # the bias correction uses the next step's powers. PaddlePaddle 3.3.1's own
            # numbers (tests/integration/test_paddle_trajectories.py) follow this.
            if sparse and op.output("Beta1PowOut") == op.input("Beta1Pow"):
                b1_pow = b1_pow * b1
            if sparse and op.output("Beta2PowOut") == op.input("Beta2Pow"):
                b2_pow = b2_pow * b2
            lr_t = lr * (np.sqrt(one - b2_pow) / (one - b1_pow))
            eps_t = t(epsilon) * np.sqrt(one - b2_pow)
            _adam_rows(p, m1, m2, rows, g, lr_t, b1, b2, one - b1, one - b2, eps_t, sparse and not lazy)
        for slot, beta in (("Beta1Pow", b1), ("Beta2Pow", b2)):
            if op.output(slot + "Out") is not None:
                power = step.value(slot)
                _store_pow(env, op, slot, power * beta if advance else power)

    return run


def _store_pow(env: Env, op: KernelOp, slot: str, value: np.generic) -> None:
    """Write a beta power into `<slot>Out`: in place when it names the input, in the input's dtype."""
    in_name, out_name = op.input(slot), op.output(slot + "Out")
    current = env[in_name]
    in_place = (
        out_name == in_name
        and isinstance(current, np.ndarray)
        and current.flags.c_contiguous
        and current.flags.writeable
    )
    target = current if in_place else np.array(current, order="C")
    target.reshape(-1)[0] = value
    env[out_name] = target


# -- lowerings: dense updates in place (what a trainer's optimizer ops are) --------------------


@njit(cache=True)
def require_same_size(param, grad):
    """Raise (numba does no bounds checks) when a gradient does not match its parameter;
    the interpreter then says which."""
    if param.size != grad.size:
        raise ValueError("a gradient does not match its parameter")


def _in_place(op: LoweringOp, *slots: str) -> None:
    op.require_dense("Param", "Grad")
    for slot in slots:
        if op.op.output(slot + "Out") != op.op.input(slot):
            raise NotLowerable(f"{slot}Out is not {slot}: not an update in place")


@family.lowering("sgd")
def _sgd_lowering(op: LoweringOp) -> None:
    _in_place(op, "Param")
    p, g, lr = op.input("Param"), op.input("Grad"), op.input("LearningRate")
    dtype = to_numpy_dtype(op.declared_dtype("Param"))
    op.emit(op.call(require_same_size, p, g))
    rate = f"np.{dtype.name}({lr}.reshape(-1)[0])"
    rows = "np.zeros(1, np.int64)"  # the one row of a dense update (as Step.grad gives it)
    op.emit(op.call(_sgd_rows, f"{p}.reshape((1, {p}.size))", rows, f"{g}.reshape((1, {g}.size))", rate))


@family.lowering("adam")
def _adam_lowering(op: LoweringOp) -> None:
    _in_place(op, "Param", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow")
    p, g = op.input("Param"), op.input("Grad")
    m1, m2 = op.input("Moment1"), op.input("Moment2")
    b1_pow, b2_pow = op.input("Beta1Pow"), op.input("Beta2Pow")
    t = f"np.{to_numpy_dtype(op.declared_dtype('Param')).name}"
    for array in (g, m1, m2):
        op.emit(op.call(require_same_size, p, array))
    lr, b1p, b2p, one, b1, b2 = (op.temp() for _ in range(6))
    op.emit(f"{lr} = {t}({op.input('LearningRate')}.reshape(-1)[0])")
    op.emit(f"{b1p}, {b2p} = {t}({b1_pow}.reshape(-1)[0]), {t}({b2_pow}.reshape(-1)[0])")
    op.emit(f"{one}, {b1}, {b2} = {t}(1), {t}({op.attr('beta1')!r}), {t}({op.attr('beta2')!r})")
    # As the kernel's dense step: bias-corrected rate and epsilon in Param's dtype.
    lr_t, eps_t = op.temp(), op.temp()
    op.emit(f"{lr_t} = {lr} * (np.sqrt({one} - {b2p}) / ({one} - {b1p}))")
    op.emit(f"{eps_t} = {t}({op.attr('epsilon')!r}) * np.sqrt({one} - {b2p})")
    views = [f"{a}.reshape((1, {a}.size))" for a in (p, m1, m2)]
    rows = "np.zeros(1, np.int64)"
    args = [
        *views,
        rows,
        f"{g}.reshape((1, {g}.size))",
        lr_t,
        b1,
        b2,
        f"{one} - {b1}",
        f"{one} - {b2}",
        eps_t,
    ]
    op.emit(op.call(_adam_rows, *args, "False"))
    op.emit(f"{b1_pow}.reshape(-1)[0] = {b1p} * {b1}")
    op.emit(f"{b2_pow}.reshape(-1)[0] = {b2p} * {b2}")


# -- batches: consecutive updates of many parameters as one loop (fluidps.executor.compiler.batching)
# Each parameter gets exactly its own op's lowering's arithmetic, in op order.


def _tuple(parts: list[str]) -> str:
    return f"({', '.join(parts)},)"


def _rows_view(local: str) -> str:
    return f"{local}.reshape((1, {local}.size))"


def _dtypes(op: LoweringOp, *slots: str) -> tuple[str, ...]:
    return tuple(to_numpy_dtype(op.declared_dtype(slot)).name for slot in slots)


def _rate(op: LoweringOp) -> str:
    return f"np.{_dtypes(op, 'Param')[0]}({op.input('LearningRate')}.reshape(-1)[0])"


@update_loop
def sgd_many(params, grads, rates):
    """sgd of every parameter of a batch in turn (params, grads: (1, size) views)."""
    rows = np.zeros(1, np.int64)
    for k in range(len(params)):
        require_same_size(params[k], grads[k])
        _sgd_rows(params[k], rows, grads[k], rates[k])


def _sgd_key(op: LoweringOp) -> tuple[str, ...] | None:
    dtypes = _dtypes(op, "Param", "Grad")
    return dtypes if len(set(dtypes)) == 1 else None  # one tuple type per operand


def _sgd_batch(ops: list[LoweringOp]) -> list[str]:
    params = _tuple([_rows_view(op.input("Param")) for op in ops])
    grads = _tuple([_rows_view(op.input("Grad")) for op in ops])
    return [ops[0].call(sgd_many, params, grads, _tuple([_rate(op) for op in ops]))]


@update_loop
def adam_many(params, grads, m1s, m2s, b1_pows, b2_pows, rates, b1, b2, epsilon, one):
    """Dense adam of every parameter of a batch in turn, as _adam_lowering's statements."""
    rows = np.zeros(1, np.int64)
    for k in range(len(params)):
        p, g, m1, m2 = params[k], grads[k], m1s[k], m2s[k]
        require_same_size(p, g)
        require_same_size(p, m1)
        require_same_size(p, m2)
        b1p, b2p = b1_pows[k][0], b2_pows[k][0]
        lr_t = rates[k] * (np.sqrt(one - b2p) / (one - b1p))
        eps_t = epsilon * np.sqrt(one - b2p)
        _adam_rows(p, m1, m2, rows, g, lr_t, b1, b2, one - b1, one - b2, eps_t, False)
        b1_pows[k][0] = b1p * b1
        b2_pows[k][0] = b2p * b2


_ADAM_SLOTS = ("Param", "Grad", "Moment1", "Moment2", "Beta1Pow", "Beta2Pow")


def _adam_key(op: LoweringOp) -> tuple[object, ...] | None:
    dtypes = _dtypes(op, *_ADAM_SLOTS)
    if len(set(dtypes)) != 1:
        return None
    return (dtypes[0], op.attr("beta1"), op.attr("beta2"), op.attr("epsilon"))


def _adam_batch(ops: list[LoweringOp]) -> list[str]:
    t = f"np.{_dtypes(ops[0], 'Param')[0]}"
    views = [
        _tuple([_rows_view(op.input(slot)) for op in ops]) for slot in ("Param", "Grad", "Moment1", "Moment2")
    ]
    pows = [_tuple([f"{op.input(slot)}.reshape(-1)" for op in ops]) for slot in ("Beta1Pow", "Beta2Pow")]
    first = ops[0]
    constants = [f"{t}({first.attr(name)!r})" for name in ("beta1", "beta2", "epsilon")]
    args = [*views, *pows, _tuple([_rate(op) for op in ops]), *constants, f"{t}(1)"]
    return [first.call(adam_many, *args)]


family.batched("sgd", BatchForm(_sgd_key, _sgd_batch))
family.batched("adam", BatchForm(_adam_key, _adam_batch))
