"""Sync mode: a distributed table's update, the rows the next step asks for first.

In a sync step a trainer sends its gradients with its barrier and a GET of the dense
parameters, then the PREFETCH of its next batch's rows. Applied whole, the table's
update stands between the gradients and both answers. Yet most of a batch's rows are
not in the next batch (about 70% on the CTR workload), and a distributed table is
never read whole. So a sync pserver applies the dense parameters, answers the GET and
holds the table blocks' updates (`hold`). A PREFETCH then has the rows it asks for
brought up to date first (`first`: the gradient cut to those rows, applied), and is
answered; the rest is applied once no request waits, while the trainer computes
(`flush`). Anything else that reads a table with an update held applies it first.

The cut costs the batch, not the table: the asked rows are marked in an array of the
table's height (a byte a row, kept from cut to cut), the gradient's entries read their
marks, and the asked rows are unmarked again. Only the asked entries are copied before
the answer; the rest is copied when it is applied.

Exact: the updates this applies to are row-local (each row's new values depend on its
own values, state and gradient rows, and on values shared by all rows, such as the
learning rate and Adam's beta powers). A row's gradient entries keep their order in
either part, so it sums them as before. The first part must not move the shared state:
what the update writes of it (`scalars`) is put back after that part, so that the second
part runs with the step's values and moves it once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.program import Block, Program
from fluidps.ops.selected_rows import SelectedRows

# Ops that combine the trainers' gradients (each row on its own), when they read only them.
_ON_GRADIENTS = frozenset({"sum", "scale"})
# Optimizers whose sparse update is row-local, and the outputs of each that hold state
# shared by all rows. (Adam only lazily: otherwise it decays every row.)
_SHARED_OUTPUTS = {
    "sgd": (),
    "momentum": (),
    "adagrad": (),
    "ftrl": (),
    "adam": ("Beta1PowOut", "Beta2PowOut"),
}


@dataclass(frozen=True)
class SplitBlock:
    """An optimize block whose table update can be cut by rows."""

    table: str  # the table block it updates (a distributed table's, held here whole)
    inputs: tuple[str, ...]  # the gradients it reads (a copy per trainer, or the gradient)
    scalars: tuple[str, ...]  # state shared by all rows that it writes (put back after a first part)


def split_blocks(
    program: Program,
    grad_blocks: Mapping[str, int],
    tables: Iterable[str],
    copies: Mapping[str, Iterable[str]],
) -> dict[str, SplitBlock]:
    """Per gradient whose optimize block (`grad_blocks`) updates a table of `tables` by rows,
    reading the gradient's `copies`: how it cuts (split_block)."""
    splits = {g: split_block(program.block(i), tables, copies[g]) for g, i in grad_blocks.items()}
    return {g: split for g, split in splits.items() if split is not None}


def split_block(block: Block, tables: Iterable[str], inputs: Iterable[str]) -> SplitBlock | None:
    """How `block`, reading gradients `inputs`, updates a table of `tables` by rows; None when
    it does not: another parameter, an update that is not row-local, or an op that mixes
    something else into the gradient (a regularizer reading the parameter) or writes
    other state (Fluid 1.x's beta-power `scale` ops)."""
    inputs = tuple(dict.fromkeys(inputs))
    params = {name for op in block.ops for name in op.inputs.get("Param", ())}
    if len(params) != 1 or not params <= set(tables):
        return None
    gradients, scalars = set(inputs), []
    for op in block.ops:
        if op.type in _ON_GRADIENTS and set(op.input_arg_names) <= gradients:
            gradients.update(op.output_arg_names)
        elif op.type in _SHARED_OUTPUTS and set(op.inputs.get("Grad", ())) <= gradients:
            if op.type == "adam" and not op.attr("lazy_mode"):
                return None
            scalars += [name for slot in _SHARED_OUTPUTS[op.type] for name in op.outputs.get(slot, ())]
        else:
            return None
    return SplitBlock(params.pop(), inputs, tuple(dict.fromkeys(scalars)))


@njit(cache=True)
def _mark_asked(marks, asked, rows, out):
    """out[i] = whether rows[i] is among `asked`: the asked rows marked in `marks` (one
    entry a table row, all False), read, and unmarked again (as the optimizer kernels'
    RowSlots are: ops/optimizer_rows.py), so the cost follows the batch. Returns False,
    with `out` unfinished and `marks` as found, when an index is outside the table."""
    height = marks.shape[0]
    for j in range(asked.shape[0]):
        if asked[j] < 0 or asked[j] >= height:
            for k in range(j):
                marks[asked[k]] = False
            return False
        marks[asked[j]] = True
    ok = True
    for i in range(rows.shape[0]):
        if rows[i] < 0 or rows[i] >= height:
            ok = False
            break
        out[i] = marks[rows[i]]
    for j in range(asked.shape[0]):
        marks[asked[j]] = False
    return ok


@njit(cache=True)
def _entries(rows, values, mask, keep):
    """(rows, values) of the entries whose `mask` is `keep`, in the gradient's order."""
    n = 0
    for i in range(rows.shape[0]):
        n += mask[i] == keep
    rows_out = np.empty(n, dtype=np.int64)
    values_out = np.empty((n, values.shape[1]), dtype=values.dtype)
    a = 0
    for i in range(rows.shape[0]):
        if mask[i] == keep:
            rows_out[a] = rows[i]
            for j in range(values.shape[1]):
                values_out[a, j] = values[i, j]
            a += 1
    return rows_out, values_out


@dataclass(frozen=True)
class _Cut:
    """A gradient cut by the rows a PREFETCH asked for: `mask` marks them among its entries."""

    value: SelectedRows
    mask: np.ndarray

    @property
    def asked(self) -> int:
        return int(np.count_nonzero(self.mask))

    def part(self, asked: bool) -> SelectedRows:
        """The entries of the asked rows, or of the others (made when applied: the rest
        is copied while the trainer computes, not before the answer)."""
        value = self.value
        rows, values = _entries(value.rows, value.value.reshape(len(value.rows), -1), self.mask, asked)
        return SelectedRows(rows, values.reshape(-1, *value.value.shape[1:]), value.height)


class RowsFirst:
    """The table updates a sync pserver holds (see the module doc).

    `blocks`: per gradient, how its optimize block cuts by rows; `run(grads)` runs the
    optimize blocks of `grads` on `env`. Whatever reads a table with an update held calls
    `first` (a PREFETCH: its rows) or `flush` (anything else) before it reads."""

    def __init__(
        self, env: dict[str, Any], blocks: Mapping[str, SplitBlock], run: Callable[[list[str]], None]
    ):
        self._env = env
        self.blocks = dict(blocks)
        self._run = run
        self.pending: list[str] = []
        self._rests: dict[str, list[_Cut]] = {}  # held updates cut by a first part: what is left
        # Per table: a mark a row, all False between cuts (see _mark_asked).
        self._marks: dict[str, np.ndarray] = {}
        # A PREFETCH has read from what is held: the rest is applied as soon as nothing waits.
        self.asked = False
        self.counts = {"held": 0, "cut": 0, "rows_first": 0, "rows_after": 0}

    def hold(self, grads: list[str]) -> list[str]:
        """Hold the updates of those `grads` that cut by rows; returns the others, to apply now."""
        held = [g for g in grads if g in self.blocks and self._is_array(self.blocks[g].table)]
        again = [g for g in held if g in self.pending]
        if again:  # its gradient would have replaced the one held: a step lost
            raise ExecutionError(f"the update of {again} is held already; it must be applied before the next")
        if held:
            self.pending += held
            self.asked = False  # (no PREFETCH has read from these yet)
            self.counts["held"] += len(held)
        return [g for g in grads if g not in held]

    def first(self, asked: Mapping[str, np.ndarray]) -> None:
        """Bring the rows `asked` (table block -> row indices) names up to date: each held
        update of an asked table is applied to those rows now, the rest held (applied
        whole when all its rows are asked for, or when it cannot be cut). Cut once: a
        later PREFETCH (another trainer's) has what is left applied whole, or each
        trainer would add a part, and the pserver's work with it."""
        if self.asked:
            self.flush()
            return
        whole, cuts = [], {}
        for grad in self.pending:
            block = self.blocks[grad]
            if block.table not in asked:
                continue
            values = [self._env.get(name) for name in block.inputs]
            shared = [self._env.get(name) for name in block.scalars if name in self._env]
            if not all(isinstance(v, SelectedRows) for v in values) or not all(
                isinstance(v, np.ndarray) for v in shared
            ):
                whole.append(grad)
                continue
            parts = [self._cut(v, block.table, asked[block.table]) for v in values]
            now = sum(cut.asked for cut in parts)
            later = sum(len(cut.mask) for cut in parts) - now
            if now and later:
                cuts[grad] = parts
                self.counts["rows_first"] += now
                self.counts["rows_after"] += later
            elif now:
                whole.append(grad)
        self.asked = True
        if whole:
            self.pending = [g for g in self.pending if g not in whole]
            self._run(whole)
        if cuts:
            self._apply_first(cuts)

    def _cut(self, value: SelectedRows, table: str, asked: np.ndarray) -> _Cut:
        """`value` cut by the `asked` rows of `table` (see _mark_asked)."""
        height = len(self._env[table])
        marks = self._marks.get(table)
        if marks is None or len(marks) != height:
            marks = self._marks[table] = np.zeros(height, dtype=np.bool_)
        mask = np.empty(len(value.rows), dtype=np.bool_)
        rows = np.asarray(value.rows, dtype=np.int64)
        # (Checked where they arrived: this guards the compiled loop, which does not bounds-check.)
        if not _mark_asked(marks, np.asarray(asked, dtype=np.int64), rows, mask):
            raise ExecutionError(f"rows asked of or updated in {table!r} are outside its {height} rows")
        return _Cut(value, mask)

    def _apply_first(self, cuts: dict[str, list[_Cut]]) -> None:
        """Apply the first part of each cut update, leaving its shared state as it was, and
        hold the rest in place of the whole."""
        grads = list(cuts)
        shared = {
            name: self._env[name] for g in grads for name in self.blocks[g].scalars if name in self._env
        }
        saved = {name: value.copy() for name, value in shared.items()}
        self._give(cuts, asked=True)
        try:
            self._run(grads)
        except BaseException:
            # Part-applied: applying them whole too would apply those rows twice.
            self.pending = [g for g in self.pending if g not in cuts]
            raise
        finally:
            for name, value in shared.items():
                np.copyto(value, saved[name])
                self._env[name] = value
        self._rests.update(cuts)
        self.counts["cut"] += len(grads)

    def _give(self, cuts: dict[str, list[_Cut]], asked: bool) -> None:
        """Put the part of each cut gradient of the rows asked for (or of the rest) in its place."""
        for grad, parts in cuts.items():
            for name, cut in zip(self.blocks[grad].inputs, parts, strict=True):
                self._env[name] = cut.part(asked)

    def holds(self, names: Iterable[str]) -> bool:
        """Whether an update held writes a table of `names`."""
        tables = {self.blocks[g].table for g in self.pending}
        return any(name in tables for name in names)

    def flush(self) -> None:
        """Apply what is held."""
        self.asked = False
        if self.pending:
            grads, self.pending = self.pending, []
            rests, self._rests = self._rests, {}
            self._give(rests, asked=False)
            self._run(grads)

    def _is_array(self, name: str) -> bool:
        return isinstance(self._env.get(name), np.ndarray)  # a hashed table updates by id: not cut
