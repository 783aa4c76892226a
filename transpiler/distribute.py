"""DistributeTranspiler: one training program in, a parameter-server job out.

    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(mode="sync"))
    plan = t.transpile(trainer_id=0, program=main, pservers="10.0.0.1:6174,10.0.0.2:6174",
                       trainers=2, startup_program=startup)
    trainer_main = t.get_trainer_program()
    pserver_main, pserver_startup = t.get_pserver_programs("10.0.0.1:6174")

Unlike Fluid's transpiler, the input programs are never modified: everything
is built from copies into one immutable DistributedPlan, and the getters
hand out copies of the plan's programs. The same input gives byte-identical
output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from fluidps.endpoints import parse_endpoints
from fluidps.errors import BuilderError
from fluidps.ir.program import Program
from fluidps.ir.types import VarType, to_numpy_dtype
from fluidps.ops import verify
from fluidps.transpiler.analysis import ProgramRoles, analyze
from fluidps.transpiler.config import DistributeTranspilerConfig
from fluidps.transpiler.plan import DistributedPlan, Slice
from fluidps.transpiler.pserver_cost import balance, block_load
from fluidps.transpiler.pserver_program import build_pserver_programs
from fluidps.transpiler.slicing import dispatch, row_blocks
from fluidps.transpiler.tables import DistributedTable, find_distributed_tables
from fluidps.transpiler.trainer_program import build_trainer_program, build_trainer_startup


def plan_slices(
    program: Program,
    roles: ProgramRoles,
    endpoints: tuple[str, ...],
    config: DistributeTranspilerConfig,
    tables: Mapping[str, DistributedTable] | None = None,
) -> list[Slice]:
    """Cut each optimized parameter into row blocks and place every block. A
    distributed table (in `tables`) is cut into one block per pserver whatever
    min_block_size and slice_var_up say, block k on pserver k: spreading its
    rows is what it is for. A hashed table gets one shard per pserver, shard k on
    pserver k, each of shape [-1, dim]."""
    tables = tables or {}
    block = program.global_block()
    pending = []
    for update in roles.updates:
        param = block.var(update.param)
        hashed = update.param in tables and tables[update.param].hashed
        if hashed:
            blocks = [(0, -1)] * len(endpoints)
        elif update.param in tables:
            blocks = row_blocks(param.shape, len(endpoints), 1, True)
        else:
            blocks = row_blocks(param.shape, len(endpoints), config.min_block_size, config.slice_var_up)
        sparse = block.var(update.grad).type == VarType.SELECTED_ROWS
        for k, (offset, rows) in enumerate(blocks):
            whole = len(blocks) == 1
            name = update.param if whole else f"{update.param}.block{k}"
            grad = update.grad if whole else f"{update.grad}.block{k}"
            shape = (rows, *param.shape[1:])
            nbytes = 0 if hashed else math.prod(shape) * to_numpy_dtype(param.dtype).itemsize
            load = block_load(block, update, rows, nbytes)
            pending.append((update.param, name, grad, k, offset, shape, param.dtype, sparse, load))
    fixed = [endpoints[p[3]] if p[0] in tables else None for p in pending]  # a table's block k: pserver k
    if config.split_method == "Cost":
        placed = balance([p[8] for p in pending], endpoints, fixed)
    else:
        placed = dispatch([p[1] for p in pending], endpoints, config.split_method)
        placed = [f or ep for f, ep in zip(fixed, placed, strict=True)]
    return [
        Slice(p, n, g, k, o, s, d, ep, sp, p in tables, p in tables and tables[p].hashed, load)
        for (p, n, g, k, o, s, d, sp, load), ep in zip(pending, placed, strict=True)
    ]


class DistributeTranspiler:
    """Fluid's DistributeTranspiler API over an immutable plan."""

    def __init__(self, config: DistributeTranspilerConfig | None = None):
        self.config = config or DistributeTranspilerConfig()
        self._plan: DistributedPlan | None = None

    def transpile(
        self,
        trainer_id: int,
        program: Program | None = None,
        pservers: str | Sequence[str] = "127.0.0.1:6174",
        trainers: int = 1,
        sync_mode: bool = True,
        startup_program: Program | None = None,
        current_endpoint: str = "",
    ) -> DistributedPlan:
        """Split `program` (which must already contain its optimizer ops) for a job
        of `trainers` trainers and the given pservers. `sync_mode=False` with a
        sync config means async, as in Fluid. Returns the plan (also kept for the getters)."""
        if not isinstance(program, Program) or not isinstance(startup_program, Program):
            raise BuilderError(
                "transpile needs program= and startup_program= (fluidps has no default programs; "
                "pservers initialize their slices from the startup program)"
            )
        if trainers < 1 or not 0 <= trainer_id < trainers:
            raise BuilderError(f"trainer_id {trainer_id} must be in [0, trainers={trainers})")
        config = self.config
        if not sync_mode and config.mode == "sync":
            config = dataclasses.replace(config, mode="async")
        endpoints = parse_endpoints(pservers)
        verify(program)
        verify(startup_program)
        roles = analyze(program)
        tables = find_distributed_tables(program, roles, config)
        slices = plan_slices(program, roles, endpoints, config, tables)
        trainer = build_trainer_program(program, roles, slices, config, trainer_id, endpoints, tables)
        trainer_startup = build_trainer_startup(
            startup_program, trainer, roles, slices, config, trainer_id, endpoints
        )
        mains, startups, placements = {}, {}, []
        for i, ep in enumerate(endpoints):
            mains[ep], startups[ep], held = build_pserver_programs(
                program, startup_program, roles, slices, ep, i, config, trainers
            )
            placements += held
        notes = []
        if roles.trainer_optimize_ops:
            notes.append(
                f"{len(roles.trainer_optimize_ops)} optimize op(s) of global-norm clipping combine several "
                "parameters' gradients; they run on the trainers, before the gradients are sent"
            )
        plan = DistributedPlan(
            config,
            trainer_id,
            trainers,
            endpoints,
            trainer,
            trainer_startup,
            mains,
            startups,
            tuple(slices),
            tuple(notes),
            tuple(placements),
        )
        for produced in (trainer, trainer_startup, *mains.values(), *startups.values()):
            verify(produced)
        self._plan = plan
        return plan

    # -- Fluid's getters, reading the plan ------------------------------------------------

    @property
    def plan(self) -> DistributedPlan:
        if self._plan is None:
            raise BuilderError("call transpile(...) first")
        return self._plan

    def get_trainer_program(self, wait_port: bool = True) -> Program:
        return self.plan.trainer_program.clone()

    def get_trainer_startup_program(self) -> Program:
        return self.plan.trainer_startup.clone()

    def get_pserver_program(self, endpoint: str) -> Program:
        return self._pserver(endpoint, self.plan.pserver_programs)

    def get_startup_program(
        self, endpoint: str | None = None, pserver_program: Program | None = None
    ) -> Program:
        """The pserver `endpoint`'s startup program (the trainer's when endpoint is None)."""
        if endpoint is None:
            return self.get_trainer_startup_program()
        return self._pserver(endpoint, self.plan.pserver_startups)

    def get_pserver_programs(self, endpoint: str) -> tuple[Program, Program]:
        return self.get_pserver_program(endpoint), self.get_startup_program(endpoint)

    def _pserver(self, endpoint: str, programs) -> Program:
        if endpoint not in programs:
            raise BuilderError(
                f"{endpoint!r} is not a pserver of this job; they are {', '.join(self.plan.endpoints)}"
            )
        return programs[endpoint].clone()
