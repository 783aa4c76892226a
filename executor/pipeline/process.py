"""One stage of a pipeline in a process of its own, the Fluid way: `fluidps launch
--stages P script.py` runs the same script in P processes, and each trains its stage.

`fluidps.transpile_for_role` gives such a process its stage's section program with its
stage and every stage's endpoint recorded (PipelineConfig.this_stage), and its part of
the startup program; `Executor.run` of that program comes here. A StageProcess serves its
endpoint on a thread of its own (HELLO, and its peers' STAGE_SEND values, which its
RemoteStageChannel keeps), and runs the stage's schedule on each fed mini-batch with
the Executor's own kernels. No client drives the stages: each steps when its script
calls run, so a peer may send the next step's values early (the channel keeps them
for that step) and waits for this stage's, never past the peer timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fluidps.errors import Error, ExecutionError
from fluidps.executor.pipeline.channel import RemoteStageChannel
from fluidps.executor.pipeline.stage import RunProgram, StageRunner, check_feed
from fluidps.executor.transport.rpc import RpcServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind
from fluidps.ir.devices import PipelineConfig
from fluidps.transpiler.pipeline_plan import MERGED_SUFFIX, StagePlan

POLL_S = 0.1  # how often the serving thread looks whether it should stop
# What a closing stage gives its last answers to leave: every value a peer sent it in its
# last step was taken (the step needed it), but the answer saying so may still be queued.
LINGER_S = 2.0


class StageServer:
    """Answers the other stages at this stage's endpoint, on a thread of its own: a
    HELLO (a peer waiting for a value asks whether this stage is alive), and the values
    they send (into `channel`, which checks them). Anything else is refused by name."""

    def __init__(self, context: Any, endpoint: str, channel: RemoteStageChannel, settings: RpcSettings):
        self.name = f"stage {channel.stage}"
        self._server = RpcServer(context, endpoint, self.name, settings)
        self._channel = channel
        self._running = True
        self.failure: str | None = None  # why the serving thread stopped, if not told to
        self._thread = threading.Thread(target=self._serve, name=f"{self.name} server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self._running:
                for request in self._server.receive(POLL_S):
                    msg = request.msg
                    try:
                        if msg.kind == Kind.HELLO:
                            self._server.reply(request)
                        elif msg.kind == Kind.STAGE_SEND:
                            self._channel.deliver(msg)
                            self._server.reply(request)
                        else:
                            raise Error(f"takes HELLO and STAGE_SEND messages, not {msg.kind_name}")
                    except Error as e:
                        self._server.error(request, str(e))  # (the peer's error names this stage)
        except Exception as e:  # (a socket failing under it): a waiting step, or the next, says so
            self.failure = f"its server stopped: {type(e).__name__}: {e}"
            self._channel.stop_hearing(self.failure)
        finally:
            self._server.close(linger_s=LINGER_S)

    def close(self, timeout: float) -> None:
        self._running = False
        self._thread.join(timeout)


class StageProcess:
    """Stage `plan.stage` of a pipeline, run with `run` (an Executor's, whose runtime has
    `channel` attached) and served by `server` at its endpoint."""

    def __init__(
        self,
        plan: StagePlan,
        config: PipelineConfig,
        run: RunProgram,
        channel: RemoteStageChannel,
        server: StageServer,
    ):
        self.plan = plan
        self.runner = StageRunner(plan, config, run, channel)
        self._channel = channel
        self._server = server
        block = plan.program.global_block()
        self._holds = {n for n, v in block.vars.items() if v.persistable and not n.endswith(MERGED_SUFFIX)}
        self._broken: str | None = None  # what failed a step: no later step can run

    @property
    def steps(self) -> int:
        return self._channel.step

    def step(self, scope: Any, feed: Mapping[str, Any], fetch_names: Sequence[str]) -> list[Any]:
        """One step of this stage on the fed mini-batch (every stage's script feeds the
        same one; each reads its own columns). Fetches are what this stage makes or holds."""
        k, plan = self.plan.stage, self.plan
        if self._broken is not None:
            raise ExecutionError(
                f"stage {k} failed at step {self.steps + 1} ({self._broken}); its peers are past it or gone: "
                "start the job again (from a checkpoint)"
            )
        if self._server.failure is not None:
            raise ExecutionError(f"stage {k} stopped serving its peers: {self._server.failure}")
        check_feed(feed, self.runner.config.num_microbatches)
        for name in fetch_names:
            if name not in plan.made and name not in self._holds:
                raise ExecutionError(
                    f"stage {k} neither makes nor holds {name!r}: fetch it in the process of the stage that does "
                    "(transpile_for_role(...).plan.owner(name) says which)"
                )
        missing = [n for n in plan.feeds if n not in feed]
        if missing:
            raise ExecutionError(f"stage {k} reads {', '.join(missing)}: add it to feed")
        try:
            made = self.runner.step(
                scope, {n: feed[n] for n in plan.feeds}, [n for n in fetch_names if n in plan.made]
            )
            self._channel.flush()  # every value it sent was taken: the step is done here
        except Exception as e:  # (half a step ran: its values are spent, the next cannot follow)
            self._broken = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise
        self._channel.next_step()
        return [made[n] if n in made else np.array(scope.find(n), copy=True) for n in fetch_names]

    def stats(self) -> dict[str, Any]:
        return {**self.runner.stats(), "steps": self.steps}

    def close(self, timeout: float) -> None:
        self._server.close(timeout)
        self._channel.close()
