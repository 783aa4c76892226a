"""A pipeline program's stages as processes: what a RemoteExecutor does with a
PipelineOptimizer's program.

Deploying starts one executor server per stage; each gets its section program
(fluidps.PipelineTranspiler's), learns which stage it is and where the others
are, initializes only its own persistable variables (its part of the startup
program), and then takes the client's values of them, so that the job starts
where local training would. A step sends each stage the columns of the fed
mini-batch it reads and the fetches it makes; the stages run their schedules,
passing activations and gradients to each other directly, and each answers
with its fetches once its update is done.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fluidps.errors import Error, ExecutionError, UnsupportedError
from fluidps.executor.pipeline.stage import check_feed
from fluidps.executor.remote.cluster import Cluster
from fluidps.executor.remote.executor_server import STAGE
from fluidps.executor.scope import Scope
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ir.program import Program
from fluidps.transpiler.pipeline import PipelineTranspiler, stage_startup


class PipelineJob:
    @classmethod
    def deploy(
        cls, cluster: Cluster, program: Program, startup: Program | None, values: Scope, trainers: int = 1
    ) -> PipelineJob:
        """Start the stages of `program` on `cluster` from `startup` and the client's `values`
        (`trainers`: the replicas the JobDesc asks for)."""
        if startup is None:
            raise ExecutionError(
                "run the startup program before training (exe.run(startup_program)): the stages "
                "initialize their parameters from it"
            )
        if trainers > 1:
            raise UnsupportedError(
                f"JobDesc(trainers={trainers}) asks for replicas of the pipeline: a RemoteExecutor runs one "
                "(one process per stage) for now; use trainers=1"
            )
        return cls(cluster, program, startup, values)

    def __init__(self, cluster: Cluster, program: Program, startup: Program, values: Scope):
        self.program = program
        self.plan = PipelineTranspiler().transpile(program)
        self._cluster = cluster
        self.stages = [node.client for node in cluster.start_stages(self.plan.num_stages)]
        self.steps = 0
        config = self.plan.config
        endpoints = ",".join(client.endpoint for client in self.stages)
        for k, client in enumerate(self.stages):
            settings = {
                "stage": k,
                "num_stages": config.num_stages,
                "num_microbatches": config.num_microbatches,
                "schedule_mode": config.schedule_mode,
                "endpoints": endpoints,
            }
            client.call(Message(Kind.CONFIGURE, text=json.dumps({"pipeline": json.dumps(settings)})))
        for stage, client in zip(self.plan.stages, self.stages, strict=True):
            mine = self.plan.holds(stage.stage)
            client.call(_load("startup", stage_startup(startup, self.plan, stage.stage)))
            client.call(Message(Kind.RUN, text="startup"))
            client.call(_load(STAGE, stage.program))
            # The job starts from the client's values (its startup's, or what it loaded).
            tensors = {n: values.find(n) for n in sorted(mine) if values.find(n) is not None}
            if tensors:
                client.call(Message(Kind.SET, tensors=tensors))

    def step(self, feed: Mapping[str, Any], fetch_names: Sequence[str]) -> list[Any]:
        check_feed(feed, self.plan.config.num_microbatches)  # (here, before any stage is sent a step)
        owner = {name: self._owner(name) for name in fetch_names}  # (each checked here)
        requests = {}
        for k, client in enumerate(self.stages):
            stage = self.plan.stages[k]
            tensors = {n: feed[n] for n in stage.feeds if n in feed}
            missing = [n for n in stage.feeds if n not in feed]
            if missing:
                raise ExecutionError(f"stage {k} reads {', '.join(missing)}: add it to feed")
            names = [n for n in fetch_names if owner[n] == k]
            requests[client] = (
                client,
                client.request(Message(Kind.RUN, text=STAGE, tensors=tensors, names=names)),
            )
        try:
            replies = self._cluster.wait_all(requests)
        except Error as e:
            raise ExecutionError(f"the pipeline failed at step {self.steps + 1}: {e}") from None
        self.steps += 1
        return [replies[self.stages[owner[n]]].tensors[n] for n in fetch_names]

    def stats(self) -> list[dict[str, Any]]:
        """Each stage's executor server's STATUS, by stage (its `pipeline` entry: StageRunner.stats)."""
        replies = self._cluster.wait_all(
            {k: (c, c.request(Message(Kind.STATUS))) for k, c in enumerate(self.stages)}
        )
        return [json.loads(replies[k].text) for k in range(len(self.stages))]

    def gather(self, names: Sequence[str]) -> dict[str, Any]:
        """The values of `names` the stages hold, each from the first stage holding it."""
        per_stage: dict[int, list[str]] = {}
        for name in names:
            if holding := self.plan.holders(name):
                per_stage.setdefault(holding[0], []).append(name)
        pending = {
            k: (self.stages[k], self.stages[k].request(Message(Kind.GET, names=n)))
            for k, n in per_stage.items()
        }
        replies = self._cluster.wait_all(pending)
        return {n: replies[k].tensors[n] for k, held in per_stage.items() for n in held}

    def scatter(self, values: Mapping[str, Any]) -> None:
        """Write values into every stage that holds them."""
        per_stage: dict[int, dict[str, Any]] = {}
        for name, value in values.items():
            holding = self.plan.holders(name)
            if not holding:
                raise ExecutionError(f"cannot set {name!r}: no stage of the pipeline holds it")
            for k in holding:
                per_stage.setdefault(k, {})[name] = value
        self._cluster.wait_all(
            {
                k: (self.stages[k], self.stages[k].request(Message(Kind.SET, tensors=t)))
                for k, t in per_stage.items()
            }
        )

    def _owner(self, name: str) -> int:
        owner = self.plan.owner(name)
        if owner is None:
            raise ExecutionError(
                f"cannot fetch {name!r} from a pipeline: no stage's forward makes it and no stage holds it"
            )
        return owner


def _load(name: str, program: Program) -> Message:
    return Message(Kind.LOAD, text=name, blobs=[program.serialize_to_string()])
