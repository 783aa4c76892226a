"""Which ops of a block form compiled segments, and the segments' callables."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from fluidps.executor.compiler import fusion
from fluidps.executor.compiler.batching import Batch
from fluidps.executor.compiler.cache import ModuleCache
from fluidps.executor.compiler.codegen import FUNCTION, generate, layout
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME, to_numpy_dtype
from fluidps.ops import REGISTRY
from fluidps.ops.lowering import NotLowerable

MIN_OPS = 2  # a lone op gains nothing from a compiled call of its own
COMPILE_AFTER = 10  # runs before a block compiles (Compiler.compile_after)


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


def explain(block: Block, min_ops: int = MIN_OPS, fuse: bool = True) -> str:
    """Which ops of `block` run compiled, in which segments (elementwise runs fused into
    one loop in brackets, with the arrays they never store and those they store in arrays
    dead by then; updates of many parameters batched into one loop in braces), and why the
    others do not. (A fetched variable is stored too.) `fuse`: as Compiler.fuse."""
    reasons = why_not_lowered(block)
    outlives = outlives_block(block)
    segments = runs([r is None for r in reasons], stateful(block), min_ops)
    starts = dict(segments)
    covered = sum(stop - start for start, stop in segments)
    lines = [f"block {block.idx}: {len(block.ops)} ops, {covered} compiled in {len(segments)} segments"]
    i = 0
    while i < len(block.ops):
        if i in starts:
            stop = starts[i]
            later = {n for op in block.ops[stop:] for n in op.input_arg_names}
            plan = layout(block.ops[i:stop], lambda n, r=later: n in r or outlives(n), fuse)
            items = plan.items
            kinds = ", ".join(_describe(x) for x in items)
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


def _describe(item: object) -> str:
    """An item of a segment as explain shows it: [a+b] a fused run, {sgd x3} a batch."""
    if isinstance(item, fusion.Run):
        return f"[{fusion.describe(item)}]"
    if isinstance(item, Batch):
        return f"{{{item.type} x{len(item.ops)}}}"
    return item.type


def _persistable(block: Block, name: str) -> bool:
    var = block.find_var(name)  # a sub-block's own, or an enclosing block's
    return var is not None and var.persistable


def outlives_block(block: Block) -> Callable[[str], bool]:
    """Whether a variable's value is wanted after `block` runs, whatever its ops read:
    persistable state, and in a sub-block (a pserver's optimize block) every variable an
    enclosing block declares, which other blocks may read (a learning rate)."""
    own = block.vars
    return lambda name: _persistable(block, name) or (block.idx > 0 and name not in own)


def stateful(block: Block) -> list[bool]:
    """Per op of `block`: whether it writes persistable state (an optimizer's update)."""
    return [
        any((v := block.find_var(n)) is not None and v.persistable for n in op.output_arg_names)
        for op in block.ops
    ]


def runs(lowered: list[bool], writes_state: list[bool], min_ops: int = MIN_OPS) -> list[tuple[int, int]]:
    """Runs of lowered ops, of at least `min_ops`, as (start, stop). Within a maximal run,
    the ops from its first to its last that write persistable state (an optimizer's
    updates, and what they compute between them: a parameter's own learning rate) form
    a segment of their own: a segment without them can be run again by the interpreter,
    when it fails, to say which op failed and why."""
    out: list[tuple[int, int]] = []
    i = 0
    while i < len(lowered):
        if not lowered[i]:
            i += 1
            continue
        stop = i
        while stop < len(lowered) and lowered[stop]:
            stop += 1
        stateful = [k for k in range(i, stop) if writes_state[k]]
        cuts = [i, stateful[0], stateful[-1] + 1, stop] if stateful else [i, stop]
        out += [(a, b) for a, b in itertools.pairwise(cuts) if b - a >= min_ops]
        i = stop
    return out


@dataclass(frozen=True)
class Compiler:
    """How an Executor compiles: where generated code is kept, the fewest ops a
    segment has (a lone op gains little from a compiled call of its own; tests that
    check one op's compiled form set 1), whether elementwise runs fuse (and updates
    of many parameters batch), when a block compiles, and whether on a thread of its
    own (`background`: the block runs interpreted until its code is ready, see
    fluidps.executor.compiler.ahead; a pserver's optimize blocks do)."""

    cache: ModuleCache
    min_ops: int = MIN_OPS
    # A block compiles at its `compile_after`-th run (a few interpreted steps are cheaper
    # than a compile for a program that runs only a few times), or at its second run when
    # its code is on disk already. 2: always at the second run.
    compile_after: int = COMPILE_AFTER
    fuse: bool = True  # elementwise runs as one loop each (.fusion), neighbouring updates too (.batching)
    background: bool = False


def compile_block(
    block: Block, compiler: Compiler, keep: Collection[str] = (), cached_only: bool = False
) -> list[Segment] | None:
    """The compiled segments of `block`. `keep`: variables wanted after the block runs
    besides persistable ones (its fetches). `cached_only`: None unless every segment's
    code is in the cache already (then loading it costs little)."""
    outlives = outlives_block(block)
    sources = []
    for start, stop in runs(lowerable(block), stateful(block), compiler.min_ops):
        later_reads = {n for op in block.ops[stop:] for n in op.input_arg_names if n != EMPTY_VAR_NAME}
        wanted = later_reads | set(keep)
        source = generate(block.ops[start:stop], lambda n, w=wanted: n in w or outlives(n), compiler.fuse)
        if cached_only and not compiler.cache.holds(source.text, source.helper_sources):
            return None
        sources.append((start, stop, source))
    segments = []
    for start, stop, source in sources:
        module = compiler.cache.load(source.text, source.helper_sources)
        in_place = [n for n in source.inputs if n in source.outputs and _persistable(block, n)]
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
