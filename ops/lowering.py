"""The lowering contract: an op as straight-line code in a compiled block.

Besides its kernel (a Python runner the interpreter calls), an op may register a
*lowering*: given a `LoweringOp`, it writes the statements that compute the op
into the source of one numba-compiled function (fluidps.executor.compiler). Its
inputs and outputs are local variables there; it calls the same numba helpers its
kernel calls, through `call`, which imports them into the generated module.
Everything that depends only on the op (attributes, ranks, which outputs are
wanted) is decided while lowering: the generated code is only the per-step work.

A lowering raises NotLowerable for a case it does not handle (a SelectedRows
operand, an attribute value it has no code for): the op then runs interpreted,
between compiled segments.

An update op (an optimizer's) may register a `BatchForm`: how several consecutive ops of
its type, one per parameter, run as one loop over the parameters (a multi-tensor
apply), with the same arithmetic per parameter as its lowering.

An elementwise op may also register its `ElementForm`: the numba function of one
element of each operand that its kernel maps over its arrays. The compiler fuses
runs of such ops into one loop nest that calls those functions on scalars, so a
value passed from one op to the next never becomes an array, and both ways of
running give the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from numba import njit

from fluidps.errors import ExecutionError
from fluidps.ir.operator import Operator
from fluidps.ir.opschema import OpSchema
from fluidps.ir.types import EMPTY_VAR_NAME, VarType


class NotLowerable(Exception):
    """This op (as configured here) has no compiled form: it runs interpreted."""


class LoweringOp:
    """What a lowering sees of one op, and where it writes its code."""

    def __init__(
        self,
        op: Operator,
        schema: OpSchema,
        local: Callable[[str], str],
        helper: Callable[[Callable[..., Any]], str],
    ):
        self.op = op
        self.type = op.type
        self._schema = schema
        self._local = local
        self._helper = helper
        self.lines: list[str] = []
        self.fresh = False  # every output is a new array of its own (new_arrays)
        self._temps = 0

    # -- the op --------------------------------------------------------------------------

    def attr(self, name: str) -> Any:
        return self._schema.attr_value(self.op, name)

    def input(self, slot: str) -> str:
        """The local variable holding the one variable of an input slot."""
        return self._local(self._one(self.op.input(slot), "input", slot))

    def output(self, slot: str) -> str | None:
        """The local variable for the one variable of an output slot; None when unwanted."""
        names = [n for n in self.op.output(slot) if n != EMPTY_VAR_NAME]
        return self._local(self._one(names, "output", slot)) if names else None

    def inputs(self, slot: str) -> list[str]:
        """The local variables holding the variables of a duplicable input slot, in order."""
        names = [n for n in self.op.input(slot) if n != EMPTY_VAR_NAME]
        if not names:
            raise ExecutionError(f"op {self.type!r}: input {slot!r} needs at least one variable")
        return [self._local(n) for n in names]

    def outputs(self, slot: str) -> list[str | None]:
        """The local variables for the variables of a duplicable output slot, in order;
        None where one is unwanted."""
        return [None if n == EMPTY_VAR_NAME else self._local(n) for n in self.op.output(slot)]

    def has_input(self, slot: str) -> bool:
        return any(n != EMPTY_VAR_NAME for n in self.op.input(slot))

    def rank(self, slot: str) -> int:
        """The declared rank of an input slot's one variable (ranks are fixed: feeds are
        checked against them; sizes are not, so code reads them at run time)."""
        return len(self.declared(slot))

    def declared(self, slot: str) -> tuple[int, ...]:
        """The declared shape of an input slot's one variable (-1: any size)."""
        var = self._input_var(slot)
        if var.shape is None:
            raise NotLowerable(f"{slot} has no declared shape")
        return tuple(var.shape)

    def declared_dtype(self, slot: str) -> VarType:
        """The declared element type of an input slot's one variable."""
        var = self._input_var(slot)
        if var.dtype is None:
            raise NotLowerable(f"{slot} has no declared dtype")
        return var.dtype

    def require_dense(self, *slots: str) -> None:
        """Only dense tensors are lowered: a SelectedRows operand runs interpreted."""
        for slot in slots:
            for name in self.op.input(slot) + self.op.output(slot):
                if name == EMPTY_VAR_NAME:
                    continue
                var = self._var(name)
                if var.type != VarType.LOD_TENSOR or var.dtype is None:
                    raise NotLowerable(f"{name} is not a dense tensor")

    # -- the code ------------------------------------------------------------------------

    def call(self, fn: Callable[..., Any], *args: str) -> str:
        """An expression calling numba function `fn` (a module-level function) on `args`."""
        return f"{self._helper(fn)}({', '.join(args)})"

    def emit(self, line: str) -> None:
        self.lines.append(line)

    def new_arrays(self) -> None:
        """Say that each output this op writes is a newly allocated array (or a view of
        one) that shares no memory with its inputs or its other outputs: once dead, the
        compiler may give it to a later value (fluidps.executor.compiler.buffers). Ops
        that do not say so are taken to share memory with their inputs."""
        self.fresh = True

    def temp(self) -> str:
        """A fresh local for an intermediate value (numba types each local once)."""
        self._temps += 1
        return self._local(f"@{self.type}#{id(self)}#{self._temps}")

    def variable(self, name: str) -> Any:
        """The declared variable `name` of the op's block (NotLowerable if undeclared)."""
        return self._var(name)

    def _input_var(self, slot: str) -> Any:
        return self._var(self._one([n for n in self.op.input(slot) if n != EMPTY_VAR_NAME], "input", slot))

    def _var(self, name: str) -> Any:
        var = None if self.op.block is None else self.op.block.find_var(name)
        if var is None:
            raise NotLowerable(f"{name} is not declared")
        return var

    def _one(self, names: list[str], kind: str, slot: str) -> str:
        if len(names) != 1:
            raise ExecutionError(f"op {self.type!r}: {kind} {slot!r} needs one variable, got {names}")
        return names[0]


Lowering = Callable[[LoweringOp], None]


def dims(local: str, indices: range | list[int]) -> list[str]:
    """Expressions for dimensions `indices` of array `local`, read at run time."""
    return [f"{local}.shape[{i}]" for i in indices]


def shape(parts: list[str]) -> str:
    """A tuple expression of dimension expressions (() for none)."""
    return f"({', '.join(parts)},)" if parts else "()"


def product(parts: list[str]) -> str:
    """The product of dimension expressions (1 for none)."""
    return " * ".join(parts) if parts else "1"


@dataclass(frozen=True)
class Spread:
    """An operand broadcast along the other dimensions of an elementwise op: its
    dimensions are dimensions `start` .. `start + rank` of the op's output (a bias).
    As an output, it is the sum over the others (the gradient of such an operand)."""

    start: int
    rank: int


@dataclass(frozen=True)
class ElementForm:
    """An op as a function of one element: `fn` (numba) maps an element of each of
    `inputs` (slots) to the element of `outputs` (a tuple when several), as the op's
    kernel does over whole arrays. `spread(op)` names the slots broadcast along the
    others (Spread), raising NotLowerable for a broadcast it cannot state; None: every
    operand has the output's shape."""

    fn: Callable[..., Any]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    spread: Callable[[LoweringOp], dict[str, Spread]] | None = None


@dataclass(frozen=True)
class BatchForm:
    """Consecutive ops of one type as one loop over their parameters. `key(op)` (of a
    lowered op) says which ops may share a loop: those with equal keys (the attributes
    and dtypes the loop takes once); None: this one runs on its own. `lines(ops)`: the
    statements updating every op's parameter in turn, as each op's lowering would."""

    key: Callable[[LoweringOp], Hashable | None]
    lines: Callable[[Sequence[LoweringOp]], list[str]]


# -- the shapes a compiled segment was checked for ---------------------------------------------


class ShapesChanged(Exception):
    """Raised by a compiled segment, before it does anything, when its inputs' shapes are
    not those its shape guard last checked (fluidps.executor.shape_guard): the guard's
    shape inference then runs, and the segment is called again."""


@njit(cache=True)
def shape_matches(checked, k, a):
    """The position past array `a`'s entry in `checked` (its rank, then its dimensions)
    when `a` has that shape, else -1 (also when `k` is -1 already): a segment's first
    statements, one call per input array."""
    if k < 0 or k + 1 + a.ndim > checked.shape[0] or checked[k] != a.ndim:
        return -1
    for d in range(a.ndim):
        if checked[k + 1 + d] != a.shape[d]:
            return -1
    return k + 1 + a.ndim
