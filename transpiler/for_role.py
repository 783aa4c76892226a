"""One process's programs of a job: the job transpiled, and this process's part picked.

Every process of a parameter-server job runs the same script: it builds the model,
transpiles it for the whole job (every process gets the same plan), and runs its own
part of it: a pserver the main and startup programs of its endpoint, a trainer the
trainer's. `transpile_for_role` is that step, given the process's role, which
`fluidps.role_from_env` reads from the environment `fluidps launch` (or a Kubernetes
manifest) sets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from fluidps.errors import BuilderError, UnsupportedError
from fluidps.ir.devices import StageEndpoints
from fluidps.ir.program import Program
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.distribute import DistributeTranspiler
from fluidps.transpiler.pipeline import PipelineTranspiler, check_shared_seeds, stage_startup
from fluidps.transpiler.pipeline_plan import PipelinePlan
from fluidps.transpiler.pipeline_replicas import stage_on_pservers
from fluidps.transpiler.plan import DistributedPlan


class ProcessRole(Protocol):
    """What `transpile_for_role` reads of a process's role (fluidps.RoleInfo is one)."""

    @property
    def is_pserver(self) -> bool: ...

    @property
    def trainer_id(self) -> int: ...

    @property
    def trainers(self) -> int: ...

    @property
    def pserver_endpoints(self) -> Sequence[str]: ...

    @property
    def current_endpoint(self) -> str | None: ...

    @property
    def mode(self) -> str: ...

    @property
    def stage(self) -> int | None: ...

    @property
    def stage_endpoints(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class RolePrograms:
    """The programs of one process of a job: run `startup` once, then `main` (a pserver's
    main serves until every trainer is done; a trainer's trains one step a call). They are
    copies, the process's own. `plan` is the whole job's: where each slice lives, and the
    other processes' programs."""

    main: Program
    startup: Program
    plan: DistributedPlan | PipelinePlan


def transpile_for_role(
    role: ProcessRole,
    program: Program,
    startup_program: Program,
    config: DistributeTranspilerConfig | None = None,
) -> RolePrograms:
    """Transpile `program` (with its optimizer ops) and `startup_program` for the job
    `role` belongs to, and return the programs this process runs: pserver
    `role.current_endpoint`'s, or trainer `role.trainer_id`'s.

    A pipeline stage's process (`role.stage`, from `fluidps launch --stages`) gets its
    stage's section program (PipelineTranspiler's) bound to its stage and the other
    stages' endpoints, which Executor.run trains as that stage, talking to the other
    stages' processes; its part of the startup program (what the stage holds); and the
    whole pipeline's plan. With pservers (`role.pserver_endpoints`), its parameters live
    there: the section sends its gradients summed over the step's micro-batches and
    receives the parameters, and a pserver with `role.stage` gets stage `role.stage`'s
    pserver programs, whose trainers are the replicas' processes of that stage.

    `config` says how to transpile (default: DistributeTranspilerConfig(mode=role.mode));
    its mode must be the role's, which the launcher gives every process of the job.
    The input programs are not changed. Raises BuilderError when the modes differ or the
    pserver's endpoint is not one of the job's.

        role = fluidps.role_from_env()
        mine = fluidps.transpile_for_role(role, main, startup)
        exe = fluidps.Executor()
        exe.run(mine.startup)
        if role.is_pserver:
            exe.run(mine.main)  # serves until every trainer is done
        else:
            for batch in batches:
                exe.run(mine.main, feed=batch, fetch_list=[loss])
    """
    if config is None:
        config = DistributeTranspilerConfig(mode=role.mode)
    elif config.mode != role.mode:
        raise BuilderError(
            f"the config's mode is {config.mode!r} but the role's is {role.mode!r} (FLUIDPS_MODE): every "
            f"process of a job must transpile for the job's mode; pass a config with mode={role.mode!r}"
        )
    if role.stage is not None:
        return _stage_programs(role, program, startup_program, config)
    transpiler = DistributeTranspiler(config)
    plan = transpiler.transpile(
        role.trainer_id,
        program,
        pservers=role.pserver_endpoints,
        trainers=role.trainers,
        startup_program=startup_program,
    )
    if role.is_pserver:
        if role.current_endpoint is None:
            raise BuilderError("a pserver's role needs its own endpoint (current_endpoint)")
        main, startup = transpiler.get_pserver_programs(role.current_endpoint)
        return RolePrograms(main, startup, plan)
    return RolePrograms(transpiler.get_trainer_program(), transpiler.get_trainer_startup_program(), plan)


def _stage_programs(
    role: ProcessRole, program: Program, startup_program: Program, config: DistributeTranspilerConfig
) -> RolePrograms:
    if program.pipeline is None:
        raise BuilderError(
            f"this process is pipeline stage {role.stage} (FLUIDPS_STAGE) but the program has no pipeline: "
            "minimize its loss with fluidps.optimizer.PipelineOptimizer, or launch it without --stages"
        )
    plan = PipelineTranspiler().transpile(program, replace(program.pipeline, this_stage=None))
    if not 0 <= role.stage < plan.num_stages:
        raise BuilderError(
            f"the program has stages 0..{plan.num_stages - 1}, not {role.stage} (FLUIDPS_STAGE)"
        )
    check_shared_seeds(startup_program, plan)
    if role.stage < plan.num_stages - 1 and not plan.receives(role.stage, "backward"):
        # (a client keeps a RemoteExecutor's stages in step; launched, only their messages do)
        raise UnsupportedError(
            f"stage {role.stage} gets no gradient back from the stages after it (it trains nothing): launched, "
            "it would run ahead of them without bound; place its ops on the next stage"
        )
    if role.is_pserver or role.pserver_endpoints:  # the stage's parameters live on pservers
        return _stage_on_pservers(role, plan, startup_program, config)
    if role.trainers > 1:
        raise BuilderError(
            f"{role.trainers} replicas of a pipeline (PADDLE_TRAINERS_NUM) keep their stages' parameters in step "
            "through pservers: launch with --pservers too"
        )
    section = plan.stages[role.stage].program.clone()  # its own ops, sends and receives
    section.pipeline = replace(plan.config, this_stage=_this_stage(role, plan))
    return RolePrograms(section, stage_startup(startup_program, plan, role.stage), plan)


def _stage_on_pservers(
    role: ProcessRole, plan: PipelinePlan, startup_program: Program, config: DistributeTranspilerConfig
) -> RolePrograms:
    pservers = stage_on_pservers(
        plan, role.stage, role.trainer_id, role.trainers, role.pserver_endpoints, startup_program, config
    )
    if role.is_pserver:
        if role.current_endpoint is None:
            raise BuilderError("a pserver's role needs its own endpoint (current_endpoint)")
        return RolePrograms(*pservers.get_pserver_programs(role.current_endpoint), plan)
    trainer = pservers.get_trainer_program()
    trainer.pipeline = replace(plan.config, this_stage=_this_stage(role, plan))
    return RolePrograms(trainer, pservers.get_trainer_startup_program(), plan)


def _this_stage(role: ProcessRole, plan: PipelinePlan) -> StageEndpoints:
    this = StageEndpoints(role.stage, tuple(role.stage_endpoints))
    if plan.num_stages != len(this.endpoints):
        raise BuilderError(
            f"the program has {plan.num_stages} pipeline stages but {len(this.endpoints)} stage processes were "
            f"started (FLUIDPS_STAGE_ENDPOINTS): launch it with --stages {plan.num_stages}"
        )
    return this
