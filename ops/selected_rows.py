"""SelectedRows: the sparse tensor of embedding gradients.

`rows` (int64, may repeat) says which rows of a `height`-row table `value`
holds; row i of `value` belongs to table row rows[i]. Repeated rows add up.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ops.hashed_table import mix64
from fluidps.ops.kernel import contiguous

# The height of a hashed table's gradient: its rows are ids, any int64 >= 0 (never made dense).
HASHED_HEIGHT = 2**63 - 1


@dataclass
class SelectedRows:
    rows: np.ndarray
    value: np.ndarray
    height: int

    def __post_init__(self) -> None:
        self.rows = contiguous(self.rows, dtype=np.int64).reshape(-1)
        self.value = np.asarray(self.value)
        self.height = int(self.height)
        if self.value.ndim < 1 or self.value.shape[0] != self.rows.shape[0]:
            raise ExecutionError(
                f"SelectedRows has {self.rows.shape[0]} rows but a value of shape {list(self.value.shape)}"
            )
        if self.rows.size and (self.rows.min() < 0 or self.rows.max() >= self.height):
            raise ExecutionError(
                f"SelectedRows rows must be in [0, {self.height}), got [{self.rows.min()}, {self.rows.max()}]"
            )

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of the dense table this stands for."""
        return (self.height, *self.value.shape[1:])

    @property
    def dtype(self) -> np.dtype:
        return self.value.dtype

    def to_dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, dtype=self.value.dtype)
        width = int(np.prod(self.value.shape[1:], dtype=np.int64))
        scatter_add(dense.reshape(self.height, width), self.rows, self.value.reshape(-1, width))
        return dense

    def merged(self) -> SelectedRows:
        """The same sparse tensor with each row once (sorted), duplicates summed."""
        width = int(np.prod(self.value.shape[1:], dtype=np.int64))
        rows, value = merge_rows(self.rows, contiguous(self.value.reshape(-1, width)))
        return SelectedRows(rows, value.reshape((rows.shape[0], *self.value.shape[1:])), self.height)

    def copy(self) -> SelectedRows:
        return SelectedRows(self.rows.copy(), self.value.copy(), self.height)

    def __repr__(self) -> str:
        return f"SelectedRows(height={self.height}, rows={self.rows.shape[0]}, value={list(self.value.shape)} {self.dtype})"


@njit(cache=True)
def scatter_add(dense, rows, value):
    """dense[rows[i]] += value[i] for each i (rows may repeat)."""
    for i in range(rows.shape[0]):
        r = rows[i]
        for j in range(value.shape[1]):
            dense[r, j] += value[i, j]


def merge_rows(rows: np.ndarray, value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(unique sorted rows, summed values) of a 2-D SelectedRows value: repeats add up in
    their order, from zeros. Only the distinct rows are sorted."""
    unique, inverse = unique_ids(rows)
    order = np.argsort(unique)
    return unique[order], np.take(sum_rows(inverse, len(unique), value), order, axis=0)


@njit(cache=True)
def unique_ids(ids):
    """(each of `ids` once, in the order first seen; inverse, with ids[i] ==
    unique[inverse[i]]), in one pass over a hash set sized to the batch. Sorting
    (np.unique) costs 25x more on a CTR batch's 13k ids, and nothing here needs order."""
    n = ids.shape[0]
    capacity = 16
    while capacity < 2 * n:
        capacity <<= 1
    mask = capacity - 1
    keys = np.empty(capacity, dtype=np.int64)
    slots = np.full(capacity, -1, dtype=np.int64)
    unique = np.empty(n, dtype=np.int64)
    inverse = np.empty(n, dtype=np.int64)
    m = 0
    for i in range(n):
        x = ids[i]
        k = np.int64(mix64(x) & np.uint64(mask))  # ids of any pattern spread over the slots
        while slots[k] >= 0 and keys[k] != x:
            k = (k + 1) & mask
        if slots[k] < 0:
            slots[k], keys[k], unique[m] = m, x, x
            m += 1
        inverse[i] = slots[k]
    return unique[:m], inverse


def sum_rows(inverse: np.ndarray, n: int, value: np.ndarray) -> np.ndarray:
    """out[inverse[i]] += value[i] for each i in order, from zeros: a gradient's rows summed
    per unique id, adding up in the order the optimizers' merges add them, so that what
    is applied is the same bit for bit."""
    out = np.zeros((n, value.shape[1]), dtype=value.dtype)
    scatter_add(out, inverse, value)
    return out
