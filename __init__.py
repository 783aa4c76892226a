"""fluidps: Fluid-style program graphs, local execution and parameter-server training.

import fluidps
from fluidps import layers

main, startup = fluidps.Program(), fluidps.Program()
with fluidps.program_guard(main, startup):
    x = layers.data("x", [64])
    y = layers.fc(x, 10, act="softmax")
"""

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
    UnknownOpError,
    UnsupportedError,
    VerifyError,
)
from fluidps.executor import Executor, Scope
from fluidps.executor.launch.env import RoleInfo, role_from_env
from fluidps.executor.remote.remote_executor import JobDesc, RemoteExecutor
from fluidps.ir import AttrType, Block, Operator, OpRole, Parameter, Program, Variable, VarType
from fluidps.layers.guard import program_guard
from fluidps.ops import REGISTRY as op_registry
from fluidps.ops import check, verify
from fluidps.optimizer.clip import GradientClipByGlobalNorm
from fluidps.optimizer.regularizer import L2Decay
from fluidps.param_attr import ParamAttr
from fluidps.transpiler import DistributedPlan, DistributeTranspiler, DistributeTranspilerConfig

__version__ = "0.1.0"

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
    "L2Decay",
    "OpRole",
    "Operator",
    "ParamAttr",
    "Parameter",
    "Program",
    "ProgramError",
    "ProgramParseError",
    "RemoteExecutor",
    "RoleInfo",
    "Scope",
    "SerializationError",
    "ShapeError",
    "UnknownOpError",
    "UnsupportedError",
    "VarType",
    "Variable",
    "VerifyError",
    "append_backward",
    "check",
    "initializer",
    "io",
    "layers",
    "op_registry",
    "optimizer",
    "program_guard",
    "role_from_env",
    "verify",
]
