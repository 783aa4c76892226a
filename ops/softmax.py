"""softmax, cross_entropy and their fused, numerically stable pair."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext, normalize_axis
from fluidps.ir.types import VarType
from fluidps.ops.defs import Bool, Compat, In, Int, Out, Str, backend_hints
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp, NotLowerable, dims, product, shape
from fluidps.ops.registry import OpFamily

family = OpFamily("softmax")

_INT_LABELS = (VarType.INT64, VarType.INT32)


@family.op(
    "softmax",
    inputs=[In("X")],
    outputs=[Out("Out")],
    attrs=[
        Int("axis", -1),
        Compat(Str("data_format", "AnyLayout"), "AnyLayout", "NCHW"),
        *backend_hints(
            "is_test", "use_cudnn", "use_mkldnn", "use_onednn", "mkldnn_data_type", "onednn_data_type"
        ),
    ],
    grad=GradSpec(outputs=("Out",), like=(("X", "Out"),)),
)
def _infer_softmax(ctx: InferContext) -> None:
    """Out = exp(X - max) / sum(exp(X - max)) along `axis`."""
    x = ctx.input("X")
    normalize_axis(ctx.attr("axis"), len(x.shape), ctx)
    ctx.share("Out", x)


def _check_label(ctx: InferContext, logits_shape: tuple[int, ...], axis: int, soft: bool) -> None:
    label = ctx.input("Label")
    expected = list(logits_shape)
    if soft:
        if label.dtype is not None and label.dtype not in (VarType.FP32, VarType.FP64):
            ctx.fail(f"soft labels must be float, got {label.dtype.name}")
    else:
        expected[axis] = 1
        if label.dtype is not None and label.dtype not in _INT_LABELS:
            ctx.fail(f"hard labels must be int64 or int32 class ids, got {label.dtype.name}")
    if len(label.shape) != len(expected) or any(
        a != b and a >= 0 and b >= 0 for a, b in zip(label.shape, expected, strict=True)
    ):
        ctx.fail(f"Label must have shape {expected}, got {list(label.shape)}")


@family.op(
    "cross_entropy",
    inputs=[In("X"), In("Label")],
    outputs=[Out("Y")],
    attrs=[Bool("soft_label", False), Int("ignore_index", -100)],
    grad=GradSpec(inputs=("X", "Label"), out_grads=("Y",)),
)
def _infer_cross_entropy(ctx: InferContext) -> None:
    """Y = -log(X[label]) for probabilities X (hard labels), or -sum(label * log X)."""
    x = ctx.input("X")
    _check_label(ctx, x.shape, len(x.shape) - 1, ctx.attr("soft_label"))
    ctx.set_output("Y", (*x.shape[:-1], 1), x.dtype)


@family.op(
    "softmax_with_cross_entropy",
    inputs=[In("Logits"), In("Label")],
    outputs=[Out("Softmax"), Out("Loss")],
    attrs=[
        Bool("soft_label", False),
        Int("ignore_index", -100),
        Bool("numeric_stable_mode", True),
        Int("axis", -1),
        # False: Logits already hold probabilities (Paddle's cross_entropy with use_softmax=False).
        # Paddle-only (written by its cross_entropy), and the kernels honour it.
        Compat(Bool("use_softmax", True), True, False),
    ],
    grad=GradSpec(
        inputs=("Label",),
        outputs=("Softmax",),
        out_grads=("Loss",),
        in_grads=("Logits",),
        like=(("Logits", "Softmax"),),
    ),
)
def _infer_softmax_ce(ctx: InferContext) -> None:
    """Softmax = softmax(Logits); Loss = cross entropy of Softmax with Label, computed
    stably from the logits (log-sum-exp), along `axis`."""
    logits = ctx.input("Logits")
    axis = normalize_axis(ctx.attr("axis"), len(logits.shape), ctx)
    _check_label(ctx, logits.shape, axis, ctx.attr("soft_label"))
    loss_shape = list(logits.shape)
    loss_shape[axis] = 1
    ctx.share("Softmax", logits)
    ctx.set_output("Loss", loss_shape, logits.dtype)


# -- kernels -----------------------------------------------------------------------------
# Every kernel works on a (pre, n, post) view: n is the class / softmax axis,
# pre and post the dimensions before and after it, so one kernel serves any
# `axis` without transposing. Hard labels and losses are (pre, post) views
# (the axis has size 1 there). Sums accumulate in float64 and results are
# stored into arrays of the input's dtype, so float32 stays float32.


def _split(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """(pre, n, post) sizes of `shape` around `axis` (already non-negative)."""
    if not shape:
        return 1, 1, 1
    return math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1 :])


def _axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


@njit(cache=True)
def _first_bad_label(label, n, ignore_index):
    """Flat position of the first hard label outside [0, n) that is not
    `ignore_index`, or -1. Kernels index with labels unchecked (numba does no
    bounds checks), so every runner calls this first."""
    flat = label.reshape(-1)
    for i in range(flat.size):
        c = flat[i]
        if c != ignore_index and (c < 0 or c >= n):
            return i
    return -1


def _check_labels(op_type: str, label: np.ndarray, n: int, ignore_index: int) -> None:
    """Raise an ExecutionError naming the op, the label and the class count for a bad hard label."""
    bad = _first_bad_label(label, n, ignore_index)
    if bad >= 0:
        raise ExecutionError(
            f"op {op_type!r}: label {label.reshape(-1)[bad]} (element {bad} of Label) is out of range "
            f"for {n} classes: labels must be in [0, {n}) or equal ignore_index ({ignore_index})"
        )


@njit(cache=True)
def _tolerable_log(p):
    # Fluid's TolerableValue: log(0) = -inf becomes -1e20, so a loss stays finite
    # and a zero soft label times log(0) gives 0 rather than nan.
    v = np.log(p)
    if v == -np.inf:
        return -1e20
    if v == np.inf:
        return 1e20
    return v


@njit(cache=True)
def _softmax_line(x, out, i, k):
    """softmax(x[i, :, k]) into out[i, :, k]; returns (max, log(sum(exp(x - max))))."""
    n = x.shape[1]
    m = x[i, 0, k]
    for j in range(1, n):
        if x[i, j, k] > m:
            m = x[i, j, k]
    s = 0.0
    for j in range(n):
        e = np.exp(x[i, j, k] - m)
        out[i, j, k] = e
        s += e
    inv = 1.0 / s
    for j in range(n):
        out[i, j, k] = out[i, j, k] * inv
    return m, np.log(s)


@njit(cache=True)
def _softmax(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        for k in range(x.shape[2]):
            _softmax_line(x, out, i, k)
    return out


@njit(cache=True)
def _softmax_grad(out, dout):
    """dX = Out * (dOut - sum(dOut * Out)) along the axis."""
    dx = np.empty_like(dout)
    pre, n, post = out.shape
    for i in range(pre):
        for k in range(post):
            s = 0.0
            for j in range(n):
                s += dout[i, j, k] * out[i, j, k]
            for j in range(n):
                dx[i, j, k] = out[i, j, k] * (dout[i, j, k] - s)
    return dx


@njit(cache=True)
def _ce_hard(p, label, ignore_index):
    """-log(p[label]) per (i, k); 0 where the label is ignore_index."""
    pre, _, post = p.shape
    loss = np.empty((pre, post), dtype=p.dtype)
    for i in range(pre):
        for k in range(post):
            c = label[i, k]
            loss[i, k] = 0.0 if c == ignore_index else -_tolerable_log(p[i, c, k])
    return loss


@njit(cache=True)
def _ce_soft(p, label):
    """-sum(label * log(p)) along the axis."""
    pre, n, post = p.shape
    loss = np.empty((pre, post), dtype=p.dtype)
    for i in range(pre):
        for k in range(post):
            s = 0.0
            for j in range(n):
                s -= label[i, j, k] * _tolerable_log(p[i, j, k])
            loss[i, k] = s
    return loss


@njit(cache=True)
def _ce_hard_grad(p, label, dloss, ignore_index):
    """dp[label] = -dLoss / p[label]; every other entry (and ignored rows) 0."""
    pre, _, post = p.shape
    dp = np.zeros(p.shape, dtype=p.dtype)
    for i in range(pre):
        for k in range(post):
            c = label[i, k]
            if c != ignore_index:
                dp[i, c, k] = -dloss[i, k] / p[i, c, k]
    return dp


@njit(cache=True)
def _ce_soft_grad(p, label, dloss):
    """dp = -label * dLoss / p."""
    dp = np.empty_like(p)
    pre, n, post = p.shape
    for i in range(pre):
        for j in range(n):
            for k in range(post):
                dp[i, j, k] = -label[i, j, k] * dloss[i, k] / p[i, j, k]
    return dp


@njit(cache=True)
def _softmax_ce_hard(x, label, ignore_index):
    """(softmax, loss) with loss = logsumexp(x) - x[label], never log(softmax)."""
    pre, _, post = x.shape
    sm = np.empty_like(x)
    loss = np.empty((pre, post), dtype=x.dtype)
    for i in range(pre):
        for k in range(post):
            m, log_s = _softmax_line(x, sm, i, k)
            c = label[i, k]
            loss[i, k] = 0.0 if c == ignore_index else (m - x[i, c, k]) + log_s
    return sm, loss


@njit(cache=True)
def _softmax_ce_soft(x, label):
    """(softmax, loss) with loss = -sum(label * (x - logsumexp(x)))."""
    pre, n, post = x.shape
    sm = np.empty_like(x)
    loss = np.empty((pre, post), dtype=x.dtype)
    for i in range(pre):
        for k in range(post):
            m, log_s = _softmax_line(x, sm, i, k)
            s = 0.0
            for j in range(n):
                s -= label[i, j, k] * ((x[i, j, k] - m) - log_s)
            loss[i, k] = s
    return sm, loss


@njit(cache=True)
def _softmax_ce_hard_grad(sm, label, dloss, ignore_index):
    """dLogits = (Softmax - onehot(label)) * dLoss; 0 for ignored rows."""
    dx = np.empty_like(sm)
    pre, n, post = sm.shape
    for i in range(pre):
        for k in range(post):
            c = label[i, k]
            if c == ignore_index:
                for j in range(n):
                    dx[i, j, k] = 0.0
                continue
            d = dloss[i, k]
            for j in range(n):
                dx[i, j, k] = sm[i, j, k] * d
            dx[i, c, k] = (sm[i, c, k] - 1.0) * d
    return dx


@njit(cache=True)
def _softmax_ce_soft_grad(sm, label, dloss):
    """dLogits = (Softmax - Label) * dLoss (exact when each label row sums to 1, as in Fluid)."""
    dx = np.empty_like(sm)
    pre, n, post = sm.shape
    for i in range(pre):
        for j in range(n):
            for k in range(post):
                dx[i, j, k] = (sm[i, j, k] - label[i, j, k]) * dloss[i, k]
    return dx


# -- runners -----------------------------------------------------------------------------


def _contiguous(env: Env, name: str) -> np.ndarray:
    return contiguous(env[name])


@family.kernel("softmax")
def _softmax_kernel(op: KernelOp) -> Runner:
    x_name, out_name, axis = op.input("X"), op.output("Out"), op.attr("axis")

    def run(env: Env) -> None:
        x = _contiguous(env, x_name)
        if x.size == 0:  # nothing to normalize (and _softmax_line would read x[i, 0, k])
            env[out_name] = x.copy()
            return
        env[out_name] = _softmax(x.reshape(_split(x.shape, _axis(axis, x.ndim)))).reshape(x.shape)

    return run


@family.kernel("softmax_grad")
def _softmax_grad_kernel(op: KernelOp) -> Runner:
    out_name, dout_name, dx_name = op.input("Out"), op.input("Out@GRAD"), op.output("X@GRAD")
    axis = op.attr("axis")

    def run(env: Env) -> None:
        out, dout = _contiguous(env, out_name), _contiguous(env, dout_name)
        dims = _split(out.shape, _axis(axis, out.ndim))
        env[dx_name] = _softmax_grad(out.reshape(dims), dout.reshape(dims)).reshape(out.shape)

    return run


class _Layout:
    """The (pre, n, post) views of one cross-entropy op's operands, for arrays of
    `shape` with classes along `axis`."""

    def __init__(self, op: KernelOp, shape: tuple[int, ...], axis: int):
        self.pre, self.n, self.post = _split(shape, _axis(axis, len(shape)))
        if self.n == 0:
            raise ExecutionError(f"op {op.type!r}: the class axis has size 0")
        self.op, self.soft, self.ignore = op, op.attr("soft_label"), op.attr("ignore_index")

    def three(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.pre, self.n, self.post)

    def two(self, a: np.ndarray) -> np.ndarray:
        return a.reshape(self.pre, self.post)

    def label(self, label: np.ndarray) -> np.ndarray:
        """Soft labels as (pre, n, post); hard labels checked, as (pre, post)."""
        if self.soft:
            return self.three(label)
        _check_labels(self.op.type, label, self.n, self.ignore)
        return self.two(label)


@family.kernel("cross_entropy")
def _cross_entropy_kernel(op: KernelOp) -> Runner:
    x_name, label_name, y_name = op.input("X"), op.input("Label"), op.output("Y")

    def run(env: Env) -> None:
        x, label = _contiguous(env, x_name), _contiguous(env, label_name)
        lay = _Layout(op, x.shape, -1)
        lbl = lay.label(label)
        loss = _ce_soft(lay.three(x), lbl) if lay.soft else _ce_hard(lay.three(x), lbl, lay.ignore)
        env[y_name] = loss.reshape((*x.shape[:-1], 1))

    return run


@family.kernel("cross_entropy_grad")
def _cross_entropy_grad_kernel(op: KernelOp) -> Runner:
    x_name, label_name, dy_name = op.input("X"), op.input("Label"), op.input("Y@GRAD")
    dx_name = op.output("X@GRAD")

    def run(env: Env) -> None:
        x, label, dy = _contiguous(env, x_name), _contiguous(env, label_name), _contiguous(env, dy_name)
        lay = _Layout(op, x.shape, -1)
        lbl, p, d = lay.label(label), lay.three(x), lay.two(dy)
        dx = _ce_soft_grad(p, lbl, d) if lay.soft else _ce_hard_grad(p, lbl, d, lay.ignore)
        env[dx_name] = dx.reshape(x.shape)

    return run


@family.kernel("softmax_with_cross_entropy")
def _softmax_ce_kernel(op: KernelOp) -> Runner:
    logits_name, label_name = op.input("Logits"), op.input("Label")
    sm_name, loss_name = op.output("Softmax"), op.output("Loss")
    axis, use_softmax = op.attr("axis"), op.attr("use_softmax")

    def run(env: Env) -> None:
        logits, label = _contiguous(env, logits_name), _contiguous(env, label_name)
        lay = _Layout(op, logits.shape, axis)
        x, lbl = lay.three(logits), lay.label(label)
        if not use_softmax:
            # Logits already hold probabilities: Softmax is a copy, the loss plain cross entropy.
            sm = logits.copy()
            loss = _ce_soft(x, lbl) if lay.soft else _ce_hard(x, lbl, lay.ignore)
        else:
            sm, loss = _softmax_ce_soft(x, lbl) if lay.soft else _softmax_ce_hard(x, lbl, lay.ignore)
        loss_shape = list(logits.shape)
        loss_shape[_axis(axis, logits.ndim)] = 1
        if sm_name is not None:
            env[sm_name] = sm.reshape(logits.shape)
        if loss_name is not None:
            env[loss_name] = loss.reshape(loss_shape)

    return run


@family.kernel("softmax_with_cross_entropy_grad")
def _softmax_ce_grad_kernel(op: KernelOp) -> Runner:
    label_name, sm_name, dloss_name = op.input("Label"), op.input("Softmax"), op.input("Loss@GRAD")
    dx_name = op.output("Logits@GRAD")
    axis, use_softmax = op.attr("axis"), op.attr("use_softmax")

    def run(env: Env) -> None:
        sm, label = _contiguous(env, sm_name), _contiguous(env, label_name)
        lay = _Layout(op, sm.shape, axis)
        p, lbl, d = lay.three(sm), lay.label(label), lay.two(_contiguous(env, dloss_name))
        if not use_softmax:
            # Softmax is the probabilities the loss took the log of: plain cross-entropy gradient.
            dx = _ce_soft_grad(p, lbl, d) if lay.soft else _ce_hard_grad(p, lbl, d, lay.ignore)
        elif lay.soft:
            dx = _softmax_ce_soft_grad(p, lbl, d)
        else:
            dx = _softmax_ce_hard_grad(p, lbl, d, lay.ignore)
        env[dx_name] = dx.reshape(sm.shape)

    return run


# -- lowerings: hard labels through softmax (the classifier's loss) -------------------------


@njit(cache=True)
def require_labels(label, n, ignore_index):
    """Raise (numba does no bounds checks) for a hard label outside [0, n); the compiled
    segment is then run by the interpreter, whose error names the label."""
    if n == 0 or _first_bad_label(label, n, ignore_index) >= 0:
        raise ValueError("a hard label is out of range")


class _Lowered:
    """The (pre, n, post) views of a lowered cross-entropy op's operands."""

    def __init__(self, op: LoweringOp, slot: str):
        if op.attr("soft_label") or not op.attr("use_softmax"):
            raise NotLowerable("soft labels, or logits that are probabilities")
        self.op, self.ignore = op, int(op.attr("ignore_index"))
        rank = op.rank(slot)
        self.axis = _axis(op.attr("axis"), rank)
        local = op.input(slot)
        self.pre = product(dims(local, range(self.axis)))
        self.n = f"{local}.shape[{self.axis}]"
        self.post = product(dims(local, range(self.axis + 1, rank)))
        self.local, self.rank = local, rank

    def three(self, local: str) -> str:
        return f"{local}.reshape(({self.pre}, {self.n}, {self.post}))"

    def two(self, local: str) -> str:
        return f"{local}.reshape(({self.pre}, {self.post}))"

    def label(self) -> str:
        label = self.op.input("Label")
        self.op.emit(self.op.call(require_labels, label, self.n, str(self.ignore)))
        return self.two(label)


@family.lowering("softmax_with_cross_entropy")
def _softmax_ce_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("Logits", "Label", "Softmax", "Loss")
    lay = _Lowered(op, "Logits")
    sm, loss = op.temp(), op.temp()
    op.emit(f"{sm}, {loss} = {op.call(_softmax_ce_hard, lay.three(lay.local), lay.label(), str(lay.ignore))}")
    if (sm_out := op.output("Softmax")) is not None:
        op.emit(f"{sm_out} = {sm}.reshape({lay.local}.shape)")
    if (loss_out := op.output("Loss")) is not None:
        loss_shape = [d if i != lay.axis else "1" for i, d in enumerate(dims(lay.local, range(lay.rank)))]
        op.emit(f"{loss_out} = {loss}.reshape({shape(loss_shape)})")


@family.lowering("softmax_with_cross_entropy_grad")
def _softmax_ce_grad_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("Label", "Softmax", "Loss@GRAD", "Logits@GRAD")
    lay = _Lowered(op, "Softmax")
    grad = op.call(
        _softmax_ce_hard_grad,
        lay.three(lay.local),
        lay.label(),
        lay.two(op.input("Loss@GRAD")),
        str(lay.ignore),
    )
    op.emit(f"{op.output('Logits@GRAD')} = {grad}.reshape({lay.local}.shape)")


@family.lowering("softmax")
def _softmax_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out")
    x, rank = op.input("X"), op.rank("X")
    axis = _axis(op.attr("axis"), rank)
    if rank == 0:
        raise NotLowerable("X is a scalar")
    three = shape(
        [product(dims(x, range(axis))), f"{x}.shape[{axis}]", product(dims(x, range(axis + 1, rank)))]
    )
    out = op.output("Out")
    op.emit(f"if {x}.size == 0:")  # as the kernel: nothing to normalize
    op.emit(f"    {out} = {x}.copy()")
    op.emit("else:")
    op.emit(f"    {out} = {op.call(_softmax, f'{x}.reshape({three})')}.reshape({x}.shape)")
