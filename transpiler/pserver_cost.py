"""What a parameter block costs the pserver that holds it, a trainer's step: its update
ops over the block's rows and the block's two messages (the gradient in, the values
out). DistributeTranspilerConfig(split_method="Cost") places blocks to balance it, and
every plan reports it per pserver (DistributedPlan.loads).

The rates are the cost model's fixed analytic ones (cost_model.ANALYTIC), never this
machine's calibration: every process of a job transpiles the program on its own
(transpile_for_role), and they must all place each block on the same pserver.
"""

from __future__ import annotations

from collections.abc import Sequence

from fluidps.ir.program import Block
from fluidps.transpiler.analysis import ParamUpdate
from fluidps.transpiler.cost_model import ANALYTIC, CostModel

_FIXED = CostModel(ANALYTIC)


def block_load(block: Block, update: ParamUpdate, rows: int, nbytes: int) -> float:
    """Predicted seconds a step of the block of `rows` rows (of `nbytes`) of `update`'s
    parameter costs its pserver: its share of the update ops, and its two messages."""
    param = block.var(update.param)
    total_rows = param.shape[0] if param.shape else 1
    share = rows / total_rows if total_rows > 0 else 1.0
    ops = block.ops
    updating = sum(_FIXED.op_seconds(block, ops[i], 1) for i in update.ops) * share
    return updating + 2 * _FIXED.message_cpu_seconds(nbytes)


def balance(loads: Sequence[float], endpoints: Sequence[str], fixed: Sequence[str | None]) -> list[str]:
    """The pserver of each block: `fixed[i]` where given (a table's block k on pserver k),
    the others the largest first, each to the pserver with the least load so far (ties:
    the block that comes first, the pserver listed first)."""
    total = dict.fromkeys(endpoints, 0.0)
    placed: list[str | None] = list(fixed)
    for i, endpoint in enumerate(fixed):
        if endpoint is not None:
            total[endpoint] += loads[i]
    for i in sorted((i for i, e in enumerate(fixed) if e is None), key=lambda i: (-loads[i], i)):
        lightest = min(endpoints, key=lambda e: (total[e], endpoints.index(e)))
        placed[i] = lightest
        total[lightest] += loads[i]
    return [e for e in placed if e is not None]
