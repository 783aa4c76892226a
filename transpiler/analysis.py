"""Which ops of a training program go where, found from op_role / op_role_var.

Optimizer ops (op_role Optimize, with an input slot Param) and the per-
parameter ops feeding them (weight decay, per-parameter learning rates:
op_role_var [param, grad]) move to the pserver that owns the parameter's
slice; learning-rate schedule ops (op_role LRSched) move to every pserver.
Optimize-role ops that combine several parameters (global-norm clipping:
no op_role_var) cannot be cut by slices, so they, and the per-parameter ops
tied to them, stay on the trainers; the gradient a trainer sends is the one
its pserver-side ops read.
"""

from __future__ import annotations

from dataclasses import dataclass

from fluidps.errors import UnsupportedError
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.types import EMPTY_VAR_NAME, MERGED_SUFFIX, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OpRole


@dataclass(frozen=True)
class ParamUpdate:
    """One parameter's optimization: the ops that run on its pserver."""

    param: str
    grad: str  # what the trainer sends: the gradient the pserver-side ops read
    ops: tuple[int, ...]  # indices in block 0, in program order, ending with the update op
    state: tuple[str, ...]  # accumulators the update op reads and writes (moments, beta powers)


@dataclass(frozen=True)
class ProgramRoles:
    updates: tuple[ParamUpdate, ...]
    lr_ops: tuple[int, ...]
    trainer_optimize_ops: tuple[int, ...]

    @property
    def pserver_ops(self) -> set[int]:
        return {i for u in self.updates for i in u.ops} | set(self.lr_ops)


def role(op: Operator) -> int:
    return op.attr(OP_ROLE_ATTR) if op.has_attr(OP_ROLE_ATTR) else 0


def role_params(op: Operator) -> list[str]:
    pairs = op.attr(OP_ROLE_VAR_ATTR) if op.has_attr(OP_ROLE_VAR_ATTR) else []
    return pairs[0::2]


def _names(names: list[str]) -> set[str]:
    return {n for n in names if n != EMPTY_VAR_NAME}


def analyze(program: Program) -> ProgramRoles:
    block = program.global_block()
    ops = block.ops
    lr_ops = [i for i, op in enumerate(ops) if role(op) & OpRole.LRSched]
    optimize = [i for i, op in enumerate(ops) if role(op) & OpRole.Optimize and i not in lr_ops]
    updates = [i for i in optimize if ops[i].input("Param") and ops[i].output("ParamOut")]
    if not updates:
        raise UnsupportedError(
            "the program has no optimizer ops (op_role Optimize with a Param input): "
            "call optimizer.minimize(loss) before transpiling"
        )
    trainer_side = _trainer_side(ops, optimize, updates)
    lr_outputs = {n for i in lr_ops for n in ops[i].output_arg_names}
    result = []
    for u in updates:
        param = ops[u].input("Param")[0]
        if u in trainer_side:
            raise UnsupportedError(
                f"the optimizer op of {param!r} depends on global optimize ops; cannot place it"
            )
        mine = [i for i in optimize if i not in trainer_side and param in role_params(ops[i]) and i <= u]
        result.append(
            ParamUpdate(
                param, _sent_grad(block, ops, mine, lr_outputs, param), tuple(mine), _state(block, ops[u])
            )
        )
    params = [r.param for r in result]
    if len(params) != len(set(params)):
        raise UnsupportedError(f"a parameter is updated by two optimizer ops: {sorted(params)}")
    return ProgramRoles(tuple(result), tuple(lr_ops), tuple(sorted(trainer_side)))


def _trainer_side(ops: list[Operator], optimize: list[int], updates: list[int]) -> set[int]:
    """Optimize ops without op_role_var combine parameters (global-norm clipping).
    They stay on the trainers, with the per-parameter ops that feed them
    (squares, sums) and those that read their results (the scaling by the
    global factor). Ops reading what those produce (weight decay of the
    clipped gradient) are ordinary pserver-side ops."""
    global_ops = {i for i in optimize if not role_params(ops[i]) and i not in updates}
    global_vars = {n for i in global_ops for n in _names(ops[i].output_arg_names)}
    side = set(global_ops)
    side |= {i for i in optimize if i not in updates and global_vars & _names(ops[i].input_arg_names)}
    changed = True
    while changed:
        changed = False
        consumed = {n for i in side for n in _names(ops[i].input_arg_names)}
        for i in optimize:
            if i not in side and i not in updates and consumed & _names(ops[i].output_arg_names):
                side.add(i)
                changed = True
    return side


def _sent_grad(block: Block, ops: list[Operator], mine: list[int], lr_outputs: set[str], param: str) -> str:
    written = {n for i in mine for n in ops[i].output_arg_names}
    candidates = []
    for i in mine:
        for name in _names(ops[i].input_arg_names):
            var = block.find_var(name)
            # (a pipeline stage's gradient summed over its micro-batches is persistable state)
            held = var is not None and var.persistable and not name.endswith(MERGED_SUFFIX)
            if var is None or held or name in written or name in lr_outputs or name in candidates:
                continue
            candidates.append(name)
    if len(candidates) != 1:
        raise UnsupportedError(
            f"parameter {param!r}: its optimizer ops should read exactly one gradient computed by the "
            f"trainer, found {candidates or 'none'}"
        )
    return candidates[0]


def _state(block: Block, update: Operator) -> tuple[str, ...]:
    param = update.input("Param")[0]
    reads, writes = _names(update.input_arg_names), _names(update.output_arg_names)
    state = []
    for name in update.input_arg_names:
        var = block.find_var(name)
        if name != param and name in writes and name in reads and var is not None and var.persistable:
            state.append(name)
    return tuple(dict.fromkeys(state))
