"""A pipeline stage whose parameters live on pservers: how replicas of a pipeline keep
their stages in step.

Replica r's process of stage k is trainer r of a sync parameter-server job of stage k's
own: its section program goes through DistributeTranspiler, so that once a step, after its last micro-batch, it
sends the sums (x@GRAD@MERGED) to the stage's pservers and receives the parameters they
updated with the replicas' average. The pservers of different stages are apart: a
pserver's optimize blocks sum exactly its trainers' gradients, and each stage's trainers
are that stage's processes.
"""

from __future__ import annotations

from collections.abc import Sequence

from fluidps.errors import UnsupportedError
from fluidps.ir.program import Program
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.distribute import DistributeTranspiler
from fluidps.transpiler.pipeline import stage_startup
from fluidps.transpiler.pipeline_plan import PipelinePlan


def stage_on_pservers(
    plan: PipelinePlan,
    stage: int,
    replica: int,
    replicas: int,
    pservers: Sequence[str],
    startup: Program,
    config: DistributeTranspilerConfig,
) -> DistributeTranspiler:
    """The DistributeTranspiler of stage `stage`'s job, transpiled for trainer `replica` of
    `replicas` on `pservers`: its trainer program is the replica's section, its pserver
    programs the stage's pservers'. Raises UnsupportedError for what replicas cannot do yet:
    another mode than sync, a weight several stages read."""
    if config.mode != "sync":
        raise UnsupportedError(
            f"replicas of a pipeline keep their parameters in step in sync mode only, not {config.mode!r}"
        )
    shared = sorted({c.var for c in plan.crossings if c.phase == "optimize" and stage in (c.src, c.dst)})
    if shared:
        raise UnsupportedError(
            f"{', '.join(shared)}: a weight several stages read cannot live on pservers yet; give each stage "
            "its own weights, or run one replica without pservers"
        )
    transpiler = DistributeTranspiler(config)
    transpiler.transpile(
        replica,
        plan.stages[stage].program,  # (StageRunner zeroes its sums at each step's start)
        pservers=list(pservers),
        trainers=replicas,
        startup_program=stage_startup(startup, plan, stage),
    )
    return transpiler
