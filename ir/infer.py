"""Shape and dtype inference: the context an op's `infer` function works in.

An infer function reads its inputs' `VarInfo` and declares its outputs with
`set_output`. It never touches the block: the caller decides whether results
are written into the variables (building) or compared with them (verify).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

from fluidps.errors import ShapeError
from fluidps.ir.types import EMPTY_VAR_NAME, VarType, dtype_name

if TYPE_CHECKING:
    from fluidps.ir.operator import Operator
    from fluidps.ir.opschema import OpSchema
    from fluidps.ir.variable import Variable

Shape = tuple[int, ...]


@dataclass(frozen=True)
class VarInfo:
    """What inference knows of a variable: kind, element type, shape (-1 = unknown)."""

    name: str
    type: VarType = VarType.LOD_TENSOR
    dtype: VarType | None = None
    shape: Shape | None = None
    lod_level: int = 0

    @classmethod
    def of(cls, var: Variable) -> VarInfo:
        return cls(var.name, var.type, var.dtype, var.shape, var.lod_level)

    def describe(self) -> str:
        shape = "?" if self.shape is None else str(list(self.shape))
        kind = "" if self.type == VarType.LOD_TENSOR else f" {self.type.name}"
        return f"{self.name} {shape} {dtype_name(self.dtype)}{kind}"


Lookup = Callable[[str], "VarInfo | None"]


class InferContext:
    """The view of one op that its infer function gets."""

    def __init__(self, op: Operator, schema: OpSchema, lookup: Lookup):
        self.op = op
        self.schema = schema
        self._lookup = lookup
        self.results: dict[str, VarInfo] = {}

    @property
    def type(self) -> str:
        return self.op.type

    def attr(self, name: str) -> Any:
        return self.schema.attr_value(self.op, name)

    # -- inputs --------------------------------------------------------------------------

    def has_input(self, slot: str) -> bool:
        return any(n != EMPTY_VAR_NAME for n in self.op.input(slot))

    def inputs(self, slot: str) -> list[VarInfo]:
        """Every variable of an input slot (placeholders skipped)."""
        return [self._info(n, slot) for n in self.op.input(slot) if n != EMPTY_VAR_NAME]

    def input(self, slot: str) -> VarInfo:
        """The one variable of an input slot, with a known shape."""
        args = self.inputs(slot)
        if len(args) != 1:
            self.fail(f"input {slot} needs exactly one variable, got {len(args)}")
        if args[0].shape is None:
            self.fail(f"input {slot} ({args[0].name}) has no shape")
        return args[0]

    def lookup(self, name: str) -> VarInfo | None:
        return self._lookup(name)

    def _info(self, name: str, slot: str) -> VarInfo:
        info = self._lookup(name)
        if info is None:
            self.fail(f"input {slot} reads {name!r}, which is not declared")
        return info

    # -- outputs -------------------------------------------------------------------------

    def has_output(self, slot: str) -> bool:
        return any(n != EMPTY_VAR_NAME for n in self.op.output(slot))

    def set_output(
        self,
        slot: str,
        shape: Sequence[int] | None,
        dtype: VarType | None,
        *,
        index: int | None = None,
        type: VarType = VarType.LOD_TENSOR,
        lod_level: int = 0,
    ) -> None:
        """Declare the variable(s) of an output slot: all of them, or the one at `index`."""
        names = self.op.output(slot)
        if index is not None:
            names = names[index : index + 1]
        for name in names:
            if name != EMPTY_VAR_NAME:
                dims = None if shape is None else tuple(int(d) for d in shape)
                self.results[name] = VarInfo(name, type, dtype, dims, lod_level)

    def share(self, slot: str, info: VarInfo, *, index: int | None = None) -> None:
        """Give an output the kind, shape and dtype of `info` (an input, usually)."""
        self.set_output(slot, info.shape, info.dtype, index=index, type=info.type, lod_level=info.lod_level)

    def fail(self, message: str) -> NoReturn:
        """Raise a ShapeError naming this op and every input with its shape."""
        described = []
        for slot, names in sorted(self.op.inputs.items()):
            infos = [self._lookup(n) for n in names if n != EMPTY_VAR_NAME]
            text = ", ".join(i.describe() if i is not None else "?" for i in infos)
            described.append(f"{slot}=[{text}]")
        raise ShapeError(f"op {self.op.type!r}: {message}; inputs: {' '.join(described) or 'none'}")


# -- shape helpers shared by op families ---------------------------------------------------


def numel(shape: Sequence[int]) -> int:
    """Element count, or -1 if any dimension is unknown."""
    return -1 if any(d < 0 for d in shape) else math.prod(shape)


def broadcast_dim(a: int, b: int) -> int | None:
    """One broadcast dimension (-1 unknown); None if the two cannot broadcast."""
    if a == b:
        return a
    if a == 1:
        return b
    if b == 1:
        return a
    if a < 0:
        return b
    if b < 0:
        return a
    return None


def elementwise_shape(x: Shape, y: Shape, axis: int, ctx: InferContext) -> Shape:
    """Fluid's elementwise broadcast: the shorter operand is aligned with the
    longer one starting at `axis` (-1: aligned to the trailing dimensions)."""
    swap = len(y) > len(x)
    big, small = (y, x) if swap else (x, y)
    start = len(big) - len(small) if axis == -1 else axis
    if not 0 <= start <= len(big) - len(small):
        ctx.fail(
            f"attribute axis={axis} cannot align a rank-{len(small)} operand inside a rank-{len(big)} one: "
            f"axis must be in [-1, rank(X) - rank(Y)] = [-1, {len(big) - len(small)}]"
        )
    padded = (1,) * start + tuple(small) + (1,) * (len(big) - len(small) - start)
    out = []
    for i, (a, b) in enumerate(zip(big, padded, strict=True)):
        d = broadcast_dim(a, b)
        if d is None:
            ctx.fail(
                f"shapes {list(x)} and {list(y)} do not broadcast (dimension {i}: {a} vs {b}, axis {axis})"
            )
        out.append(d)
    return tuple(out)


def normalize_axis(axis: int, rank: int, ctx: InferContext, what: str = "axis") -> int:
    if not -rank <= axis < max(rank, 1):
        ctx.fail(f"{what} {axis} is out of range for rank {rank}")
    return axis + rank if axis < 0 else axis
