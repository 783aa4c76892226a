"""Optimizer updates of many parameters as one loop (a multi-tensor apply).

A trainer's block ends with one update op per parameter (sgd, adam), each a few
statements around a loop over one small array. Consecutive ops of one type whose
BatchForm keys agree (fluidps.ops.lowering.BatchForm: the same attributes and
dtypes) become one `Batch`: one helper call that loops over the parameters and,
for each, does what that op's own lowering does, in the same order, so that the
bits are the same. An op between two updates that neither reads what the updates
before it wrote nor writes what they touch (a parameter's own learning rate, scaled
for its update) moves before the batch; nothing else is reordered.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from fluidps.ir.operator import Operator
from fluidps.ir.types import EMPTY_VAR_NAME
from fluidps.ops import REGISTRY
from fluidps.ops.lowering import LoweringOp

MIN_BATCH = 2  # a lone update is lowered on its own


@dataclass
class Batch:
    """Consecutive update ops of one type, lowered together: `lines` are their statements."""

    ops: list[Operator]
    lines: list[str]
    fresh: bool = False  # updates write their inputs' arrays in place

    @property
    def type(self) -> str:
        return self.ops[0].type

    @property
    def output_arg_names(self) -> list[str]:
        return [n for op in self.ops for n in op.output_arg_names if n != EMPTY_VAR_NAME]


def _key(lowered: LoweringOp) -> tuple[str, Hashable] | None:
    form = REGISTRY.batch_form(lowered.type)
    if form is None:
        return None
    key = form.key(lowered)
    return None if key is None else (lowered.type, key)


def _independent(op: Operator, members: list[Operator]) -> bool:
    """Whether `op` may run before `members` (which come before it): it reads nothing
    they write and writes nothing they read or write."""
    written = {n for m in members for n in m.output_arg_names}
    touched = written | {n for m in members for n in m.input_arg_names}
    return not (set(op.input_arg_names) & written) and not (set(op.output_arg_names) & touched)


def batch(
    items: Sequence[object], lowered: dict[int, LoweringOp]
) -> tuple[list[object], dict[int, LoweringOp | Batch]]:
    """`items` (fused runs and ops; `lowered`: each op's lowering by position) with at least
    MIN_BATCH updates of one batch key, consecutive but for independent ops (moved before
    them), as Batches. Returns the new items and the lowering of each single op or Batch
    by its new position."""
    out: list[object] = []
    out_lowered: dict[int, LoweringOp | Batch] = {}

    def put(item: object, lowering: LoweringOp | Batch | None) -> None:
        if lowering is not None:
            out_lowered[len(out)] = lowering
        out.append(item)

    k = 0
    while k < len(items):
        key = _key(lowered[k]) if k in lowered else None
        members: list[int] = [k]
        moved: list[int] = []
        j = k + 1
        while key is not None and j in lowered:
            if _key(lowered[j]) == key:
                members.append(j)
            elif _independent(lowered[j].op, [lowered[m].op for m in members]):
                moved.append(j)
            else:
                break
            j += 1
        if len(members) < MIN_BATCH:
            put(items[k], lowered.get(k))
            k += 1
            continue
        for m in moved:
            if m < members[-1]:  # (those after the last update stay where they are)
                put(items[m], lowered[m])
        ops = [lowered[m] for m in members]
        form = REGISTRY.batch_form(ops[0].type)
        assert form is not None  # (a key says there is one)
        put(Batch([op.op for op in ops], form.lines(ops)), None)
        out_lowered[len(out) - 1] = out[-1]
        k = members[-1] + 1
    return out, out_lowered
