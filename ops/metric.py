"""top_k and accuracy: evaluation ops."""

from __future__ import annotations

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ir.types import VarType
from fluidps.ops.defs import Extra, In, Int, Out
from fluidps.ops.grad import GradSpec
from fluidps.ops.kernel import Env, KernelOp, Runner, contiguous
from fluidps.ops.lowering import LoweringOp, NotLowerable, dims, shape
from fluidps.ops.registry import OpFamily

family = OpFamily("metric")


@family.op(
    "top_k",
    inputs=[In("X"), Extra("K")],
    outputs=[Out("Out"), Out("Indices")],
    attrs=[Int("k", 1, lambda k: k >= 1, "k must be >= 1")],
    grad=GradSpec(inputs=("X",), outputs=("Indices",)),
)
def _infer_top_k(ctx: InferContext) -> None:
    """Out, Indices = the k largest values along the last dimension, and where they are."""
    x = ctx.input("X")
    k = ctx.attr("k")
    if not x.shape:
        ctx.fail("X must have rank >= 1")
    if x.shape[-1] >= 0 and k > x.shape[-1]:
        ctx.fail(f"k={k} is larger than the last dimension {x.shape[-1]}")
    shape = (*x.shape[:-1], k)
    ctx.set_output("Out", shape, x.dtype)
    ctx.set_output("Indices", shape, VarType.INT64)


@family.op(
    "accuracy",
    inputs=[In("Out"), In("Indices"), In("Label")],
    outputs=[Out("Accuracy"), Out("Correct"), Out("Total")],
)
def _infer_accuracy(ctx: InferContext) -> None:
    """Accuracy = the share of rows whose Label is among their top-k Indices."""
    indices, label = ctx.input("Indices"), ctx.input("Label")
    if len(indices.shape) != 2:
        ctx.fail(f"Indices must be [batch, k], got {list(indices.shape)}")
    if len(label.shape) != 2 or label.shape[1] not in (1, -1):
        ctx.fail(f"Label must be [batch, 1], got {list(label.shape)}")
    ctx.set_output("Accuracy", (), VarType.FP32)
    ctx.set_output("Correct", (), VarType.INT32)
    ctx.set_output("Total", (), VarType.INT32)


# -- kernels -----------------------------------------------------------------------------

# Up to this k, top_k keeps a sorted buffer of k entries per row (O(n k), no
# allocation); beyond it a stable argsort of the row (O(n log n)) is cheaper.
_INSERTION_MAX_K = 32


@njit(cache=True)
def _top_k(x, k):
    """The k largest entries of each row of x (rows, n), largest first; equal
    values keep the lower index first. NaN never ranks above a number."""
    rows, n = x.shape
    out = np.empty((rows, k), dtype=x.dtype)
    idx = np.empty((rows, k), dtype=np.int64)
    for r in range(rows):
        if k > _INSERTION_MAX_K:
            order = np.argsort(-x[r], kind="mergesort")
            for t in range(k):
                idx[r, t] = order[t]
                out[r, t] = x[r, order[t]]
            continue
        filled = 0
        for j in range(n):
            v = x[r, j]
            if filled == k and not v > out[r, k - 1]:
                continue
            # Shift strictly smaller entries right (the last one falls off when full).
            p = filled if filled < k else k - 1
            while p > 0 and v > out[r, p - 1]:
                out[r, p] = out[r, p - 1]
                idx[r, p] = idx[r, p - 1]
                p -= 1
            out[r, p] = v
            idx[r, p] = j
            if filled < k:
                filled += 1
    return out, idx


@njit(cache=True)
def _top_k_grad(dout, indices, n):
    """dX (rows, n): dOut scattered to the positions top_k took its values from."""
    rows, k = dout.shape
    dx = np.zeros((rows, n), dtype=dout.dtype)
    for r in range(rows):
        for t in range(k):
            dx[r, indices[r, t]] += dout[r, t]
    return dx


@njit(cache=True)
def _first_out_of_range(indices, n):
    """Flat position of the first index outside [0, n), or -1."""
    flat = indices.reshape(-1)
    for i in range(flat.size):
        if flat[i] < 0 or flat[i] >= n:
            return i
    return -1


@njit(cache=True)
def _count_correct(indices, label):
    """(rows whose label is among their indices, first row with a negative label or -1)."""
    rows, k = indices.shape
    correct = 0
    for r in range(rows):
        if label[r] < 0:
            return correct, r
        for t in range(k):
            if indices[r, t] == label[r]:
                correct += 1
                break
    return correct, -1


@family.kernel("top_k")
def _top_k_kernel(op: KernelOp) -> Runner:
    x_name, out_name, indices_name = op.input("X"), op.output("Out"), op.output("Indices")
    k = op.attr("k")

    def run(env: Env) -> None:
        x = contiguous(env[x_name])
        n = x.shape[-1]
        if k > n:
            raise ExecutionError(f"op 'top_k': k={k} is larger than the last dimension {n}")
        out, idx = _top_k(x.reshape(-1, n), k)
        shape = (*x.shape[:-1], k)
        if out_name is not None:
            env[out_name] = out.reshape(shape)
        if indices_name is not None:
            env[indices_name] = idx.reshape(shape)

    return run


@family.kernel("top_k_grad")
def _top_k_grad_kernel(op: KernelOp) -> Runner:
    x_name, indices_name = op.input("X"), op.input("Indices")
    dout_name, dx_name = op.input("Out@GRAD"), op.output("X@GRAD")
    k = op.attr("k")

    def run(env: Env) -> None:
        shape = np.shape(env[x_name])
        n = shape[-1]
        indices = contiguous(env[indices_name])
        # Indices may come from a feed rather than top_k: scattering must not write out of bounds.
        bad = _first_out_of_range(indices, n)
        if bad >= 0:
            raise ExecutionError(
                f"op 'top_k_grad': index {indices.reshape(-1)[bad]} in Indices is out of range [0, {n})"
            )
        dout = contiguous(env[dout_name]).reshape(-1, k)
        env[dx_name] = _top_k_grad(dout, indices.reshape(-1, k), n).reshape(shape)

    return run


@family.kernel("accuracy")
def _accuracy_kernel(op: KernelOp) -> Runner:
    indices_name, label_name = op.input("Indices"), op.input("Label")
    acc_name, correct_name, total_name = op.output("Accuracy"), op.output("Correct"), op.output("Total")

    def run(env: Env) -> None:
        indices = contiguous(env[indices_name])
        label = contiguous(env[label_name]).reshape(-1)
        if indices.ndim != 2:
            raise ExecutionError(f"op 'accuracy': Indices must be [batch, k], got {list(indices.shape)}")
        rows = indices.shape[0]
        if label.shape[0] < rows:
            raise ExecutionError(f"op 'accuracy': {label.shape[0]} labels for {rows} rows of Indices")
        correct, bad = _count_correct(indices, label[:rows])
        if bad >= 0:
            raise ExecutionError(f"op 'accuracy': label {label[bad]} of row {bad} is negative")
        # As in Fluid: float32 division, and accuracy 0 for an empty batch.
        accuracy = np.float32(correct) / np.float32(rows) if rows else np.float32(0)
        if acc_name is not None:
            env[acc_name] = np.asarray(accuracy, dtype=np.float32)
        if correct_name is not None:
            env[correct_name] = np.asarray(correct, dtype=np.int32)
        if total_name is not None:
            env[total_name] = np.asarray(rows, dtype=np.int32)

    return run


# -- lowerings: a classifier's metrics between its forward and backward ------------------------
# A case the kernel reports (k above the last dimension, a negative label) raises in the
# compiled code, and the interpreter then runs the segment and says what is wrong.


@family.lowering("top_k")
def _top_k_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("X", "Out", "Indices")
    if op.has_input("K"):
        raise NotLowerable("its k is a tensor")
    x, rank, k = op.input("X"), op.rank("X"), op.attr("k")
    if rank == 0:
        raise NotLowerable("X is a scalar")
    n = f"{x}.shape[{rank - 1}]"
    op.emit(f"if {k} > {n}:")
    op.emit("    raise ValueError('top_k: k is larger than the last dimension')")
    values, indices = op.temp(), op.temp()
    op.emit(f"{values}, {indices} = {op.call(_top_k, f'{x}.reshape((-1, {n}))', str(k))}")
    out_shape = shape([*dims(x, range(rank - 1)), str(k)])
    if (out := op.output("Out")) is not None:
        op.emit(f"{out} = {values}.reshape({out_shape})")
    if (idx := op.output("Indices")) is not None:
        op.emit(f"{idx} = {indices}.reshape({out_shape})")


@njit(cache=True)
def accuracy_of(indices, label):
    """(accuracy, correct, total) as the kernel's 0-d arrays; raises where it reports."""
    rows = indices.shape[0]
    flat = label.reshape(-1)
    if flat.shape[0] < rows:
        raise ValueError("accuracy: fewer labels than rows")
    correct, bad = _count_correct(indices, flat[:rows])
    if bad >= 0:
        raise ValueError("accuracy: a negative label")
    accuracy = np.float32(correct) / np.float32(rows) if rows else np.float32(0)
    return np.full((), accuracy, np.float32), np.full((), correct, np.int32), np.full((), rows, np.int32)


@family.lowering("accuracy")
def _accuracy_lowering(op: LoweringOp) -> None:
    op.new_arrays()
    op.require_dense("Indices", "Label")
    if op.rank("Indices") != 2:
        raise NotLowerable("Indices is not [batch, k]")
    values = [op.temp() for _ in range(3)]
    op.emit(f"{', '.join(values)} = {op.call(accuracy_of, op.input('Indices'), op.input('Label'))}")
    for slot, value in zip(("Accuracy", "Correct", "Total"), values, strict=True):
        if (out := op.output(slot)) is not None:
            op.emit(f"{out} = {value}")
