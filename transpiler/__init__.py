"""Program transformations: autodiff and the distribute transpiler."""

from fluidps.backward import append_backward
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.distribute import DistributeTranspiler
from fluidps.transpiler.plan import DistributedPlan, Slice

__all__ = [
    "DistributeTranspiler",
    "DistributeTranspilerConfig",
    "DistributedPlan",
    "Slice",
    "append_backward",
]
