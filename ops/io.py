"""feed and fetch: how an executor moves data in and out of a program.

Fluid programs saved for inference contain them explicitly: `feed` copies
column `col` of the FEED_MINIBATCH variable `feed` into a data variable,
`fetch` copies a result into column `col` of the FETCH_LIST variable `fetch`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext
from fluidps.ops.defs import In, Int, Out
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("io")


def _infer_column(ctx: InferContext) -> None:
    """Column `col` of the feed (fetch) list: one column per feed (fetch) op of the block.
    The executor sizes the list by the largest column, so a column is checked first."""
    col, block = ctx.attr("col"), ctx.op.block
    # (this op counted once, whether it is in the block yet or is being added to it)
    columns = None if block is None else 1 + sum(op.type == ctx.type for op in block.ops if op is not ctx.op)
    if col < 0 or (columns is not None and col >= columns):
        ctx.fail(f"attribute col={col} must be in [0, {columns}): one column per {ctx.type} op of its block")


for _type in ("feed", "fetch"):
    family.define(_type, inputs=[In("X")], outputs=[Out("Out")], attrs=[Int("col", 0)], infer=_infer_column)


@family.kernel("feed")
def _feed_kernel(op: KernelOp) -> Runner:
    feed_name, out_name, col = op.input("X"), op.output("Out"), op.attr("col")

    def run(env: Env) -> None:
        feeds = env.get(feed_name)
        if feeds is None or col >= len(feeds) or feeds[col] is None:
            raise ExecutionError(f"feed column {col} ({out_name!r}) was not fed")
        # Shared, not copied (as Fluid's feed): kernels never write into their inputs.
        env[out_name] = feeds[col]

    return run


def _snapshot(value: Any) -> Any:
    if isinstance(value, SelectedRows):
        return value.copy()
    return np.array(value, copy=True)


@family.kernel("fetch")
def _fetch_kernel(op: KernelOp) -> Runner:
    x_name, fetch_name, col = op.input("X"), op.output("Out"), op.attr("col")

    def run(env: Env) -> None:
        fetched = env.get(fetch_name)
        if fetched is None:
            fetched = env[fetch_name] = []
        fetched.extend([None] * (col + 1 - len(fetched)))
        # A copy, as Fluid's fetch: a parameter updated in place later must not change it.
        fetched[col] = _snapshot(env[x_name])

    return run
