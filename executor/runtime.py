"""Runtime: one process's part in a distributed job, made only for programs that need one.

An Executor makes its Runtime the first time it prepares a program with
communication ops (send, recv, barriers, listen_and_serv, queues) or a dataset
reader, and gives it to those ops' kernels as `KernelOp.runtime`
(fluidps.ops.runtime_api.KernelRuntime). It holds three pieces, each made the
first time it is used, so that a program only loads what it needs (a local reader
loads no ZeroMQ):

- `trainer`: the connections to the pservers (fluidps.executor.ps.trainer_client);
- `pserver`: the pserver loops this process serves (fluidps.executor.ps.host);
- `readers`: the dataset readers of its programs (fluidps.executor.tasks.task_reader).

Besides those it owns what they share: the configuration it was given (it reads
no environment variables), this participant's incarnation, and its ZeroMQ context.
Nothing in it is global: two Executors in one process are two independent
participants. A whole job in one process talking over inproc:// endpoints needs
every participant to use the same context: give them the same RuntimeConfig(context=...).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fluidps.errors import ExecutionError, TransportError
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.ps.checkpointer import CheckpointOverrides
from fluidps.executor.transport.settings import RpcSettings
from fluidps.ir.program import Block
from fluidps.profiling import Profile

if TYPE_CHECKING:
    import zmq

    from fluidps.executor.compiler import Compiler
    from fluidps.executor.metrics.job_metrics import JobMetrics
    from fluidps.executor.ps.applied_batches import Delivered
    from fluidps.executor.ps.host import PserverHost
    from fluidps.executor.ps.trainer_client import TrainerClient
    from fluidps.executor.tasks.stream_reader import WindowSource
    from fluidps.executor.tasks.task_reader import Readers, TaskSource
    from fluidps.ops.runtime_api import StageChannel


@dataclass(frozen=True)
class RuntimeConfig:
    """How an Executor's runtime takes part in a job.

    `rpc`: timeouts, message limits, keys, elasticity. `coordinator`: the address of
    the job's coordinator, where readers get their tasks (None: from a queue in this
    process). `checkpoints`: what the job sets for every pserver's checkpoints.
    `profile`: keep a fluidps.profiling.Profile of where this process's time goes (the
    runtime's `profile`; trainers and pservers report it in their stats).
    `context`: a zmq.Context to share with the other participants in this process
    (needed for inproc:// endpoints; None: the runtime makes and closes its own).
    `incarnation`: this process's incarnation (0: drawn at random), and `replaces`: the
    incarnation of the same trainer id that it replaces (a launcher that restarts a
    trainer says which; pservers then hand the id over at once: see
    fluidps.executor.ps.membership).
    `metrics`: where this process serves its Prometheus metrics (None: nowhere); the
    runtime starts it and adds its pservers' and its trainer's metrics
    (fluidps.executor.metrics.job_metrics).
    `fluidps.executor.env.runtime_config_from_env` reads one from the
    environment contract.
    """

    rpc: RpcSettings = field(default_factory=RpcSettings)
    coordinator: str | None = None
    checkpoints: CheckpointOverrides = field(default_factory=CheckpointOverrides)
    context: Any = None
    profile: bool = False
    incarnation: int = 0
    replaces: int = 0
    metrics: JobMetrics | None = None


class Runtime:
    """`compiler`: the executor's, which compiles a pserver's optimize blocks too (on
    threads of their own: the pserver's loop keeps answering while they compile)."""

    def __init__(self, config: RuntimeConfig, compiler: Compiler | None = None):
        self.config = config
        self.compiler = compiler
        self._optimize_compiler = replace(compiler, background=True) if compiler else None
        # This participant's incarnation: pservers tell a restarted trainer from its old self by it.
        self.sender = config.incarnation or secrets.randbits(63) | 1
        self.profile = Profile() if config.profile else None
        self._context: zmq.Context | None = None
        self._trainer: TrainerClient | None = None
        self._pserver: PserverHost | None = None
        self._readers: Readers | None = None
        self._stages: StageChannel | None = None
        if config.metrics is not None:
            config.metrics.start()

    @property
    def settings(self) -> RpcSettings:
        return self.config.rpc

    # -- the pieces ----------------------------------------------------------------------------

    @property
    def trainer(self) -> TrainerClient:
        if self._trainer is None:
            from fluidps.executor.ps.trainer_client import TrainerClient  # loads ZeroMQ

            self._trainer = TrainerClient(
                self.settings,
                self.sender,
                self.context_for,
                self.profile,
                self.config.replaces,
                batch_tag=lambda: self._readers.batch_tag() if self._readers is not None else None,
            )
            if self.config.metrics is not None:
                from fluidps.executor.metrics.job_metrics import TrainerMetrics

                self.config.metrics.watch("trainer", TrainerMetrics(self._trainer))
        return self._trainer

    @property
    def pserver(self) -> PserverHost:
        if self._pserver is None:
            from fluidps.executor.ps.host import PserverHost  # loads ZeroMQ

            self._pserver = PserverHost(
                self.settings, self.config.checkpoints, self.context_for, self._runner_for, self.profile
            )
            if self.config.metrics is not None:
                from fluidps.executor.metrics.job_metrics import PserverMetrics

                self._pserver.ticks.append(self.config.metrics.watch("pservers", PserverMetrics()).tick)
        return self._pserver

    @property
    def stages(self) -> StageChannel:
        """This process's channel to the other stages of a pipeline (send_v2 / recv_v2)."""
        if self._stages is None:
            raise ExecutionError(
                "send_v2 / recv_v2 exchange values between pipeline stages: run the program they are in as "
                "a stage of a pipeline (an Executor runs a PipelineOptimizer's program through its stages; "
                "fluidps.PipelineTranspiler cuts one)"
            )
        return self._stages

    def attach_stages(self, channel: StageChannel) -> None:
        """Run pipeline stages' programs here, exchanging values through `channel`."""
        self._stages = channel

    @property
    def readers(self) -> Readers:
        if self._readers is None:
            from fluidps.executor.tasks.task_reader import Readers

            self._readers = Readers(
                self.config.coordinator, self._coordinator_source, self._idle_trainer, self._deliver_sends
            )
        return self._readers

    @property
    def has_trainer(self) -> bool:
        return self._trainer is not None

    @property
    def has_readers(self) -> bool:
        return self._readers is not None

    @property
    def pserver_loops(self) -> list[Any]:
        """The pserver loops this process ran (ended ones too, for their stats)."""
        return list(self._pserver.loops) if self._pserver is not None else []

    def context_for(self, endpoint: str) -> zmq.Context:
        """The ZeroMQ context to open a socket for `endpoint` on: the shared one when the
        config names one, else this runtime's own. inproc:// addresses reach only sockets
        of the same context, so without a shared one they cannot reach another participant."""
        if self.config.context is not None:
            return self.config.context
        if endpoint.startswith("inproc://"):
            raise TransportError(
                f"{endpoint}: inproc:// endpoints reach only sockets of the same ZeroMQ context; give every "
                "Executor of this process the same RuntimeConfig(context=zmq.Context())"
            )
        if self._context is None:
            import zmq

            self._context = zmq.Context(io_threads=2)
        return self._context

    def _runner_for(self, block: Block) -> BlockRunner:
        return BlockRunner(block, self, compute="optimize", compiler=self._optimize_compiler)  # a pserver's

    def _idle_trainer(self) -> bool:
        """A reader has no task for now: a sync trainer takes part in a round without
        gradients (whether another trainer trained meanwhile says to ask again at once),
        any other pauses."""
        trainer = self._trainer
        if trainer is None:  # a reader without pservers has nobody to tell
            return False
        if trainer.in_lockstep:
            return trainer.idle_round()
        trainer.pause()
        return False

    def _deliver_sends(self) -> Delivered:
        """Wait until the pservers acknowledged every gradient this trainer computed
        (TrainerClient.deliver_all)."""
        if self._trainer is not None:
            return self._trainer.deliver_all()
        from fluidps.executor.ps.applied_batches import Delivered  # (local training loads no ps room)

        return Delivered()

    def _coordinator_source(self, address: str, request: dict[str, Any]) -> TaskSource | WindowSource:
        """A reader's tasks from the coordinator: a dataset's, or a stream's windows."""
        from fluidps.executor.tasks.coordinator_client import (
            CoordinatorClient,
            CoordinatorSource,
            CoordinatorWindows,
        )

        trainer_id = self._trainer.trainer_id if self._trainer is not None else 0
        client = CoordinatorClient(self.context_for(address), address, self.settings, trainer_id, self.sender)
        return (
            CoordinatorWindows(client, request) if "stream" in request else CoordinatorSource(client, request)
        )

    # -- ending --------------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Tell every pserver this trainer is done, report the readers' last tasks, close
        the sockets. Returns the problems met (a pserver already gone), which must not
        hide the caller's own.

        In an elastic job a trainer leaving before its reader saw the end of the data
        (it failed) says it pauses instead: the pservers go on without it, and a
        restarted process takes its place."""
        leaving = self.settings.elastic and self._readers is not None and self._readers.reading
        problems = []
        if self._trainer is not None:
            problems += self._trainer.flush()
        if self._readers is not None:
            problems += self._readers.close()
            self._readers = None
        if self._trainer is not None:
            problems += self._trainer.close(leaving)
            self._trainer = None
        if self._context is not None:
            self._context.term()
            self._context = None
        return problems
