"""`verify`: the invariants every program must hold, checked against op schemas.

Like FX's `lint()`, it is run by tests, by `DistributeTranspiler.transpile` (on
its input programs and on every program it produces) and by `fluidps inspect
--check`; the builder and the other passes do not call it. It collects every
problem instead of stopping at the first, and each message names the block, the
op index and type, and the variable or attribute concerned.
"""

from __future__ import annotations

from collections.abc import Mapping

from fluidps.errors import ShapeError, VerifyError
from fluidps.ir.attrs import same_kind
from fluidps.ir.infer import InferContext, VarInfo
from fluidps.ir.operator import Operator
from fluidps.ir.opschema import REQUIRED, OpSchema
from fluidps.ir.program import Block, Program, Variable
from fluidps.ir.types import ELEMENT_TYPES, EMPTY_VAR_NAME, TENSOR_KINDS, AttrType

Schemas = Mapping[str, OpSchema]


def verify(program: Program, schemas: Schemas) -> None:
    """Raise VerifyError listing every problem of `program`; return None if there is none."""
    problems = check_program(program, schemas)
    if problems:
        raise VerifyError(problems)


def check_program(program: Program, schemas: Schemas) -> list[str]:
    """Every problem of `program`, as messages; [] when it is well formed. Linear in the
    program's size, however deep its blocks nest."""
    problems: list[str] = []
    scope = _Scope(program)
    cyclic = _blocks_on_cycles(program)
    for block in program.blocks:
        problems += _check_block_links(program, block, cyclic)
        problems += _check_vars(block)
        first_write = _first_writes(block)
        for i, op in enumerate(block.ops):
            where = f"block {block.idx}, op #{i} ({op.type})"
            schema = schemas.get(op.type)
            if schema is None:
                problems.append(f"{where}: unknown op type {op.type!r}")
                continue
            op_problems = _check_slots(op, schema) + _check_attrs(program, block, op, schema)
            op_problems += _check_defined(block, op, i, first_write, scope)
            if not op_problems:
                op_problems = _check_inference(block, op, schema, scope)
            problems += [f"{where}: {p}" for p in op_problems]
    return problems


class _Scope:
    """`Block.find_var` for every block at once, each (block, name) resolved once: a chain
    of n nested blocks costs O(n) per name, not O(n) per lookup."""

    def __init__(self, program: Program):
        self.blocks = list(program.blocks)
        self.parents = [b.parent_idx if 0 <= b.parent_idx < len(self.blocks) else -1 for b in self.blocks]
        self.memo: dict[tuple[int, str], Variable | None] = {}

    def find(self, block: int, name: str) -> Variable | None:
        walked, found, idx, seen = [], None, block, set()
        while idx >= 0 and idx not in seen:
            if (idx, name) in self.memo:
                found = self.memo[(idx, name)]
                break
            seen.add(idx)
            walked.append(idx)
            found = self.blocks[idx].vars.get(name)
            if found is not None:
                break
            idx = self.parents[idx]
        for i in walked:
            self.memo[(i, name)] = found
        return found


def _blocks_on_cycles(program: Program) -> set[int]:
    """Blocks whose chain of parents loops (each block visited once overall)."""
    n = program.num_blocks
    state = [0] * n  # 0: not seen, 1: on the current walk, 2: done
    cyclic: set[int] = set()
    for start in range(n):
        path, idx = [], start
        while 0 <= idx < n and state[idx] == 0:
            state[idx] = 1
            path.append(idx)
            idx = program.blocks[idx].parent_idx
        loops = 0 <= idx < n and (state[idx] == 1 or idx in cyclic)
        for i in path:
            state[i] = 2
            if loops:
                cyclic.add(i)
    return cyclic


def _check_block_links(program: Program, block: Block, cyclic: set[int]) -> list[str]:
    where = f"block {block.idx}"
    n = program.num_blocks
    if block.idx == 0:
        bad_parent = block.parent_idx >= 0
    else:
        bad_parent = not 0 <= block.parent_idx < n or block.parent_idx == block.idx or block.idx in cyclic
    problems = []
    if bad_parent:
        problems.append(f"{where}: bad block index: parent_idx {block.parent_idx} (program has {n} blocks)")
    if not -1 <= block.forward_block_idx < n:
        problems.append(f"{where}: bad block index: forward_block_idx {block.forward_block_idx}")
    return problems


def _check_vars(block: Block) -> list[str]:
    problems = []
    for var in block.vars.values():
        where = f"block {block.idx}: variable {var.name!r}"
        if var.type not in TENSOR_KINDS:
            continue
        if var.dtype is None:
            problems.append(f"{where} ({var.type.name}) has no dtype")
        elif var.dtype not in ELEMENT_TYPES:
            problems.append(f"{where} has dtype {var.dtype.name}, which is not an element type")
        if var.shape is not None and any(d < -1 for d in var.shape):
            problems.append(
                f"{where} has invalid shape {list(var.shape)} (dimensions are >= 0, or -1 for unknown)"
            )
    return problems


def _first_writes(block: Block) -> dict[str, int]:
    first: dict[str, int] = {}
    for i, op in enumerate(block.ops):
        for name in op.output_arg_names:
            first.setdefault(name, i)
    return first


def _check_slots(op: Operator, schema: OpSchema) -> list[str]:
    problems = []
    for kind, given, declared, lookup in (
        ("input", op.inputs, schema.inputs, schema.input_slot),
        ("output", op.outputs, schema.outputs, schema.output_slot),
    ):
        for name, args in given.items():
            slot = lookup(name)
            if slot is None:
                known = ", ".join(s.name for s in declared) or "none"
                problems.append(f"has no {kind} slot {name!r} (its {kind} slots: {known})")
                continue
            real = [a for a in args if a != EMPTY_VAR_NAME]
            if slot.extra and real:
                problems.append(f"{kind} {name!r} = {real} asks for a feature fluidps does not implement")
            if not slot.duplicable and len(args) > 1:
                problems.append(f"{kind} slot {name!r} takes one variable, got {len(args)}: {args}")
        for slot in declared:
            if not slot.dispensable and not given.get(slot.name):
                problems.append(f"{kind} slot {slot.name!r} is required but missing")
    return problems


def _check_attrs(program: Program, block: Block, op: Operator, schema: OpSchema) -> list[str]:
    problems = []
    for name in op.attr_names:
        spec = schema.attr_spec(name)
        actual = op.attr_type(name)
        value = op.attr(name)
        if actual in (AttrType.BLOCK, AttrType.BLOCKS):
            for idx in value if isinstance(value, list) else [value]:
                if not 0 < idx < program.num_blocks or idx == block.idx:
                    problems.append(
                        f"attribute {name!r}: bad block index {idx} (program has {program.num_blocks} blocks)"
                    )
        if spec is None:
            problems.append(f"has attribute {name!r} ({actual.name}) that op {op.type!r} does not define")
            continue
        if not same_kind(actual, spec.type):
            problems.append(f"attribute {name!r} has type {actual.name}, expected {spec.type.name}")
            continue
        if spec.supported is not None and not spec.supported(value):
            hint = f": {spec.hint}" if spec.hint else ""
            problems.append(f"attribute {name}={value!r} asks for something fluidps does not implement{hint}")
    for spec in schema.attrs:
        if spec.default is REQUIRED and not op.has_attr(spec.name):
            problems.append(f"attribute {spec.name!r} ({spec.type.name}) is required but missing")
    return problems


def _check_defined(
    block: Block, op: Operator, index: int, first_write: dict[str, int], scope: _Scope
) -> list[str]:
    problems = []
    for slot, args in op.inputs.items():
        for name in args:
            if name == EMPTY_VAR_NAME:
                continue
            var = scope.find(block.idx, name)
            if var is None:
                problems.append(f"input {slot} reads {name!r}, which no enclosing block declares")
            elif (
                block.idx == 0
                and not var.persistable
                and var.block is block
                and first_write.get(name, index) > index
            ):
                problems.append(f"input {slot} reads {name!r} before op #{first_write[name]} writes it")
    for slot, args in op.outputs.items():
        for name in args:
            if name != EMPTY_VAR_NAME and scope.find(block.idx, name) is None:
                problems.append(f"output {slot} writes {name!r}, which no enclosing block declares")
    return problems


def _check_inference(block: Block, op: Operator, schema: OpSchema, scope: _Scope) -> list[str]:
    if schema.infer is None:
        return []

    def lookup(name: str) -> VarInfo | None:
        var = scope.find(block.idx, name)
        return None if var is None else VarInfo.of(var)

    ctx = InferContext(op, schema, lookup)
    try:
        schema.infer(ctx)
    except ShapeError as e:
        return [str(e)]
    except (
        ValueError,
        TypeError,
        IndexError,
        KeyError,
        OverflowError,
    ) as e:  # what the rules did not foresee
        return [f"its attributes or inputs cannot be inferred from ({type(e).__name__}: {e})"]
    except MemoryError:  # a rule sized by an attribute (a list of `num` parts) before checking it
        return ["its attributes ask shape inference for more memory than there is (out of memory)"]
    problems = []
    for name, inferred in ctx.results.items():
        var = scope.find(block.idx, name)
        if var is None or var.type not in TENSOR_KINDS:
            continue
        if inferred.type != var.type:
            problems.append(f"{name!r} is declared {var.type.name} but the op makes {inferred.type.name}")
        elif inferred.dtype is not None and var.dtype is not None and inferred.dtype != var.dtype:
            problems.append(f"{name!r} is declared {var.dtype.name} but the op makes {inferred.dtype.name}")
        elif not shapes_compatible(var.shape, inferred.shape):
            problems.append(
                f"{name!r} is declared with shape {_fmt(var.shape)} but the op makes {_fmt(inferred.shape)}"
            )
    return problems


def shapes_compatible(declared: tuple[int, ...] | None, inferred: tuple[int, ...] | None) -> bool:
    """Equal up to unknown (-1) dimensions. A 0-d shape and [1] are the same
    scalar: Fluid 1.x wrote [1] where Paddle 2.5+ writes []."""
    if declared is None or inferred is None:
        return True
    if {declared, inferred} == {(), (1,)}:
        return True
    if len(declared) != len(inferred):
        return False
    return all(a == b or a < 0 or b < 0 for a, b in zip(declared, inferred, strict=True))


def _fmt(shape: tuple[int, ...] | None) -> str:
    return "?" if shape is None else str(list(shape))
