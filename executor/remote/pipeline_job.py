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

import numpy as np

from fluidps.endpoints import free_endpoints
from fluidps.errors import BuilderError, Error, ExecutionError, UnsupportedError
from fluidps.executor.env import new_incarnation
from fluidps.executor.pipeline.stage import check_feed
from fluidps.executor.remote.cluster import Cluster
from fluidps.executor.remote.executor_server import STAGE
from fluidps.executor.remote.job import JobDesc
from fluidps.executor.scope import Scope
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ir.program import Program
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.pipeline import PipelineTranspiler, stage_startup
from fluidps.transpiler.pipeline_replicas import stage_on_pservers


class PipelineJob:
    @classmethod
    def deploy(
        cls, cluster: Cluster, program: Program, startup: Program | None, values: Scope, job: JobDesc
    ) -> PipelineJob:
        """Start the stages of `program` on `cluster` from `startup` and the client's `values`:
        `job.trainers` replicas of them, whose stages' parameters then live on the job's
        pservers when there are several."""
        if startup is None:
            raise ExecutionError(
                "run the startup program before training (exe.run(startup_program)): the stages "
                "initialize their parameters from it"
            )
        return cls(cluster, program, startup, values, job.trainers, job.transpiler_config(), job.host)

    def __init__(
        self,
        cluster: Cluster,
        program: Program,
        startup: Program,
        values: Scope,
        replicas: int = 1,
        config: DistributeTranspilerConfig | None = None,
        host: str = "127.0.0.1",
    ):
        self.program = program
        self.plan = PipelineTranspiler().transpile(program)
        self._cluster = cluster
        p = self.plan.num_stages
        servers = [node.client for node in cluster.start_stages(p * replicas)]
        self.replicas = [servers[r * p : (r + 1) * p] for r in range(replicas)]  # [replica][stage]
        self.stages = self.replicas[0]  # (what exe.scope reads: the replicas hold the same values)
        self.steps = 0
        # Replicas speak to their stages' pservers as trainers: each with an incarnation of its
        # own, known to the pservers before it speaks (fluidps.executor.ps.membership), and set
        # before anything else here.
        self._incarnations = [[new_incarnation() for _ in range(p)] for _ in range(replicas)]
        if replicas > 1:
            for replica, incarnations in zip(self.replicas, self._incarnations, strict=True):
                calls = {c: _configure("incarnation", i) for c, i in zip(replica, incarnations, strict=True)}
                cluster.call_all(calls)
        for replica in self.replicas:
            self._configure(replica)
        if replicas == 1:
            for stage, client in zip(self.plan.stages, self.stages, strict=True):
                mine = self.plan.holds(stage.stage)
                client.call(_load("startup", stage_startup(startup, self.plan, stage.stage)))
                client.call(Message(Kind.RUN, text="startup"))
                client.call(_load(STAGE, stage.program))
                # The job starts from the client's values (its startup's, or what it loaded).
                tensors = {n: values.find(n) for n in sorted(mine) if values.find(n) is not None}
                if tensors:
                    client.call(Message(Kind.SET, tensors=tensors))
        else:
            self._on_pservers(startup, values, config or DistributeTranspilerConfig(), host)

    def _configure(self, replica: list[RpcClient]) -> None:
        """Tell each stage server of one replica which stage it is and where the others are."""
        config = self.plan.config
        endpoints = ",".join(client.endpoint for client in replica)
        for k, client in enumerate(replica):
            settings = {
                "stage": k,
                "num_stages": config.num_stages,
                "num_microbatches": config.num_microbatches,
                "schedule_mode": config.schedule_mode,
                "endpoints": endpoints,
            }
            client.call(_configure("pipeline", json.dumps(settings)))

    def _on_pservers(
        self, startup: Program, values: Scope, config: DistributeTranspilerConfig, host: str
    ) -> None:
        """Each stage's parameters on pservers of its own (pserver j serves stage j mod p), in a
        sync job whose trainers are the replicas' servers of that stage; the pservers start
        from the client's values."""
        p, n = self.plan.num_stages, len(self.replicas)
        pservers = [node.client for node in self._cluster.role("pserver")]
        if len(pservers) < p:
            raise BuilderError(
                f"JobDesc(pservers={len(pservers)}) for {n} replicas of a pipeline of {p} stages: each stage "
                f"keeps its parameters on pservers of its own; ask for at least {p}"
            )
        loops = self._cluster.pserver_endpoints or free_endpoints(host, len(pservers))
        incarnations = self._incarnations
        for k in range(p):
            mine = [j for j in range(len(pservers)) if j % p == k]
            jobs = [
                stage_on_pservers(self.plan, k, r, n, [loops[j] for j in mine], startup, config)
                for r in range(n)
            ]
            plan = jobs[0].plan
            for j in mine:
                server, loop = pservers[j], loops[j]
                server.call(
                    _configure("trainer_incarnations", ",".join(incarnations[r][k] for r in range(n)))
                )
                server.call(_load("startup", plan.pserver_startups[loop]))
                server.call(Message(Kind.RUN, text="startup"))
                held = {}  # the client's values, cut as this pserver holds them
                for place in (pl for pl in plan.placements if pl.endpoint == loop):
                    value = values.find(place.var)
                    if value is not None:
                        whole = place.offset is None
                        held[place.remote] = (
                            value if whole else value[place.offset : place.offset + place.rows]
                        )
                if held:
                    server.call(
                        Message(Kind.SET, tensors={k2: np.ascontiguousarray(v) for k2, v in held.items()})
                    )
                server.call(_load("pserver", plan.pserver_programs[loop]))
                server.call(Message(Kind.START, text="pserver"))
            for r, job in enumerate(jobs):
                client = self.replicas[r][k]
                client.call(_load("startup", job.plan.trainer_startup))
                client.call(Message(Kind.RUN, text="startup"))  # (the parameters, from the pservers)
                client.call(_load(STAGE, job.plan.trainer_program))

    def step(self, feed: Mapping[str, Any], fetch_names: Sequence[str]) -> list[Any]:
        n, m = len(self.replicas), self.plan.config.num_microbatches
        check_feed(feed, n * m)  # (here, before any stage is sent a step)
        owner = {name: self._owner(name) for name in fetch_names}  # (each checked here)
        requests = {}
        for r, replica in enumerate(self.replicas):
            for k, client in enumerate(replica):
                stage = self.plan.stages[k]
                missing = [name for name in stage.feeds if name not in feed]
                if missing:
                    raise ExecutionError(f"stage {k} reads {', '.join(missing)}: add it to feed")
                tensors = {name: _share(feed[name], r, n) for name in stage.feeds}
                names = [name for name in fetch_names if owner[name] == k]
                message = Message(Kind.RUN, text=STAGE, tensors=tensors, names=names)
                requests[client] = (client, client.request(message))
        try:
            replies = self._cluster.wait_all(requests)
        except Error as e:
            raise ExecutionError(f"the pipeline failed at step {self.steps + 1}: {e}") from None
        self.steps += 1
        return [
            self._joined(name, [replies[replica[owner[name]]].tensors[name] for replica in self.replicas])
            for name in fetch_names
        ]

    def _joined(self, name: str, parts: list[Any]) -> Any:
        """A fetched value of the whole batch from the replicas' values: per-example values
        joined, a mean averaged, anything else (a parameter) as replica 0 holds it."""
        if len(parts) == 1:
            return parts[0]
        stage = self.plan.stages[self._owner(name)]
        block = stage.forward.global_block()
        var = block.find_var(name)
        if name in stage.made and var is not None and var.shape and var.shape[0] == -1:
            return np.concatenate([np.asarray(v) for v in parts])
        maker = next((op.type for op in block.ops if name in op.output_arg_names), None)
        if maker in ("mean", "reduce_mean"):
            return np.mean(np.stack([np.asarray(v) for v in parts]), axis=0).astype(
                np.asarray(parts[0]).dtype
            )
        return parts[0]

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
        if len(self.replicas) > 1:
            raise UnsupportedError(
                "the replicas' parameters live on their stages' pservers, which would overwrite what is set "
                "here at the next step: set values in exe.scope before the first step"
            )
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


def _share(value: Any, replica: int, replicas: int) -> Any:
    """Replica `replica`'s rows of a fed batch (each replica an equal share)."""
    if replicas == 1:
        return value
    rows = np.shape(value)[0] // replicas
    return value[replica * rows : (replica + 1) * rows]


def _configure(name: str, value: str) -> Message:
    return Message(Kind.CONFIGURE, text=json.dumps({name: value}))


def _load(name: str, program: Program) -> Message:
    return Message(Kind.LOAD, text=name, blobs=[program.serialize_to_string()])
