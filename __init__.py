"""fluidps: Fluid-style program graphs, local execution and parameter-server training.

import fluidps
from fluidps import layers

main, startup = fluidps.Program(), fluidps.Program()
with fluidps.program_guard(main, startup):
    x = layers.data("x", [64])
    y = layers.fc(x, 10, act="softmax")

May import: anything
"""

import importlib
from typing import TYPE_CHECKING, Any

from fluidps import initializer, io, layers, optimizer
from fluidps.backward import append_backward
from fluidps.errors import (
    BuilderError,
    CheckpointError,
    DatasetError,
    EOFException,
    Error,
    ExecutionError,
    FeedError,
    ProgramError,
    ProgramParseError,
    SerializationError,
    ShapeError,
    StreamError,
    UnknownOpError,
    UnsupportedError,
    VerifyError,
)
from fluidps.executor import Executor, RuntimeConfig, Scope
from fluidps.executor.env import RoleInfo, role_from_env
from fluidps.ir import AttrType, Block, Operator, OpRole, Parameter, Program, Variable, VarType
from fluidps.layers.guard import device_guard, program_guard
from fluidps.ops import REGISTRY as op_registry
from fluidps.ops import check, verify
from fluidps.optimizer.clip import GradientClipByGlobalNorm
from fluidps.optimizer.regularizer import L2Decay
from fluidps.param_attr import ParamAttr
from fluidps.transpiler import (
    DistributedPlan,
    DistributeTranspiler,
    DistributeTranspilerConfig,
    PipelinePlan,
    PipelineTranspiler,
    RolePrograms,
    transpile_for_role,
)

if TYPE_CHECKING:
    from fluidps.executor.launch.kubernetes import KubernetesCluster, Resources
    from fluidps.executor.remote.job import JobDesc
    from fluidps.executor.remote.remote_executor import RemoteExecutor

__version__ = "0.1.0"

# RemoteExecutor and JobDesc load the ZeroMQ transport: they are imported when first
# named (PEP 562), so that `import fluidps` and local training never load it.
_LAZY = {
    "JobDesc": "fluidps.executor.remote.job",
    "RemoteExecutor": "fluidps.executor.remote.remote_executor",
    "KubernetesCluster": "fluidps.executor.launch.kubernetes",  # (with JobDesc.to_kubernetes)
    "Resources": "fluidps.executor.launch.kubernetes",
}


_LAZY_MODULES = {"serving"}  # (fluidps.serving.Predictor: imported when first used)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(f"fluidps.{name}")
    raise AttributeError(f"module 'fluidps' has no attribute {name!r}")


__all__ = [
    "AttrType",
    "Block",
    "BuilderError",
    "CheckpointError",
    "DatasetError",
    "DistributeTranspiler",
    "DistributeTranspilerConfig",
    "DistributedPlan",
    "EOFException",
    "Error",
    "ExecutionError",
    "Executor",
    "FeedError",
    "GradientClipByGlobalNorm",
    "JobDesc",
    "KubernetesCluster",
    "L2Decay",
    "OpRole",
    "Operator",
    "ParamAttr",
    "Parameter",
    "PipelinePlan",
    "PipelineTranspiler",
    "Program",
    "ProgramError",
    "ProgramParseError",
    "RemoteExecutor",
    "Resources",
    "RoleInfo",
    "RolePrograms",
    "RuntimeConfig",
    "Scope",
    "SerializationError",
    "ShapeError",
    "StreamError",
    "UnknownOpError",
    "UnsupportedError",
    "VarType",
    "Variable",
    "VerifyError",
    "append_backward",
    "check",
    "device_guard",
    "initializer",
    "io",
    "layers",
    "op_registry",
    "optimizer",
    "program_guard",
    "role_from_env",
    "serving",
    "transpile_for_role",
    "verify",
]
