"""Running programs: locally here, and in a job through the rooms below.

The top level is local execution, and imports no ZeroMQ: the Executor (executor.py),
Scope (scope.py), the block runner (block_runner.py), and the Runtime (runtime.py)
an Executor makes only for programs that take part in a job, whose pieces load the
rooms they need when first used. Every other responsibility has a room of its own;
each room's docstring says what it owns and what it may import, and
tests/unit/test_layering.py holds the code to it:

- compiler/   a block's ops as numba-compiled segments (Executor(compile=True))
- transport/  ZeroMQ messages: the wire format, request / reply, CURVE keys
- ps/         parameter-server training: a trainer's client, the pserver loop with one
              strategy per mode, membership, checkpoints
- tasks/      datasets as tasks: the coordinator, its queue, the trainers' readers
- remote/     RemoteExecutor: jobs on executor servers, and the servers themselves
- launch/     processes on one machine: the launcher, the processes a job starts,
              the environment contract, progress
- pipeline/   pipeline programs' stages on a schedule (model parallelism)
- metrics/    a job process's Prometheus metrics (the metrics extra)

May import: fluidps.errors, fluidps.endpoints, fluidps.ir, fluidps.ops, fluidps.transpiler.config,
fluidps.transpiler.pipeline, fluidps.transpiler.cost_model, fluidps.executor.compiler, fluidps.executor.pipeline, fluidps.executor.transport, fluidps.executor.ps, fluidps.executor.tasks,
fluidps.executor.metrics, fluidps.profiling
"""

from fluidps.executor.executor import Executor, PreparedProgram
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.scope import Scope

__all__ = ["Executor", "PreparedProgram", "RuntimeConfig", "Scope"]
