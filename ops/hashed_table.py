"""HashedTable: embedding rows keyed by int64 ids with no vocabulary bound.

A row exists only for an id that was stored, so memory grows with the ids seen, not
with the id space (raw feature hashes over 2^40 values and more). The index is open
addressing with linear probing over a power-of-two array of keys (load at most 0.7,
doubled when fuller); it maps an id to a row number, and the rows live densely in
arrays of values, optimizer state and counters. Removing an id shifts the probe
chain back (no tombstones) and moves the last row into the freed one, so the rows
stay dense. Every loop is numba-compiled; there is no Python object per row.

Ids are >= 0 (-1 marks an empty key). Rows that do not exist yet read their initial
values, which depend only on (seed, id) through a counter-based generator
(splitmix64): the same id starts from the same values in every process, on every
pserver and locally, whatever order ids arrive in.
"""

from __future__ import annotations

import numpy as np
from numba import njit, uint64

EMPTY = -1
MAX_LOAD = 0.7
ROW_GROWTH = 1.25  # row arrays grow by a quarter: at most 25% of the values unused


# -- hashing and initial values ------------------------------------------------------------


@njit(cache=True)
def mix64(x):
    """splitmix64's finalizer: a bijection of uint64 that spreads every input bit."""
    x = uint64(x)
    x = (x ^ (x >> uint64(30))) * uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> uint64(27))) * uint64(0x94D049BB133111EB)
    return x ^ (x >> uint64(31))


@njit(cache=True)
def _unit(bits):
    """A float64 in [0, 1) from the top 53 bits."""
    return float(bits >> uint64(11)) * (1.0 / 9007199254740992.0)


@njit(cache=True)
def initial_rows(ids, dim, seed, normal, a, b, out):
    """out[i] = the initial row of ids[i]: uniform in [a, b), or normal with mean a and
    standard deviation b, from a stream that depends only on (seed, id, column)."""
    base = mix64(uint64(seed) ^ uint64(0x9E3779B97F4A7C15))
    for i in range(ids.shape[0]):
        key = mix64(base ^ mix64(uint64(ids[i])))
        for j in range(dim):
            u = _unit(mix64(key + uint64(2 * j + 1)))
            if normal:
                v = _unit(mix64(key + uint64(2 * j + 2)))
                z = np.sqrt(-2.0 * np.log(1.0 - u)) * np.cos(2.0 * np.pi * v)
                out[i, j] = a + b * z
            else:
                out[i, j] = a + (b - a) * u


@njit(cache=True)
def gather_or_init(values, rows, ids, seed, normal, a, b, out):
    """out[i] = values[rows[i]] where rows[i] >= 0, else the initial row of ids[i]."""
    dim = values.shape[1]
    missing = 0
    for i in range(ids.shape[0]):
        if rows[i] >= 0:
            for j in range(dim):
                out[i, j] = values[rows[i], j]
        else:
            missing += 1
    if missing:
        absent = np.empty(missing, dtype=np.int64)
        at = np.empty(missing, dtype=np.int64)
        k = 0
        for i in range(ids.shape[0]):
            if rows[i] < 0:
                absent[k], at[k] = ids[i], i
                k += 1
        fresh = np.empty((missing, dim), dtype=out.dtype)
        initial_rows(absent, dim, seed, normal, a, b, fresh)
        for k in range(missing):
            for j in range(dim):
                out[at[k], j] = fresh[k, j]


@njit(cache=True)
def shard_of(ids, shards, out):
    """out[i] = the shard (pserver) of ids[i]: mix64(id) mod shards."""
    for i in range(ids.shape[0]):
        out[i] = np.int64(mix64(uint64(ids[i])) % uint64(shards))


@njit(cache=True)
def draws(ids, seed, clock, out):
    """out[i] = a uniform [0, 1) draw that depends only on (seed, id, clock)."""
    base = mix64(uint64(seed) ^ uint64(0xD1B54A32D192ED03)) ^ mix64(uint64(clock))
    for i in range(ids.shape[0]):
        out[i] = _unit(mix64(base ^ mix64(uint64(ids[i]))))


# -- the index: id -> row ------------------------------------------------------------------


@njit(cache=True)
def _home(key, mask):
    return np.int64(mix64(uint64(key)) & uint64(mask))


@njit(cache=True)
def _slot(keys, key):
    """The slot holding `key`, or the empty slot that ends its probe chain."""
    mask = keys.shape[0] - 1
    s = _home(key, mask)
    while keys[s] != EMPTY and keys[s] != key:
        s = (s + 1) & mask
    return s


@njit(cache=True)
def find(keys, rows, ids, out):
    """out[i] = the row of ids[i], or -1."""
    for i in range(ids.shape[0]):
        s = _slot(keys, ids[i])
        out[i] = rows[s] if keys[s] == ids[i] else -1


@njit(cache=True)
def _insert(keys, rows, key, row):
    s = _slot(keys, key)
    keys[s] = key
    rows[s] = row


@njit(cache=True)
def insert(keys, rows, ids, row_numbers):
    """Index ids[i] (absent, distinct) at row row_numbers[i]."""
    for i in range(ids.shape[0]):
        _insert(keys, rows, ids[i], row_numbers[i])


@njit(cache=True)
def _remove(keys, rows, key):
    """Unindex `key`; its row, or -1. The probe chain after it shifts back."""
    mask = keys.shape[0] - 1
    s = _slot(keys, key)
    if keys[s] != key:
        return -1
    row = rows[s]
    hole, j = s, s
    while True:
        j = (j + 1) & mask
        if keys[j] == EMPTY:
            break
        home = _home(keys[j], mask)
        # keys[j] may fill the hole unless its home lies cyclically in (hole, j].
        if (hole <= j and hole < home <= j) or (hole > j and (home > hole or home <= j)):
            continue
        keys[hole], rows[hole] = keys[j], rows[j]
        hole = j
    keys[hole] = EMPTY
    return row


@njit(cache=True)
def _reindex(keys, rows, key, row):
    """The row of `key` (present) is now `row`."""
    rows[_slot(keys, key)] = row


@njit(cache=True)
def remove(keys, rows, ids, table_ids, n):
    """Remove each of `ids` from the index of `n` rows whose ids are table_ids[:n], moving
    the last row into each freed one (table_ids follows). Returns the rows left and the
    moves (dst, src) to make, in order, in every other row array (apply_moves)."""
    dst = np.empty(ids.shape[0], dtype=np.int64)
    src = np.empty(ids.shape[0], dtype=np.int64)
    moves = 0
    for i in range(ids.shape[0]):
        row = _remove(keys, rows, ids[i])
        if row < 0:
            continue
        n -= 1
        if row != n:
            moved = table_ids[n]
            table_ids[row] = moved
            _reindex(keys, rows, moved, row)
            dst[moves], src[moves] = row, n
            moves += 1
    return n, dst[:moves], src[:moves]


@njit(cache=True)
def apply_moves(array, dst, src):
    """array[dst[k]] = array[src[k]], in order (a later move may read an earlier one's row)."""
    for k in range(dst.shape[0]):
        for j in range(array.shape[1]):
            array[dst[k], j] = array[src[k], j]


class IdIndex:
    """id -> row, grown as ids are added."""

    def __init__(self, capacity: int = 1024):
        capacity = 1 << max(4, int(capacity - 1).bit_length())
        self.keys = np.full(capacity, EMPTY, dtype=np.int64)
        self.rows = np.zeros(capacity, dtype=np.int64)
        self.count = 0

    def find(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty(len(ids), dtype=np.int64)
        find(self.keys, self.rows, ids, out)
        return out

    def add(self, ids: np.ndarray, first_row: int) -> None:
        self.reserve(self.count + len(ids))
        insert(self.keys, self.rows, ids, np.arange(first_row, first_row + len(ids), dtype=np.int64))
        self.count += len(ids)

    def reserve(self, count: int) -> None:
        if count <= MAX_LOAD * len(self.keys):
            return
        capacity = len(self.keys)
        while count > MAX_LOAD * capacity:
            capacity *= 2
        live = self.keys != EMPTY
        ids, rows = self.keys[live], self.rows[live]
        self.keys = np.full(capacity, EMPTY, dtype=np.int64)
        self.rows = np.zeros(capacity, dtype=np.int64)
        insert(self.keys, self.rows, ids, rows)  # rows stay where they are; only their slots move

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.rows.nbytes


class HashedTable:
    """Rows of `dim` values and `state_width` optimizer-state values per id, with the step
    each row was last updated at and a decayed usage score (eviction reads both)."""

    def __init__(self, dim: int, state_width: int = 0, dtype: np.dtype = np.float32, capacity: int = 1024):
        self.dim, self.state_width, self.dtype = int(dim), int(state_width), np.dtype(dtype)
        self.index = IdIndex(capacity)
        self.size = 0
        self._allocate(max(16, capacity))

    def _allocate(self, rows: int) -> None:
        """Row arrays of `rows` rows, keeping the rows held."""
        n = self.size
        old = getattr(self, "ids", None)
        arrays = {
            "ids": np.empty(rows, dtype=np.int64),
            "values": np.empty((rows, self.dim), dtype=self.dtype),
            "state": np.zeros((rows, self.state_width), dtype=self.dtype),
            "updated": np.zeros(rows, dtype=np.int64),
            "score": np.zeros(rows, dtype=np.float32),
        }
        for name, array in arrays.items():
            if old is not None:
                array[:n] = getattr(self, name)[:n]
            setattr(self, name, array)

    def __len__(self) -> int:
        return self.size

    def replace_state(self, state: np.ndarray) -> None:
        """Replace the optimizer state of every held row by `state` (one row per held row):
        a table learns its optimizer rule, and so its state's width, at its first update."""
        self.state_width = state.shape[1]
        self.state = np.zeros((len(self.ids), self.state_width), dtype=self.dtype)
        self.state[: self.size] = state

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The row of each id (int64, >= 0), -1 where it has none."""
        return self.index.find(ids)

    def add(self, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
        """New rows for `ids` (distinct, none present) holding `values`; their row numbers."""
        n, new = self.size, len(ids)
        if n + new > len(self.ids):
            self._allocate(max(n + new, int(len(self.ids) * ROW_GROWTH) + 1))
        self.index.add(ids, n)
        self.ids[n : n + new] = ids
        self.values[n : n + new] = values
        self.state[n : n + new] = 0
        self.updated[n : n + new] = 0
        self.score[n : n + new] = 0
        self.size = n + new
        return np.arange(n, n + new, dtype=np.int64)

    def remove(self, ids: np.ndarray) -> None:
        """Drop the rows of `ids` (distinct; absent ones are skipped)."""
        self.size, dst, src = remove(self.index.keys, self.index.rows, ids, self.ids, self.size)
        self.index.count = self.size
        for array in (self.values, self.state, self.updated.reshape(-1, 1), self.score.reshape(-1, 1)):
            apply_moves(array, dst, src)

    @property
    def nbytes(self) -> int:
        """Bytes held: the index and every row array (allocated rows included)."""
        arrays = (self.ids, self.values, self.state, self.updated, self.score)
        return self.index.nbytes + sum(a.nbytes for a in arrays)


# -- row optimizers: each row keeps its own state ---------------------------------------------
# State per row, by rule: sgd none; adagrad [moment]; adam [moment1, moment2, beta1^t,
# beta2^t] (each row its own bias correction: t counts that row's updates, as Paddle's
# sparse tables do); ftrl [squared sum, linear]. Formulas are Paddle's, in the table's
# dtype, as fluidps's dense kernels compute them.

RULES = ("sgd", "adagrad", "adam", "ftrl")


def state_width(rule: str, dim: int) -> int:
    return {"sgd": 0, "adagrad": dim, "adam": 2 * dim + 2, "ftrl": 2 * dim}[rule]


def initial_state(rule: str, dim: int, rows: int, dtype: np.dtype, beta1: float, beta2: float) -> np.ndarray:
    """The state new rows start from: zeros, and Adam's beta powers at beta^1."""
    state = np.zeros((rows, state_width(rule, dim)), dtype=dtype)
    if rule == "adam":
        state[:, 2 * dim] = beta1
        state[:, 2 * dim + 1] = beta2
    return state


@njit(cache=True, error_model="numpy")  # divisions without zero checks, as fluidps.ops.optimizers' loops
def update_rows(rule, values, state, rows, g, lr, eps, beta1, beta2, l1, l2):
    """Apply the gradient rows g[k] to table rows rows[k] (unique) by `rule` (the index
    in RULES); scalars are of the table's dtype."""
    dim = values.shape[1]
    one = values.dtype.type(1.0)
    for k in range(rows.shape[0]):
        r = rows[k]
        if rule == 0:
            for j in range(dim):
                values[r, j] -= lr * g[k, j]
        elif rule == 1:
            for j in range(dim):
                m = state[r, j] + g[k, j] * g[k, j]
                state[r, j] = m
                values[r, j] -= lr * g[k, j] / (np.sqrt(m) + eps)
        elif rule == 2:
            b1p, b2p = state[r, 2 * dim], state[r, 2 * dim + 1]
            lr_t = lr * np.sqrt(one - b2p) / (one - b1p)
            eps_t = eps * np.sqrt(one - b2p)
            for j in range(dim):
                gj = g[k, j]
                a = beta1 * state[r, j] + (one - beta1) * gj
                b = beta2 * state[r, dim + j] + (one - beta2) * gj * gj
                state[r, j] = a
                state[r, dim + j] = b
                values[r, j] -= lr_t * (a / (np.sqrt(b) + eps_t))
            state[r, 2 * dim] = b1p * beta1
            state[r, 2 * dim + 1] = b2p * beta2
        else:  # FTRL-proximal with learning-rate power -1/2
            for j in range(dim):
                gj = g[k, j]
                squared = state[r, j]
                new_squared = squared + gj * gj
                linear = (
                    state[r, dim + j] + gj - (np.sqrt(new_squared) - np.sqrt(squared)) / lr * values[r, j]
                )
                if abs(linear) > l1:
                    sign = one if linear > 0 else -one
                    values[r, j] = (l1 * sign - linear) / (np.sqrt(new_squared) / lr + 2 * l2)
                else:
                    values[r, j] = 0
                state[r, j] = new_squared
                state[r, dim + j] = linear
