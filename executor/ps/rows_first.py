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
from fluidps.ir.program import Block
from fluidps.ops.hashed_table import IdIndex
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
def _split_rows(rows, values, found):
    """(rows, values) of the entries `found` marks (>= 0), and of the others, each in the
    gradient's order, in one pass."""
    n = rows.shape[0]
    rows_in, rows_out = np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    values_in, values_out = np.empty_like(values), np.empty_like(values)
    a = b = 0
    for i in range(n):
        if found[i] >= 0:
            rows_in[a] = rows[i]
            for j in range(values.shape[1]):
                values_in[a, j] = values[i, j]
            a += 1
        else:
            rows_out[b] = rows[i]
            for j in range(values.shape[1]):
                values_out[b, j] = values[i, j]
            b += 1
    return rows_in[:a], values_in[:a], rows_out[:b], values_out[:b]


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
            # The asked rows in a hash index sized to them: the cost follows the batch, not the table.
            wanted = IdIndex(2 * len(asked[block.table]))  # (at half load: no regrowing)
            wanted.add(np.asarray(asked[block.table], dtype=np.int64), 0)
            parts = [_cut(v, wanted) for v in values]
            now = sum(len(first.rows) for first, _ in parts)
            later = sum(len(rest.rows) for _, rest in parts)
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

    def _apply_first(self, cuts: dict[str, list[tuple[SelectedRows, SelectedRows]]]) -> None:
        """Apply the first part of each cut update, leaving its shared state as it was, and
        hold the rest in place of the whole."""
        grads = list(cuts)
        shared = {
            name: self._env[name] for g in grads for name in self.blocks[g].scalars if name in self._env
        }
        saved = {name: value.copy() for name, value in shared.items()}
        self._give(cuts, 0)
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
        self._give(cuts, 1)
        self.counts["cut"] += len(grads)

    def _give(self, cuts: dict[str, list[tuple[SelectedRows, SelectedRows]]], part: int) -> None:
        """Put part 0 (the rows asked for) or 1 (the rest) of each cut gradient in place of it."""
        for grad, parts in cuts.items():
            for name, pair in zip(self.blocks[grad].inputs, parts, strict=True):
                self._env[name] = pair[part]

    def holds(self, names: Iterable[str]) -> bool:
        """Whether an update held writes a table of `names`."""
        tables = {self.blocks[g].table for g in self.pending}
        return any(name in tables for name in names)

    def flush(self) -> None:
        """Apply what is held."""
        self.asked = False
        if self.pending:
            grads, self.pending = self.pending, []
            self._run(grads)

    def _is_array(self, name: str) -> bool:
        return isinstance(self._env.get(name), np.ndarray)  # a hashed table updates by id: not cut


def _cut(value: SelectedRows, wanted: IdIndex) -> tuple[SelectedRows, SelectedRows]:
    """`value`'s entries of the rows `wanted` holds, and the others."""
    values = value.value.reshape(len(value.rows), -1)
    rows_in, values_in, rows_out, values_out = _split_rows(value.rows, values, wanted.find(value.rows))
    shape = value.value.shape[1:]
    return (
        SelectedRows(rows_in, values_in.reshape(-1, *shape), value.height),
        SelectedRows(rows_out, values_out.reshape(-1, *shape), value.height),
    )
