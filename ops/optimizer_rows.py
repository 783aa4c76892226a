"""What every optimizer kernel shares: an op's run seen as a row update of its parameter.

A SelectedRows gradient names the rows it touches and a dense one updates the whole
parameter seen as one row, so each optimizer has one numba loop over rows (update_loop)
and a sparse step costs what its rows cost. `Step` gathers an op's run: the arrays its
update writes, its scalar inputs in Param's dtype, and its gradient's rows, checked and,
for the rules that sum them, merged in one pass (RowSlots). `prefetch_row` lets a loop
over a big table's rows keep several cache misses in flight.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from fluidps.errors import ExecutionError
from fluidps.ops.kernel import Env, KernelOp, contiguous
from fluidps.ops.selected_rows import SelectedRows

_DENSE_ROWS = np.zeros(1, dtype=np.int64)  # the one row of a dense update

# The update loops divide floats. Under numba's default error model every division
# checks for zero (to raise Python's ZeroDivisionError), and that branch keeps LLVM from
# vectorizing the loop; numpy's model divides as IEEE 754 does, as numpy's kernels do, with
# the same bits (a division by zero gives inf, as numpy's). Dense Adam runs about 7x
# faster so, which is most of a pserver's optimize time.
update_loop = njit(cache=True, error_model="numpy")


@njit(cache=True)
def _first_bad_row(rows, height):
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= height:
            return i
    return -1


class RowSlots:
    """Scratch for merging duplicate rows in one pass.

    Merging by sorting (SelectedRows.merged) costs more than the update itself
    on 10^4 rows. A row -> slot array, -1 everywhere between uses, merges in
    one pass over the gradient instead; each merge puts back the -1s it wrote,
    so the array is filled once (4 bytes per table row), not once per step.
    Each optimizer op's runner owns one; a runner never runs concurrently
    with itself.
    """

    def __init__(self) -> None:
        self._slots = np.empty(0, dtype=np.int32)

    def get(self, height: int) -> np.ndarray:
        if self._slots.shape[0] < height:
            self._slots = np.full(height, -1, dtype=np.int32)
        return self._slots


@njit(cache=True)
def _repeated_rows(rows, slots):
    """Whether some row comes twice (`slots` as _merge_rows uses them, left as found)."""
    n = rows.shape[0]
    seen = n
    for i in range(n):
        if slots[rows[i]] >= 0:
            seen = i
            break
        slots[rows[i]] = 0
    for k in range(seen):
        slots[rows[k]] = -1
    return seen < n


@njit(cache=True)
def _merge_rows(rows, g, slots):
    """(unique rows in first-seen order, their summed values): duplicates add up in
    gradient order, as SelectedRows.to_dense adds them, so results match it bit for bit."""
    out_rows = np.empty(rows.shape[0], dtype=np.int64)
    out = np.zeros((rows.shape[0], g.shape[1]), dtype=g.dtype)
    n = 0
    for i in range(rows.shape[0]):
        r = rows[i]
        s = slots[r]
        if s < 0:
            s = n
            slots[r] = n
            out_rows[n] = r
            n += 1
        for j in range(g.shape[1]):
            out[s, j] += g[i, j]
    for k in range(n):
        slots[out_rows[k]] = -1
    return out_rows[:n], out[:n]


# A row update of a big table misses the cache on every row. With a long loop
# body (Adam's sqrt and division over three arrays) the CPU's reorder window
# holds about one row, so misses would come one at a time; prefetching the rows
# a few iterations ahead keeps several in flight (about 2x on 10^4 random rows
# of a 10^6-row Adam table).
AHEAD = 8


@intrinsic
def prefetch_row(typingctx, table, row):
    """Hint the CPU to fetch row `row` of a 2-D C-contiguous array for writing: LLVM's
    prefetch of its first and last element (16 float32 span two cache lines unless
    aligned). A hint never faults. An intrinsic, not a jitted helper: passing arrays
    to a helper costs reference-count updates that eat the gain."""

    def codegen(context, builder, signature, args):
        table_type = signature.args[0]
        ary = context.make_array(table_type)(context, builder, args[0])
        width = cgutils.unpack_tuple(builder, ary.shape)[1]
        last = builder.sub(width, width.type(1))
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch." + i8p.intrinsic_name)
        for col in (width.type(0), last):
            ptr = cgutils.get_item_pointer(
                context, builder, table_type, ary, [args[1], col], wraparound=False
            )
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(1), i32(3), i32(1)])  # write, keep, data
        return context.get_dummy_value()

    if not isinstance(table, types.Array) or table.ndim != 2 or not isinstance(row, types.Integer):
        return None
    return types.void(table, types.intp), codegen


class Step:
    """One run of an optimizer op: its arrays, in place where the op allows it."""

    def __init__(self, op: KernelOp, env: Env, slots: RowSlots | None = None):
        self.op, self.env = op, env
        self.slots = slots if slots is not None else RowSlots()
        param = env[op.input("Param")]
        if not isinstance(param, np.ndarray) or param.dtype.kind != "f":
            raise ExecutionError(f"{op.type}: Param must be a float tensor, got {_describe(param)}")
        self.dtype, self.shape = param.dtype, param.shape
        self.size = math.prod(param.shape)  # (math.prod: np.prod costs microseconds on a tuple)
        self.scalar = param.dtype.type

    def state(self, slot: str, out_slot: str | None = None) -> np.ndarray:
        """The array `slot`'s update writes into, also stored as `<slot>Out` (or as
        `out_slot`: Paddle's FTRL names its outputs SquaredAccumOut, LinearAccumOut).

        Fluid updates in place (ParamOut names Param): then the input array
        itself is written. When the output names another variable, or the input
        cannot be written in place (read-only, strided, another dtype), a copy is
        updated and stored under the output name instead.
        """
        in_name, out_name = self.op.input(slot), self.op.output(out_slot or slot + "Out")
        value = self.env[in_name]
        if not isinstance(value, np.ndarray) or value.size != self.size:
            raise ExecutionError(
                f"{self.op.type}: {slot} {in_name!r} ({_describe(value)}) does not match Param of shape "
                f"{list(self.shape)}"
            )
        in_place = (
            out_name == in_name
            and value.dtype == self.dtype
            and value.flags.c_contiguous
            and value.flags.writeable
        )
        target = value if in_place else np.array(value, dtype=self.dtype, order="C")
        if out_name is not None:
            self.env[out_name] = target
        return target

    def value(self, slot: str) -> np.generic:
        """A one-element input (LearningRate, Beta1Pow...) as a scalar of Param's dtype."""
        name = self.op.input(slot)
        value = np.asarray(self.env[name])
        if value.size != 1:
            raise ExecutionError(
                f"{self.op.type}: {slot} {name!r} must hold one value, got shape {list(value.shape)}"
            )
        return self.scalar(value.reshape(-1)[0])

    def grad(self, merge: bool, sort: bool = False) -> tuple[np.ndarray, np.ndarray, tuple[int, int], bool]:
        """(rows, value [n, width], the [rows, width] view of Param, sparse?); a
        sparse gradient's repeated rows summed when `merge`, its rows sorted when `sort`."""
        name = self.op.input("Grad")
        grad = self.env[name]
        size = self.size
        if not isinstance(grad, SelectedRows):
            grad = contiguous(grad, dtype=self.dtype)
            if grad.size != size:
                raise ExecutionError(
                    f"{self.op.type}: Grad {name!r} of shape {list(grad.shape)} does not match Param of shape "
                    f"{list(self.shape)}"
                )
            return _DENSE_ROWS, grad.reshape(1, size), (1, size), False
        if not self.shape or grad.height != self.shape[0] or grad.value.shape[1:] != self.shape[1:]:
            raise ExecutionError(
                f"{self.op.type}: Grad {name!r} ({grad!r}) does not match Param of shape {list(self.shape)}"
            )
        height = self.shape[0]
        width = size // height if height else 0
        rows = contiguous(grad.rows, dtype=np.int64)
        value = contiguous(grad.value, dtype=self.dtype).reshape(rows.shape[0], width)
        bad = _first_bad_row(rows, height)
        if bad >= 0:
            raise ExecutionError(
                f"{self.op.type}: Grad {name!r} names row {int(rows[bad])} of a {height}-row parameter"
            )
        if merge and rows.shape[0] > 1:
            # (A gradient whose rows come once each, as a trainer sums a distributed table's,
            # has nothing to merge: it is applied as it came, not copied.)
            slots = self.slots.get(height)
            if _repeated_rows(rows, slots):
                rows, value = _merge_rows(rows, value, slots)
            if sort:
                order = np.argsort(rows)
                rows, value = rows[order], value[order]
        return rows, value, (height, width), True


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    return type(value).__name__
