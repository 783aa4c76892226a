"""Fluid's `axis` broadcasting, for kernels: align operands to one rank, and
sum a gradient back to the shape of the operand that was broadcast."""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError


def aligned_shape(small: tuple[int, ...], rank: int, axis: int) -> tuple[int, ...]:
    """`small` padded with 1s to `rank` dimensions, starting at `axis` (-1: trailing).
    The axis is checked first: it sizes the padding (2**31 - 1 would ask for a tuple of
    two billion 1s)."""
    start = rank - len(small) if axis == -1 else axis
    if not 0 <= start <= rank - len(small):
        raise ExecutionError(
            f"attribute axis={axis} cannot align a rank-{len(small)} operand inside a rank-{rank} one: "
            f"axis must be in [-1, rank(X) - rank(Y)] = [-1, {rank - len(small)}]"
        )
    return (1,) * start + tuple(small) + (1,) * (rank - len(small) - start)


def align(x: np.ndarray, y: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray]:
    """x and y as views of equal rank that numpy-style broadcasting combines as Fluid does."""
    if x.ndim >= y.ndim:
        return x, y.reshape(aligned_shape(y.shape, x.ndim, axis))
    return x.reshape(aligned_shape(x.shape, y.ndim, axis)), y


def reduce_to(grad: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum `grad` over the dimensions in which an operand of `shape` (same
    rank, or fewer dimensions aligned as in `align`) was broadcast."""
    if grad.shape == tuple(shape):
        return grad
    reduced = [s == 1 and g != 1 for g, s in zip(grad.shape, shape, strict=True)]
    if not any(reduced):
        return grad
    # Broadcast along leading and trailing dimensions only (a bias): sum_pre_post, the
    # sum compiled code does too, so that both give the same bits.
    kept = [i for i, r in enumerate(reduced) if not r]
    first, last = (kept[0], kept[-1] + 1) if kept else (len(reduced), len(reduced))
    if not any(reduced[first:last]):
        parts = grad.shape[:first], grad.shape[first:last], grad.shape[last:]
        view = np.ascontiguousarray(grad).reshape(tuple(math.prod(p) for p in parts))
        return sum_pre_post(view).reshape(shape)
    axes = tuple(i for i, r in enumerate(reduced) if r)
    return grad.sum(axis=axes, keepdims=True)


@njit(cache=True)
def sum_pre_post(g):
    """out[j] = sum over i, k of g[i, j, k] (a (pre, n, post) gradient summed back to the
    operand broadcast along pre and post), accumulated in g's dtype row by row as
    numpy's sum over leading axes does."""
    pre, n, post = g.shape
    out = np.zeros(n, dtype=g.dtype)
    for i in range(pre):
        for j in range(n):
            for k in range(post):
                out[j] += g[i, j, k]
    return out
