"""Which ops of a block form compiled segments, and the segments' callables."""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from fluidps.executor.compiler import fusion
from fluidps.executor.compiler.cache import ModuleCache
from fluidps.executor.compiler.codegen import FUNCTION, generate, layout
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME, to_numpy_dtype
from fluidps.ops import REGISTRY
from fluidps.ops.lowering import NotLowerable

MIN_OPS = 2  # a lone op gains nothing from a compiled call of its own


@dataclass
class Segment:
    """Ops start .. stop - 1 of a block as one compiled function of `inputs` that
    returns `outputs` (variable names)."""

    start: int
    stop: int
    inputs: list[str]
    outputs: list[str]
    fn: Callable[..., Any]
    writes_in_place: list[str]  # inputs the segment updates in place (persistable state)


def why_not_lowered(block: Block) -> list[str | None]:
    """Per op of `block`: None when it has a compiled form as it is configured, else why not."""
    reasons: list[str | None] = []
    for op in block.ops:
        try:
            REGISTRY.lower(op, lambda n: "x", lambda f: "h")
            reasons.append(None)
        except NotLowerable as e:
            reasons.append(str(e))
    return reasons


def lowerable(block: Block) -> list[bool]:
    """Per op of `block`: whether it has a compiled form as it is configured."""
    return [why is None for why in why_not_lowered(block)]


def explain(block: Block, min_ops: int = MIN_OPS) -> str:
    """Which ops of `block` run compiled, in which segments (elementwise runs fused into
    one loop in brackets, with the arrays they never store and those they store in arrays
    dead by then), and why the others do not. (A fetched variable is stored too.)"""
    reasons = why_not_lowered(block)
    persistable = {n for n, v in block.vars.items() if v.persistable}
    segments = runs([r is None for r in reasons], stateful(block), min_ops)
    starts = dict(segments)
    covered = sum(stop - start for start, stop in segments)
    lines = [f"block {block.idx}: {len(block.ops)} ops, {covered} compiled in {len(segments)} segments"]
    i = 0
    while i < len(block.ops):
        if i in starts:
            stop = starts[i]
            later = {n for op in block.ops[stop:] for n in op.input_arg_names}
            plan = layout(block.ops[i:stop], lambda n, r=later: n in r or n in persistable)
            items = plan.items
            kinds = ", ".join(
                f"[{fusion.describe(x)}]" if isinstance(x, fusion.Run) else x.type for x in items
            )
            fused = ""
            if runs_ := [x for x in items if isinstance(x, fusion.Run)]:
                unstored = plan.unstored()
                reused = [r.output for reuses in plan.reuses.values() for r in reuses.values()]
                fused = (
                    f"; {sum(len(r.members) for r in runs_)} ops fused into {len(runs_)} loops, "
                    f"{len(unstored)} arrays never stored ({_bytes(block, unstored)}), "
                    f"{len(reused)} stored in dead arrays ({_bytes(block, reused)})"
                )
            lines.append(f"  ops #{i}..#{stop - 1}: one compiled call ({kinds}){fused}")
            i = stop
            continue
        why = reasons[i] or f"in a run shorter than {min_ops} ops"
        lines.append(f"  op #{i} ({block.ops[i].type}): interpreted: {why}")
        i += 1
    return "\n".join(lines)


def stateful(block: Block) -> list[bool]:
    """Per op of `block`: whether it writes persistable state (an optimizer's update)."""
    return [
        any((v := block.find_var(n)) is not None and v.persistable for n in op.output_arg_names)
        for op in block.ops
    ]


def runs(lowered: list[bool], writes_state: list[bool], min_ops: int = MIN_OPS) -> list[tuple[int, int]]:
    """Maximal runs of lowered ops, of at least `min_ops`, as (start, stop). Ops that write
    persistable state run in segments of their own: a segment without them can be run
    again by the interpreter, when it fails, to say which op failed and why."""
    out: list[tuple[int, int]] = []
    start = None
    for i in range(len(lowered) + 1):
        ends = i == len(lowered) or not lowered[i]
        ends = ends or (start is not None and writes_state[i] != writes_state[start])
        if ends and start is not None:
            if i - start >= min_ops:
                out.append((start, i))
            start = None
        if i < len(lowered) and lowered[i] and start is None:
            start = i
    return out


@dataclass(frozen=True)
class Compiler:
    """How an Executor compiles: where generated code is kept, the fewest ops a
    segment has (a lone op gains little from a compiled call of its own; tests that
    check one op's compiled form set 1), and whether elementwise runs fuse."""

    cache: ModuleCache
    min_ops: int = MIN_OPS
    fuse: bool = True  # elementwise runs as one loop each (fluidps.executor.compiler.fusion)


def compile_block(block: Block, compiler: Compiler, keep: Collection[str] = ()) -> list[Segment]:
    """The compiled segments of `block`. `keep`: variables wanted after the block runs
    besides persistable ones (its fetches)."""
    persistable = {n for n, v in block.vars.items() if v.persistable}
    segments = []
    for start, stop in runs(lowerable(block), stateful(block), compiler.min_ops):
        later_reads = {n for op in block.ops[stop:] for n in op.input_arg_names if n != EMPTY_VAR_NAME}
        source = generate(
            block.ops[start:stop], (later_reads | persistable | set(keep)).__contains__, compiler.fuse
        )
        module = compiler.cache.load(source.text, source.helper_sources)
        in_place = [n for n in source.inputs if n in source.outputs and n in persistable]
        segments.append(
            Segment(start, stop, source.inputs, source.outputs, getattr(module, FUNCTION), in_place)
        )
    return segments


def _bytes(block: Block, names: list[str]) -> str:
    """The bytes of `names` as declared: per batch row where a dimension is -1."""
    total, per_row = 0, False
    for name in names:
        var = block.find_var(name)
        if var is None or var.shape is None or var.dtype is None:
            continue
        per_row |= -1 in var.shape
        total += to_numpy_dtype(var.dtype).itemsize * math.prod(d for d in var.shape if d != -1)
    return f"{total:,} bytes{' per batch row' if per_row else ''}"
