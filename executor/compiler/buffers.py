"""Reusing dead arrays: where a fused run stores its outputs.

Liveness over a segment's items (ops and fused runs): an array that no later item
reads, that nothing needs after the segment, and whose memory nothing else holds
is dead, and a fused run that stores an array of the same dtype and rank takes it
instead of allocating one. Most often it is one of the run's own operands, read
for the last time in the loop that overwrites it, element by element, after
reading it (an in-place run: the backward of an fc with an activation writes its
pre-activation gradient over the gradient it came from).

What may be given away: an array the segment itself made with an op that says its
outputs are new arrays (LoweringOp.new_arrays) or a fused run, written once, read
by no op that does not say so (such an op's output may be a view of it), and not
a segment input (feeds, parameters and other arrays of the scope are never
overwritten). Sizes are known only at run time: a donor that is not one of the
run's operands (those are checked against the loop) is taken only if its shape is
the run's, else a new array is allocated.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fluidps.executor.compiler import fusion
from fluidps.ir.operator import Operator
from fluidps.ir.types import EMPTY_VAR_NAME


@dataclass(frozen=True)
class Reuse:
    """The run stores `output` in the array of `donor`, dead by then; `checked`: the
    donor is an operand of the run, whose shape the run checks already."""

    output: str
    donor: str
    checked: bool


def plan(
    items: Sequence[fusion.Run | Operator],
    fresh: Sequence[bool],
    inputs: set[str],
    needed_after: Callable[[str], bool],
) -> dict[int, dict[str, Reuse]]:
    """Per fused run (by its position in `items`): the outputs it stores in dead arrays.
    `fresh[k]`: item k's outputs are new arrays; `inputs`: the segment's inputs;
    `needed_after(name)`: read after the segment."""
    ops = [fusion.ops_of(item) for item in items]
    read_by: dict[str, list[int]] = {}
    made_by: dict[str, list[int]] = {}  # (only arrays: a run's values not stored are none)
    for k, members in enumerate(ops):
        for op in members:
            for name in _names(op.input_arg_names):
                read_by.setdefault(name, []).append(k)
    for k, item in enumerate(items):
        if isinstance(item, fusion.Run):
            later = _read_after(ops, k)
            made = [
                n
                for n in item.written
                if n not in item.unstored(lambda n, r=later: n in r or needed_after(n))
            ]
        else:
            made = _names(item.output_arg_names)
        for name in made:
            made_by.setdefault(name, []).append(k)
    # Arrays an op that makes no new arrays reads: its outputs may be views of them.
    shared = {
        n
        for k, members in enumerate(ops)
        if not fresh[k]
        for op in members
        for n in _names(op.input_arg_names)
    }
    given: set[str] = set()
    reuses: dict[int, dict[str, Reuse]] = {}
    for k, item in enumerate(items):
        if not isinstance(item, fusion.Run):
            continue
        read_after = _read_after(ops, k)
        for position, name, var in item.stored_full(lambda n, r=read_after: n in r or needed_after(n)):
            for donor in _candidates(item, position, made_by, read_by, k):
                if (
                    donor in inputs
                    or donor in shared
                    or donor in given
                    or donor in read_after
                    or needed_after(donor)
                    or len(made_by.get(donor, [])) != 1
                    or made_by[donor][0] >= k
                    or not fresh[made_by[donor][0]]
                    or not _alike(item, var, donor)
                ):
                    continue
                given.add(donor)
                reuses.setdefault(k, {})[name] = Reuse(name, donor, checked=donor in item.full_operands())
                break
    return reuses


def _candidates(
    run: fusion.Run, position: int, made_by: dict[str, list[int]], read_by: dict[str, list[int]], k: int
) -> list[str]:
    """Arrays dead at run k that the output stored by member `position` could take: first
    the run's operands that no later member reads and none reads as a broadcast operand
    (in place), then arrays made before the run and read by none after it."""
    own = [
        n
        for n in run.full_operands()
        if run.last_reader(n) <= position and n not in run.spread_operands() and n in made_by
    ]
    before = [n for n, makers in made_by.items() if makers[0] < k and max(read_by.get(n, [-1])) < k]
    return own + [n for n in before if n not in own]


def _alike(run: fusion.Run, var: object, donor: str) -> bool:
    """Same dtype and rank, as declared."""
    block = run.members[0].op.block
    other = block.find_var(donor)
    return (
        other is not None
        and other.dtype == var.dtype
        and other.shape is not None
        and var.shape is not None
        and len(other.shape) == len(var.shape)
    )


def _read_after(ops: list[list[Operator]], k: int) -> set[str]:
    """What the items after item k read."""
    return {n for members in ops[k + 1 :] for op in members for n in _names(op.input_arg_names)}


def _names(names: Sequence[str]) -> list[str]:
    return [n for n in names if n != EMPTY_VAR_NAME]
