"""Passes from Program to Program: the distribute transpiler (trainer and pserver programs
from one training program), transpile_for_role (one process's programs of a job), and
the pipeline transpiler (one program per pipeline stage). Autodiff (fluidps.backward)
extends the program being built instead, as the layers do, so it lives beside them.

May import: fluidps.errors, fluidps.endpoints, fluidps.ir, fluidps.ops
"""

from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.distribute import DistributeTranspiler
from fluidps.transpiler.for_role import ProcessRole, RolePrograms, transpile_for_role
from fluidps.transpiler.pipeline import PipelineTranspiler
from fluidps.transpiler.pipeline_plan import Crossing, PipelinePlan, StagePlan
from fluidps.transpiler.plan import DistributedPlan, Slice

__all__ = [
    "Crossing",
    "DistributeTranspiler",
    "DistributeTranspilerConfig",
    "DistributedPlan",
    "PipelinePlan",
    "PipelineTranspiler",
    "ProcessRole",
    "RolePrograms",
    "Slice",
    "StagePlan",
    "transpile_for_role",
]
