"""PipelineTranspiler: one training program in, one program per pipeline stage out.

    plan = fluidps.PipelineTranspiler().transpile(main)   # main: PipelineOptimizer's
    print(plan.summary())
    section = plan.stages[0].program

Each stage's section program holds the ops fluidps.ir.stages places on it, in
their order, and what makes the stages one model:

- where a value crosses stages, a send_v2 on the stage that makes it and a
  recv_v2 on the one that reads it: activations going forward, their gradients
  coming back (a gradient read on several stages is summed where its variable
  is made, from the parts the others send), and a parameter read on several
  stages going from the stage that updates it to the others once a step;
- the loss gradient's seed is 1 / m: the m micro-batches' gradients add up to
  the mini-batch's;
- each parameter's gradient is added into `<grad>@MERGED` after each
  micro-batch's backward; the update ops read that, once a mini-batch. Whatever
  runs the stage zeroes the sums at each step's start (StagePlan.accumulators:
  fluidps.executor.pipeline's StageRunner), so that a failed step leaves nothing
  half summed and a stage whose parameters live on pservers needs no update of
  its own to zero them.

The input program is never changed; the plan holds copies.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fluidps.errors import BuilderError, UnsupportedError
from fluidps.ir.devices import PipelineConfig
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.stages import EVERY_STAGE, StageMap, assign_stages, phase
from fluidps.ir.types import EMPTY_VAR_NAME, OP_ROLE_ATTR, OpRole, VarType, to_numpy_dtype
from fluidps.ops import REGISTRY, verify
from fluidps.transpiler.analysis import ParamUpdate, analyze
from fluidps.transpiler.pipeline_plan import MERGED_SUFFIX, Crossing, PipelinePlan, StagePlan, dtype_size

_ROLE = {"forward": OpRole.Forward, "backward": OpRole.Backward, "optimize": OpRole.Optimize}


class PipelineTranspiler:
    """A pass: `transpile(program)` returns a PipelinePlan and never changes `program`."""

    def transpile(self, program: Program, config: PipelineConfig | None = None) -> PipelinePlan:
        config = config or program.pipeline
        if config is None:
            raise UnsupportedError(
                "PipelineTranspiler: the program has no pipeline configuration: minimize its loss with "
                "fluidps.optimizer.PipelineOptimizer, or pass a fluidps.ir.devices.PipelineConfig"
            )
        stages = assign_stages(program, config.num_stages)
        roles = analyze(program)
        block = program.global_block()
        owners = {u.param: stages.owner(u.param) for u in roles.updates}
        for u in roles.updates:
            grad = block.find_var(u.grad)
            if grad is not None and grad.type == VarType.SELECTED_ROWS:
                raise UnsupportedError(
                    f"parameter {u.param!r} has a sparse gradient ({u.grad}): a pipeline accumulates dense "
                    "gradients; build its embedding with is_sparse=False"
                )
        crossings = _crossings(block, stages)
        crossings += _shared_parameters(block, stages, owners)
        plans = tuple(
            _stage_plan(program, stages, s, crossings, roles.updates, owners, config)
            for s in range(stages.num_stages)
        )
        placement = tuple((op.type, stage) for op, stage in zip(block.ops, stages.op_stages, strict=True))
        return PipelinePlan(config, plans, tuple(crossings), placement)


def _names(names: Iterable[str]) -> list[str]:
    return [n for n in names if n != EMPTY_VAR_NAME]


def _crossings(block: Block, stages: StageMap) -> list[Crossing]:
    """Every (variable, from stage, to stage) a micro-batch sends, in program order."""
    persistable = {n for n, v in block.vars.items() if v.persistable}
    made: dict[str, tuple[int, str]] = {}  # name -> (stage, phase) of the op that makes it
    out: dict[tuple[str, int], Crossing] = {}
    for op, stage in zip(block.ops, stages.op_stages, strict=True):
        kind = phase(op)
        if kind == "optimize":
            continue
        for name in _names(op.input_arg_names):
            if name in persistable or name not in made or made[name][0] == stage:
                continue
            src, src_phase = made[name]
            if (name, stage) not in out:
                var = block.var(name)
                shape = tuple(var.shape or ())
                out[(name, stage)] = Crossing(name, src, stage, src_phase, shape, dtype_size(var.dtype))
        for name in _names(op.output_arg_names):
            if name not in persistable:
                made.setdefault(name, (stage, kind))
    return list(out.values())


def _shared_parameters(block: Block, stages: StageMap, owners: dict[str, int]) -> list[Crossing]:
    """A parameter read on several stages is updated on its owner, which then hands the
    new value to the others (once a step, in the optimize phase)."""
    out = []
    for param, owner in owners.items():
        var = block.var(param)
        for reader in stages.param_readers[param]:
            if reader != owner:
                shape = tuple(var.shape or ())
                out.append(Crossing(param, owner, reader, "optimize", shape, dtype_size(var.dtype)))
    return out


def _stage_plan(
    program: Program,
    stages: StageMap,
    stage: int,
    crossings: list[Crossing],
    updates: Sequence[ParamUpdate],
    owners: dict[str, int],
    config: PipelineConfig,
) -> StagePlan:
    section = program.clone()
    section.pipeline = None  # (a stage's programs run as they are)
    block = section.global_block()
    updating = any(owner == stage for owner in owners.values())
    mine = {"forward": [], "backward": [], "optimize": []}
    for op, placed in zip(list(block.ops), stages.op_stages, strict=True):
        if placed == stage or (placed == EVERY_STAGE and updating):
            mine[phase(op)].append(op)
    m = config.num_microbatches
    for op in mine["backward"]:  # the seed of the loss gradient: 1 / m of it per micro-batch
        if op.attr(OP_ROLE_ATTR) == int(OpRole.Backward | OpRole.Loss):
            op.set_attr("value", 1.0 / m)

    def comm(kind: str, crossing: Crossing, send: bool) -> Operator:
        attrs = {"peer": crossing.dst if send else crossing.src, OP_ROLE_ATTR: int(_ROLE[kind])}
        if send:
            return REGISTRY.append_op(block, "send_v2", {"X": [crossing.var]}, {}, attrs)
        var = block.var(crossing.var)
        attrs.update(out_shape=list(var.shape or ()), dtype=int(var.dtype))
        return REGISTRY.append_op(block, "recv_v2", {}, {"Out": [crossing.var]}, attrs)

    ordered: list[Operator] = []
    for kind in ("forward", "backward"):
        ordered += [comm(kind, c, False) for c in crossings if c.dst == stage and c.phase == kind]
        ordered += mine[kind]
        if kind == "backward":
            ordered += _accumulate(block, stage, updates, owners)
        ordered += [comm(kind, c, True) for c in crossings if c.src == stage and c.phase == kind]
    ordered += [comm("optimize", c, False) for c in crossings if c.dst == stage and c.phase == "optimize"]
    ordered += _merged_updates(mine["optimize"], stage, updates, owners)
    ordered += [comm("optimize", c, True) for c in crossings if c.src == stage and c.phase == "optimize"]
    block.ops = ordered
    _drop_unused_vars(block)
    verify(section)
    return stage_plan(section, stage)


def stage_startup(startup: Program, plan: PipelinePlan, stage: int) -> Program:
    """The part of `startup` stage `stage` runs: the ops that make what the stage holds
    (a copy; `startup` is not changed). Each initializer's values depend only on its own
    seed, so a stage initializes its variables as the whole startup program would."""
    mine = plan.holds(stage)
    program = startup.clone()
    block = program.global_block()
    block.ops = [op for op in block.ops if set(op.output_arg_names) & mine]
    return program


def check_shared_seeds(startup: Program, plan: PipelinePlan) -> None:
    """BuilderError when a weight several stages hold has an initializer without a seed:
    stages that each run their part of `startup` would start from values of their own."""
    shared = {n for s in plan.stages for n in plan.holds(s.stage) if len(plan.holders(n)) > 1}
    for op in startup.global_block().ops:
        unseeded = op.has_attr("seed") and op.attr("seed") == 0
        if unseeded and (names := sorted(set(op.output_arg_names) & shared)):
            raise BuilderError(
                f"{op.type} initializes {', '.join(names)}, which several pipeline stages hold, without a seed: "
                "each stage would start from values of its own; set startup_program.random_seed before building "
                "the model (each initializer takes its seed from it then), or give the initializer a seed"
            )


def stage_plan(section: Program, stage: int) -> StagePlan:
    """What a schedule needs to know of stage `stage`'s section program (as the
    transpiler made it): its phases as programs, its parameters, the data it reads,
    what a micro-batch's forward keeps for its backward. A stage process, handed only
    its section program, learns the same from it."""
    block = section.global_block()
    forward, backward, optimize = (_phase_program(section, k) for k in ("forward", "backward", "optimize"))
    persistable = {n for n, v in block.vars.items() if v.persistable}
    fwd_block, bwd_block = forward.global_block(), backward.global_block()
    fwd_made = {n for op in fwd_block.ops for n in _names(op.output_arg_names)}
    bwd_made = {n for op in bwd_block.ops for n in _names(op.output_arg_names)}
    bwd_reads = dict.fromkeys(n for op in bwd_block.ops for n in _names(op.input_arg_names))
    stash = tuple(n for n in bwd_reads if n not in persistable and n not in bwd_made)
    fwd_reads = dict.fromkeys(n for op in fwd_block.ops for n in _names(op.input_arg_names))
    feeds = tuple(n for n in fwd_reads if n not in persistable and n not in fwd_made)
    params = tuple(
        dict.fromkeys(
            op.input("Param")[0]
            for op in optimize.global_block().ops
            if op.input("Param") and op.output("ParamOut")
        )
    )
    merged = [n for n in block.vars if n.endswith(MERGED_SUFFIX)]
    compute = [
        op
        for op in block.ops
        if op.type not in ("send_v2", "recv_v2") and not set(op.output_arg_names) & set(merged)
    ]
    return StagePlan(
        stage=stage,
        program=section,
        forward=forward,
        backward=backward,
        optimize=optimize,
        params=params,
        param_bytes=sum(_nbytes(block, p) for p in params),
        feeds=feeds,
        stash=stash,
        accumulators=tuple((n, tuple(block.var(n).shape), _np_dtype(block, n)) for n in merged),
        made=frozenset(n for n in fwd_made if n not in persistable),
        ops=len(compute),
    )


def _accumulate(
    block: Block, stage: int, updates: Sequence[ParamUpdate], owners: dict[str, int]
) -> list[Operator]:
    """After each micro-batch's backward: <grad>@MERGED += <grad>, for the parameters it owns."""
    ops = []
    for u in updates:
        if owners[u.param] != stage:
            continue
        param = block.var(u.param)
        merged = u.grad + MERGED_SUFFIX
        block.create_var(merged, shape=list(param.shape), dtype=param.dtype, persistable=True)
        role = {OP_ROLE_ATTR: int(OpRole.Backward)}
        ops.append(REGISTRY.append_op(block, "sum", {"X": [merged, u.grad]}, {"Out": [merged]}, role))
    return ops


def _merged_updates(
    optimize: list[Operator], stage: int, updates: Sequence[ParamUpdate], owners: dict[str, int]
) -> list[Operator]:
    """The update ops read the gradients summed over the micro-batches."""
    grads = [u.grad for u in updates if owners[u.param] == stage]
    for op in optimize:
        for grad in grads:
            if grad in op.input_arg_names:
                op.rename_input(grad, grad + MERGED_SUFFIX)
    return optimize


def _phase_program(section: Program, kind: str) -> Program:
    program = section.clone()
    program.pipeline = None  # (a phase runs as it is, even of a launched stage's section)
    block = program.global_block()
    block.ops = [op for op in block.ops if phase(op) == kind]
    _drop_unused_vars(block)
    return program


def _drop_unused_vars(block: Block) -> None:
    """Drop the variables of `block` no op of the program uses (sub-blocks' ops count)."""
    used = {n for b in block.program.blocks for op in b.ops for n in op.input_arg_names + op.output_arg_names}
    for name in [n for n in block.vars if n not in used]:
        block.remove_var(name)


def _nbytes(block: Block, name: str) -> int:
    var = block.var(name)
    count = 1
    for d in var.shape or ():
        count *= max(d, 1)
    return count * to_numpy_dtype(var.dtype).itemsize


def _np_dtype(block: Block, name: str) -> str:
    return str(to_numpy_dtype(block.var(name).dtype))
