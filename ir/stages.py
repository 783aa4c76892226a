"""Which pipeline stage each op of a training program runs on.

The ops a `device_guard("stage:k")` built say so in their `op_device` attribute
(Paddle's "gpu:k" too: fluidps.ir.devices). The rest take it from their
neighbours, as a person reading the program would:

- a forward op with no stage runs where the latest of its inputs is made (an op
  that reads none made on a stage, where its first reader runs; else stage 0);
- a backward op runs where its forward op does (append_backward copies the
  forward op's op_device onto its grad ops), and one autodiff made itself (the
  loss gradient's seed, the sum of a gradient's parts, a zero fill) where the
  variable whose gradient it writes is made;
- an optimizer op (op_role_var [param, grad]) runs where its parameter is owned:
  the first stage that reads it;
- learning-rate schedule ops run on every stage that updates a parameter.

Activations only go forward: an op of stage s may read what stage t <= s makes.
Everything here reads the program and never changes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from fluidps.errors import UnsupportedError
from fluidps.ir.devices import parse_device
from fluidps.ir.operator import Operator
from fluidps.ir.program import Program
from fluidps.ir.types import (
    EMPTY_VAR_NAME,
    GRAD_SUFFIX,
    OP_DEVICE_ATTR,
    OP_ROLE_ATTR,
    OP_ROLE_VAR_ATTR,
    RENAME_SUFFIX,
    AttrType,
    OpRole,
)

EVERY_STAGE = -1  # a learning-rate schedule op: it runs on every stage that updates


@dataclass(frozen=True)
class StageMap:
    """The stage of each op of block 0 (EVERY_STAGE for schedule ops), the stage
    that makes each variable ops write, and the stages that read each parameter."""

    num_stages: int
    op_stages: tuple[int, ...]
    maker: Mapping[str, int]
    param_readers: Mapping[str, tuple[int, ...]]

    def owner(self, param: str) -> int:
        """The stage that updates `param`: the first that reads it."""
        return self.param_readers[param][0]


def phase(op: Operator) -> str:
    """ "forward", "backward" or "optimize" (learning-rate schedule ops included, and the
    messages to pservers a stage whose parameters live there sends once a step)."""
    role = op.attr(OP_ROLE_ATTR) if op.has_attr(OP_ROLE_ATTR) else 0
    if role & (OpRole.Optimize | OpRole.LRSched | OpRole.RPC | OpRole.Dist):
        return "optimize"
    return "backward" if role & OpRole.Backward else "forward"


def explicit_stage(op: Operator, index: int) -> int | None:
    """The stage `op` (op #`index`) names in its op_device, or None."""
    device = op.attr(OP_DEVICE_ATTR) if op.has_attr(OP_DEVICE_ATTR) else ""
    return parse_device(device, f"op #{index} ({op.type}) op_device")


def _names(names: list[str]) -> list[str]:
    return [n for n in names if n != EMPTY_VAR_NAME]


def forward_name(grad: str) -> str:
    """x@GRAD@RENAME@block0@1 -> x; a name that is no gradient is its own."""
    base = grad.split(RENAME_SUFFIX, 1)[0]
    return base[: -len(GRAD_SUFFIX)] if base.endswith(GRAD_SUFFIX) else base


def assign_stages(program: Program, num_stages: int | None = None) -> StageMap:
    """The stage of every op of `program`'s global block (see the module's rules).
    `num_stages`: how many there must be (None: as many as the program names)."""
    block = program.global_block()
    ops = list(block.ops)
    persistable = {n for n, v in block.vars.items() if v.persistable}
    stages: list[int | None] = [None] * len(ops)
    maker: dict[str, int] = {}

    forward = [i for i, op in enumerate(ops) if phase(op) == "forward"]
    for i in forward:  # explicit, else from the latest input made on a stage
        made = [maker[n] for n in _names(ops[i].input_arg_names) if n in maker]
        stages[i] = explicit_stage(ops[i], i)
        if stages[i] is None and made:
            stages[i] = max(made)
        if stages[i] is not None:
            _record_writes(ops[i], i, stages[i], maker, persistable, ops, stages)
    for i in reversed(forward):  # what is left: where its first reader runs, else stage 0
        if stages[i] is None:
            outputs = set(_names(ops[i].output_arg_names))
            readers = [stages[j] for j in forward if j > i and outputs & set(ops[j].input_arg_names)]
            stages[i] = min((s for s in readers if s is not None), default=0)
            _record_writes(ops[i], i, stages[i], maker, persistable, ops, stages)

    param_readers: dict[str, list[int]] = {}
    for i in forward:
        for name in _names(ops[i].input_arg_names):
            if name in persistable:
                readers = param_readers.setdefault(name, [])
                if stages[i] not in readers:
                    readers.append(stages[i])
        _check_reads(ops[i], i, stages[i], maker)
    param_readers = {n: sorted(s) for n, s in param_readers.items()}

    for i, op in enumerate(ops):
        kind = phase(op)
        if kind == "backward":
            stages[i] = explicit_stage(op, i)
            if stages[i] is None:
                stages[i] = _made_where(op, i, maker, param_readers)
        elif kind == "optimize":
            stages[i] = _optimize_stage(op, i, param_readers)
        if kind != "forward":
            for name in _names(op.output_arg_names):
                if name not in persistable and stages[i] != EVERY_STAGE:
                    maker.setdefault(name, stages[i])

    count = max((s for s in stages if s is not None), default=0) + 1
    if num_stages is not None:
        if count > num_stages:
            raise UnsupportedError(
                f"the program places ops on stage {count - 1}, but the pipeline has {num_stages} stages "
                f"(0..{num_stages - 1}): raise num_stages or move those ops"
            )
        count = num_stages
    used = {s for i, s in enumerate(stages) if phase(ops[i]) == "forward"}
    for stage in range(count):
        if stage not in used:
            raise UnsupportedError(
                f"pipeline stage {stage} has no ops: every stage 0..{count - 1} needs forward ops "
                f"(device_guard('stage:{stage}') around some layers), or use fewer stages"
            )
    _check_sub_blocks(program, stages)
    return StageMap(
        count,
        tuple(s if s is not None else 0 for s in stages),
        MappingProxyType(maker),
        MappingProxyType({n: tuple(s) for n, s in param_readers.items()}),
    )


def _record_writes(
    op: Operator,
    index: int,
    stage: int,
    maker: dict[str, int],
    persistable: set[str],
    ops: list[Operator],
    stages: list[int | None],
) -> None:
    for name in _names(op.output_arg_names):
        if name in persistable:
            continue
        if name in maker and maker[name] != stage:
            first = next(
                j for j in range(index) if name in ops[j].output_arg_names and stages[j] == maker[name]
            )
            raise UnsupportedError(
                f"variable {name!r} is written on two pipeline stages: by op #{first} ({ops[first].type}) on "
                f"stage {maker[name]} and by op #{index} ({op.type}) on stage {stage}; a value has one stage: "
                "put both ops on one stage"
            )
        maker[name] = stage


def _check_reads(op: Operator, index: int, stage: int, maker: Mapping[str, int]) -> None:
    for name in _names(op.input_arg_names):
        if maker.get(name, -1) > stage:
            raise UnsupportedError(
                f"op #{index} ({op.type}) on pipeline stage {stage} reads {name!r}, which stage "
                f"{maker[name]} makes: activations only go forward through a pipeline; put the op on "
                f"stage {maker[name]} or later"
            )


def _made_where(
    op: Operator, index: int, maker: Mapping[str, int], param_readers: Mapping[str, list[int]]
) -> int:
    """Where the variable whose gradient `op` writes is made (or, for a parameter's, owned)."""
    for name in _names(op.output_arg_names):
        base = forward_name(name)
        if base in maker:
            return maker[base]
        if base in param_readers:
            return param_readers[base][0]
    made = [maker[n] for n in _names(op.input_arg_names) if n in maker]
    if made:
        return max(made)
    raise UnsupportedError(
        f"op #{index} ({op.type}): cannot tell which pipeline stage it belongs to; give it an op_device"
    )


def _optimize_stage(op: Operator, index: int, param_readers: Mapping[str, list[int]]) -> int:
    role = op.attr(OP_ROLE_ATTR)
    if role & OpRole.LRSched:
        return EVERY_STAGE
    pairs = op.attr(OP_ROLE_VAR_ATTR) if op.has_attr(OP_ROLE_VAR_ATTR) else []
    params = pairs[0::2]
    if not params:
        raise UnsupportedError(
            f"op #{index} ({op.type}) optimizes several parameters at once (global-norm clipping): a pipeline "
            "cannot cut it across stages; clip each parameter's gradient instead"
        )
    if params[0] not in param_readers:
        raise UnsupportedError(f"op #{index} ({op.type}) updates {params[0]!r}, which no forward op reads")
    return param_readers[params[0]][0]


def _check_sub_blocks(program: Program, stages: list[int | None]) -> None:
    """The ops inside a control-flow op's sub-blocks run with it: none may name another stage."""
    for i, op in enumerate(program.global_block().ops):
        for spec_name in op.attr_names:
            if op.attr_type(spec_name) not in (AttrType.BLOCK, AttrType.BLOCKS):
                continue
            value = op.attr(spec_name)
            for sub in value if isinstance(value, list) else [value]:
                index = sub if isinstance(sub, int) else sub.idx
                for j, inner in enumerate(program.block(index).ops):
                    stage = explicit_stage(inner, j)
                    if stage is not None and stage != stages[i]:
                        raise UnsupportedError(
                            f"op #{j} ({inner.type}) of block {index} is placed on stage {stage}, but block "
                            f"{index} belongs to op #{i} ({op.type}) on stage {stages[i]}: a pipeline cannot "
                            "cut inside a control-flow block; place the whole block on one stage"
                        )
