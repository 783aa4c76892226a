"""Program and Block: the in-memory form of `ProgramDesc` / `BlockDesc`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from fluidps.errors import ProgramError
from fluidps.ir.operator import Operator, SlotArgs
from fluidps.ir.tracked import TouchOnAssign, TrackedDict, TrackedList
from fluidps.ir.types import AttrType, OpRole, VarType, to_vartype
from fluidps.ir.unique_name import UniqueNameGenerator
from fluidps.ir.variable import Parameter, Variable

if TYPE_CHECKING:
    from fluidps.ir.devices import PipelineConfig

ROOT_PARENT = -1  # parent_idx of block 0, as Fluid writes it


class Block(TouchOnAssign):
    """A list of ops and the variables they declare; sub-blocks see their parents' variables.

    `ops` and `vars` are a list and a dict that report their edits to the program;
    assigning one (`block.ops = [...]`) copies the items into a new tracked container.
    Assigning `idx`, `parent_idx` or `forward_block_idx` is an edit too.
    """

    _OWNER_ATTR = "program"

    program: Program
    idx: int
    parent_idx: int
    forward_block_idx: int

    def __init__(self, program: Program, idx: int, parent_idx: int = ROOT_PARENT):
        # Into __dict__, past __setattr__: building a block is no edit (see TouchOnAssign).
        self.__dict__.update(
            program=program,
            idx=idx,
            parent_idx=parent_idx,
            forward_block_idx=-1,
            _vars=TrackedDict((), self._touch),
            _ops=TrackedList((), self._touch),
            # Serialized BlockDesc fields fluidps does not model, kept for round trips.
            _extra=b"",
        )

    @property
    def ops(self) -> TrackedList[Operator]:
        return self._ops

    @ops.setter
    def ops(self, ops: Iterable[Operator]) -> None:
        self._ops = TrackedList(ops, self._touch)  # __setattr__, which called this, reports the edit

    @property
    def vars(self) -> TrackedDict[str, Variable]:
        return self._vars

    @vars.setter
    def vars(self, vars: Mapping[str, Variable]) -> None:
        self._vars = TrackedDict(vars, self._touch)

    def _touch(self) -> None:
        self.program._touch()

    @property
    def parent_block(self) -> Block | None:
        if 0 <= self.parent_idx < self.program.num_blocks and self.parent_idx != self.idx:
            return self.program.block(self.parent_idx)
        return None

    # -- variables -----------------------------------------------------------------------

    def var(self, name: str) -> Variable:
        """The variable `name` declared in this block (not its parents)."""
        var = self.vars.get(name)
        if var is None:
            raise ProgramError(f"block {self.idx} has no variable {name!r}")
        return var

    def has_var(self, name: str) -> bool:
        return name in self.vars

    def find_var(self, name: str) -> Variable | None:
        """`name` from this block or the nearest ancestor declaring it; None if none does."""
        block: Block | None = self
        seen = set()
        while block is not None and block.idx not in seen:
            var = block.vars.get(name)
            if var is not None:
                return var
            seen.add(block.idx)
            block = block.parent_block
        return None

    def var_recursive(self, name: str) -> Variable:
        var = self.find_var(name)
        if var is None:
            raise ProgramError(f"variable {name!r} is declared neither in block {self.idx} nor its parents")
        return var

    def create_var(
        self,
        name: str | None = None,
        *,
        shape: tuple[int, ...] | list[int] | None = None,
        dtype: Any = None,
        type: VarType = VarType.LOD_TENSOR,
        persistable: bool = False,
        stop_gradient: bool = False,
        lod_level: int = 0,
        need_check_feed: bool = False,
    ) -> Variable:
        """Declare a variable. As in Fluid, declaring an existing name returns that
        variable, after checking the new description does not contradict it."""
        if name is None:
            name = self.program.unique_name("_generated_var")
        dtype = None if dtype is None else to_vartype(dtype)
        if name in self.vars:
            return self._reuse(self.vars[name], shape, dtype, type)
        var = Variable(
            self,
            name,
            type=type,
            dtype=dtype,
            shape=shape,
            lod_level=lod_level,
            persistable=persistable,
            stop_gradient=stop_gradient,
            need_check_feed=need_check_feed,
        )
        return self._add_var(var)

    def create_parameter(
        self,
        name: str,
        shape: tuple[int, ...] | list[int],
        dtype: Any = "float32",
        *,
        initializer: Any = None,
        **attrs: Any,
    ) -> Parameter:
        """Declare a parameter in this (global) block. If `initializer` is given it
        appends its op here, which is how a startup program is filled."""
        if self.idx != 0:
            raise ProgramError(
                f"parameters live in the global block; {name!r} was created in block {self.idx}"
            )
        if name in self.vars:
            raise ProgramError(f"block 0 already has a variable named {name!r}")
        # A hashed table (a SELECTED_ROWS parameter) has no fixed number of rows: [-1, dim].
        open_rows = attrs.get("type") == VarType.SELECTED_ROWS and len(shape) == 2 and shape[1] > 0
        if any(d < 0 for d in shape[1 if open_rows else 0 :]):
            raise ProgramError(f"parameter {name!r} needs a fully known shape, got {list(shape)}")
        param = Parameter(self, name, shape=shape, dtype=to_vartype(dtype), initializer=initializer, **attrs)
        self._add_var(param)
        if initializer is not None:
            initializer(param, self)
        return param

    def remove_var(self, name: str) -> None:
        self.var(name)
        del self.vars[name]

    def _add_var(self, var: Variable) -> Variable:
        self.vars[var.name] = var
        self.program._names.reserve(var.name)
        return var

    def _reuse(self, var: Variable, shape: Any, dtype: VarType | None, type: VarType) -> Variable:
        if var.type != type:
            raise ProgramError(f"variable {var.name!r} exists as {var.type.name}, not {VarType(type).name}")
        if dtype is not None and var.dtype is not None and var.dtype != dtype:
            raise ProgramError(f"variable {var.name!r} exists with dtype {var.dtype.name}, not {dtype.name}")
        if shape is not None and var.shape is not None and tuple(shape) != var.shape:
            raise ProgramError(
                f"variable {var.name!r} exists with shape {list(var.shape)}, not {list(shape)}"
            )
        var.dtype = var.dtype if dtype is None else dtype
        var.shape = var.shape if shape is None else tuple(int(d) for d in shape)
        return var

    # -- ops -----------------------------------------------------------------------------

    # Ops are built with `fluidps.op_registry.append_op(block, ...)` (or the layers),
    # which checks them against their schema and infers output shapes. `ir` cannot
    # import the op definitions, so the unchecked constructors below stay internal.

    def _append_op_unchecked(
        self,
        type: str,
        inputs: Mapping[str, SlotArgs] | None = None,
        outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
        attr_types: Mapping[str, AttrType] | None = None,
    ) -> Operator:
        """Append an op without any check: not its slots, attributes or shapes, not even
        that its type exists. For the parser, passes that copy ops verbatim, and tests
        that build deliberately invalid programs; everything else uses
        `fluidps.op_registry.append_op`."""
        return self._insert_op_unchecked(len(self.ops), type, inputs, outputs, attrs, attr_types)

    def _insert_op_unchecked(
        self,
        index: int,
        type: str,
        inputs: Mapping[str, SlotArgs] | None = None,
        outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
        attr_types: Mapping[str, AttrType] | None = None,
    ) -> Operator:
        """`_append_op_unchecked` before position `index` (0 prepends)."""
        return self._insert_operator(index, Operator(self, type, inputs, outputs, attrs, attr_types))

    def _insert_operator(self, index: int, op: Operator) -> Operator:
        """Put a built op at `index`; `fluidps.op_registry.append_op` ends here."""
        if not 0 <= index <= len(self.ops):
            raise ProgramError(
                f"block {self.idx}: cannot insert an op at {index}; it has {len(self.ops)} ops"
            )
        op.block = self
        self.ops.insert(index, op)
        return op

    def remove_op(self, index: int) -> Operator:
        """Remove and return the op at `index`."""
        if not 0 <= index < len(self.ops):
            raise ProgramError(f"block {self.idx}: no op at {index}; it has {len(self.ops)} ops")
        op = self.ops.pop(index)
        op.block = None
        return op

    def __repr__(self) -> str:
        return f"Block({self.idx}, parent={self.parent_idx}, {len(self.vars)} vars, {len(self.ops)} ops)"


class Program(TouchOnAssign):
    """A whole program: block 0 is the global block; others are sub-blocks.

    `format_version` is `ProgramDesc.version`, the Paddle release that wrote it.
    `revision` tells caches (the executor's prepared programs) when the program
    changed: see its docstring for what it covers.
    """

    random_seed: int
    format_version: int
    pipeline: PipelineConfig | None

    def __init__(self) -> None:
        # Into __dict__, past __setattr__: building a program is no edit (see TouchOnAssign).
        self.__dict__.update(
            random_seed=0,
            format_version=0,
            _revision=0,
            _names=UniqueNameGenerator(),
            _current_block_idx=0,
            _extra=b"",
            _blocks=TrackedList([Block(self, 0)], self._touch),
            # Set by PipelineOptimizer.minimize (not in the ProgramDesc: Paddle keeps its
            # pipeline options beside the program too); an Executor then runs it micro-batch
            # by micro-batch through its stages.
            pipeline=None,
        )

    @property
    def revision(self) -> int:
        """A number that grows with every edit of this program, so a cache keyed by
        (program, revision) never serves an older content of it.

        Edits that bump it: the Program, Block and Operator methods; every mutating
        call on `program.blocks` and on a block's `ops` and `vars`; assigning a public
        attribute of the program, of a block, or of a variable or op in it
        (`var.shape = ...`, `op.type = ...`, `block.ops = [...]`, `program.random_seed
        = ...`). It may also grow when nothing changed (a field assigned its own
        value). Not seen: edits of private state (`op._attrs`), of Python objects a
        field holds (a Parameter's initializer), and of an op or variable put into
        another program's containers as is: it reports to the program its `block`
        names (`_copy_to` makes a copy that belongs). A clone or a parsed program
        starts at 0: it is a new object, with cache entries of its own.
        """
        return self._revision

    @property
    def blocks(self) -> TrackedList[Block]:
        return self._blocks

    @blocks.setter
    def blocks(self, blocks: Iterable[Block]) -> None:
        self._blocks = TrackedList(blocks, self._touch)  # __setattr__, which called this, reports the edit

    # -- blocks --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def global_block(self) -> Block:
        return self.blocks[0]

    def block(self, index: int) -> Block:
        if isinstance(index, bool) or not 0 <= index < len(self.blocks):
            raise ProgramError(f"program has no block {index}; it has blocks 0..{len(self.blocks) - 1}")
        return self.blocks[index]

    def current_block(self) -> Block:
        """The block the builder appends to: block 0 unless inside `create_block`."""
        return self.blocks[self._current_block_idx]

    def create_block(self, parent_idx: int | None = None) -> Block:
        """Append a sub-block (child of the current block unless `parent_idx` is
        given) and make it current until `rollback()`."""
        parent = self._current_block_idx if parent_idx is None else parent_idx
        self.block(parent)
        block = Block(self, len(self.blocks), parent)
        self.blocks.append(block)
        self._current_block_idx = block.idx
        return block

    def rollback(self) -> None:
        """Make the current block's parent current again."""
        parent = self.current_block().parent_idx
        self._current_block_idx = max(parent, 0)

    # -- variables -----------------------------------------------------------------------

    def list_vars(self) -> Iterator[Variable]:
        for block in self.blocks:
            yield from block.vars.values()

    def all_parameters(self) -> list[Parameter]:
        return [v for v in self.list_vars() if isinstance(v, Parameter)]

    def unique_name(self, key: str) -> str:
        """`key_N` for the smallest N not used by this program (`fc` -> `fc_0`)."""
        return self._names.generate(key)

    # -- whole program -------------------------------------------------------------------

    def clone(self, for_test: bool = False) -> Program:
        """A deep copy. `for_test=True` also drops backward, optimizer and
        learning-rate ops (and the variables only they used) and sets `is_test`
        on ops that have it, giving the program to evaluate with."""
        clone = Program()
        clone.random_seed = self.random_seed
        clone.format_version = self.format_version
        clone._names = self._names.copy()
        clone._extra = self._extra
        clone.pipeline = None if for_test else self.pipeline  # (evaluation runs the whole batch at once)
        blocks = []
        for block in self.blocks:
            copy = Block(clone, block.idx, block.parent_idx)
            copy.forward_block_idx = block.forward_block_idx
            copy._extra = block._extra
            copy.vars = {name: var._copy_to(copy) for name, var in block.vars.items()}
            copy.ops = [op._copy_to(copy) for op in block.ops]
            blocks.append(copy)
        clone.blocks = blocks
        if for_test:
            for block in clone.blocks:
                _prune_to_forward(block)
        clone._revision = 0  # building it was no edit
        return clone

    @staticmethod
    def parse_from_string(data: bytes) -> Program:
        """Parse a serialized ProgramDesc (ours or Paddle's)."""
        from fluidps.ir.serialize import parse_program

        return parse_program(data)

    def serialize_to_string(self) -> bytes:
        """The ProgramDesc bytes; the same program always gives the same bytes."""
        from fluidps.ir.serialize import serialize_program

        return serialize_program(self)

    def _touch(self) -> None:
        # Past __setattr__: every edit of the program comes through here.
        self.__dict__["_revision"] += 1

    def __str__(self) -> str:
        from fluidps.ir.printer import program_to_text

        return program_to_text(self)

    def __repr__(self) -> str:
        ops = sum(len(b.ops) for b in self.blocks)
        return f"Program({len(self.blocks)} blocks, {ops} ops)"


_TRAINING_ROLES = OpRole.Backward | OpRole.Optimize | OpRole.LRSched


def _prune_to_forward(block: Block) -> None:
    """Drop training-only ops from `block` and the variables only they used."""
    kept, dropped = [], []
    for op in block.ops:
        role = op.attr("op_role") if op.has_attr("op_role") else 0
        (dropped if role & _TRAINING_ROLES else kept).append(op)
    block.ops = kept
    used = {n for op in kept for n in op.input_arg_names + op.output_arg_names}
    orphaned = {n for op in dropped for n in op.input_arg_names + op.output_arg_names} - used
    for name in orphaned:
        var = block.vars.get(name)
        if var is not None and not var.persistable:
            del block.vars[name]
    for op in kept:
        if op.has_attr("is_test"):
            op.set_attr("is_test", True)
