"""One segment's source: a function of the variables it reads that returns those it
writes and others need, with each op's statements in between.

Variables become locals named v0, v1, ... (Fluid's names hold dots and @); helpers
are imported from their modules under h0, h1, ... . A comment maps each local
back to its variable, so that the generated file reads as the block it came from.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fluidps.executor.compiler import batching, buffers, fusion
from fluidps.ir.operator import Operator
from fluidps.ir.types import EMPTY_VAR_NAME
from fluidps.ops import REGISTRY
from fluidps.ops.lowering import LoweringOp, shape_matches

FUNCTION = "segment"
CHECKED = "checked"  # its first argument: the shapes its guard checked (rank, then dimensions, per input)


@dataclass
class SegmentSource:
    """The generated module of one segment, and how to call its function."""

    text: str
    inputs: list[str]  # variable names, in argument order (after the shapes checked)
    outputs: list[str]  # variable names, in the order of the returned tuple
    helper_sources: list[str] = field(default_factory=list)  # for the cache key


class _Names:
    def __init__(self) -> None:
        self.locals: dict[str, str] = {}
        self.helpers: dict[Callable[..., Any], str] = {}

    def local(self, name: str) -> str:
        if name not in self.locals:
            self.locals[name] = f"v{len(self.locals)}"
        return self.locals[name]

    def fresh(self) -> str:
        """A new local for a value no variable names."""
        return self.local(f"@{len(self.locals)}")

    def helper(self, fn: Callable[..., Any]) -> str:
        if fn not in self.helpers:
            self.helpers[fn] = f"h{len(self.helpers)}"
        return self.helpers[fn]


@dataclass
class Layout:
    """A segment planned: its items (ops, fused runs), its inputs, its single ops lowered,
    the arrays its runs take over, and what each run reads after it."""

    items: list[fusion.Run | Operator | batching.Batch]
    reads: list[str]
    written: set[str]
    single: dict[int, LoweringOp | batching.Batch]
    reuses: dict[int, dict[str, buffers.Reuse]]
    needed_after: Callable[[str], bool]

    def read_after(self, k: int) -> Callable[[str], bool]:
        """Whether a variable is read after item k: by a later item, or after the segment."""
        later = {n for rest in self.items[k + 1 :] for op in fusion.ops_of(rest) for n in op.input_arg_names}
        return lambda n: n in later or self.needed_after(n)

    def unstored(self) -> list[str]:
        """The variables fused runs pass along as scalars, never as arrays."""
        return [
            n
            for k, item in enumerate(self.items)
            if isinstance(item, fusion.Run)
            for n in item.unstored(self.read_after(k))
        ]


def layout(
    ops: Sequence[Operator],
    needed_after: Callable[[str], bool],
    fuse: bool = True,
    names: _Names | None = None,
) -> Layout:
    """Plan a segment of `ops` (see generate). Raises NotLowerable if an op has no compiled form."""
    names = names or _Names()
    reads: list[str] = []
    written: set[str] = set()
    items = fusion.group(ops) if fuse else list(ops)
    for item in items:
        for op in fusion.ops_of(item):
            for name in op.input_arg_names:
                if name != EMPTY_VAR_NAME and name not in written and name not in reads:
                    reads.append(name)
                    names.local(name)
            written.update(n for n in op.output_arg_names if n != EMPTY_VAR_NAME)
    # Single ops first: whether their outputs are new arrays decides which arrays runs may reuse.
    single: dict[int, LoweringOp | batching.Batch] = {
        k: REGISTRY.lower(item, names.local, names.helper)
        for k, item in enumerate(items)
        if not isinstance(item, fusion.Run)
    }
    if fuse:  # neighbouring updates of many parameters as one loop
        items, single = batching.batch(items, single)
    fresh = [k not in single or single[k].fresh for k in range(len(items))]
    reuses = buffers.plan(items, fresh, set(reads), needed_after)
    return Layout(items, reads, written, single, reuses, needed_after)


def generate(
    ops: Sequence[Operator], needed_after: Callable[[str], bool], fuse: bool = True
) -> SegmentSource:
    """The source of one segment of `ops`; `needed_after(name)` says whether a variable
    the segment writes is read after it (by a later op, a fetch, or the scope). With
    `fuse`, runs of elementwise ops become one loop each (fluidps.executor.compiler.fusion),
    storing their outputs in arrays dead by then where they can (.buffers).
    Raises NotLowerable if one of the ops has no compiled form."""
    names = _Names()
    plan = layout(ops, needed_after, fuse, names)
    items, reads, written = plan.items, plan.reads, plan.written
    body: list[str] = []
    for k, item in enumerate(items):
        if isinstance(item, fusion.Run):
            body.append(f"    # fused: {fusion.describe(item)}")
            lines = fusion.lower_run(
                item, names.local, names.helper, names.fresh, plan.read_after(k), plan.reuses.get(k, {})
            )
        else:
            what = (
                f"{item.type} of {len(item.ops)} parameters"
                if isinstance(item, batching.Batch)
                else item.type
            )
            body.append(f"    # {what}")
            lines = plan.single[k].lines
        body += [f"    {line}" for line in lines]
    outputs = [n for n in names.locals if n in written and needed_after(n)]
    # First, its inputs' shapes against those its shape guard checked (ops.lowering.ShapesChanged):
    # numba checks no bounds, and a step with the shapes of the step before costs no Python.
    check = [f"    {CHECKED}k = 0"]
    check += [
        f"    {CHECKED}k = {names.helper(shape_matches)}({CHECKED}, {CHECKED}k, {names.locals[n]})"
        for n in reads
    ]
    check += [f"    if {CHECKED}k != {CHECKED}.shape[0]:", "        raise ShapesChanged()"]
    imports = ["from fluidps.ops.lowering import ShapesChanged"]
    sources = []
    for fn, alias in names.helpers.items():
        py = getattr(fn, "py_func", fn)
        imports.append(f"from {py.__module__} import {py.__name__} as {alias}")
        sources.append(inspect.getsource(py))
    mapping = ["# Locals (as named in the block this was generated for):"]
    mapping += [f"#   {local} = {name}" for name, local in names.locals.items() if not name.startswith("@")]
    returned = ", ".join(names.locals[n] for n in outputs)
    text = "\n".join(
        [
            '"""Generated by fluidps.executor.compiler: one compiled segment of a block."""',
            "import numpy as np",
            "from numba import njit",
            *imports,
            "",
            *mapping,
            "",
            "",
            "@njit(cache=True)",
            f"def {FUNCTION}({', '.join([CHECKED, *(names.locals[n] for n in reads)])}):",
            *check,
            *body,
            f"    return ({returned}{',' if len(outputs) == 1 else ''})",
            "",
        ]
    )
    return SegmentSource(text, reads, outputs, sources)
