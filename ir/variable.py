"""Variables: the named values of a block, as `VarDesc` describes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fluidps.ir.tracked import TouchOnAssign
from fluidps.ir.types import TENSOR_KINDS, VarType, dtype_name

if TYPE_CHECKING:
    from fluidps.ir.program import Block


class Variable(TouchOnAssign):
    """A named value declared in a block.

    `shape` uses -1 for a dimension not known until run time (usually the
    batch); `dtype` is the element type of tensor kinds (None for others).
    `stop_gradient` tells autodiff not to propagate through the variable.
    Assigning any of these is an edit of the program (its `revision` grows).
    """

    _OWNER_ATTR = "block"

    block: Block
    name: str
    type: VarType
    dtype: VarType | None
    shape: tuple[int, ...] | None
    lod_level: int
    persistable: bool
    stop_gradient: bool
    need_check_feed: bool

    def __init__(
        self,
        block: Block,
        name: str,
        *,
        type: VarType = VarType.LOD_TENSOR,
        dtype: VarType | None = None,
        shape: tuple[int, ...] | list[int] | None = None,
        lod_level: int = 0,
        persistable: bool = False,
        stop_gradient: bool = False,
        need_check_feed: bool = False,
    ):
        # Into __dict__, past __setattr__: building a variable is no edit (see TouchOnAssign).
        self.__dict__.update(
            block=block,
            name=name,
            type=VarType(type),
            dtype=None if dtype is None else VarType(dtype),
            shape=None if shape is None else tuple(int(d) for d in shape),
            lod_level=int(lod_level),
            persistable=bool(persistable),
            stop_gradient=bool(stop_gradient),
            need_check_feed=bool(need_check_feed),
            # Serialized VarDesc fields fluidps does not model, kept for round trips.
            _extra=b"",
        )

    @property
    def is_tensor(self) -> bool:
        """True for the kinds that carry an element type and a shape."""
        return self.type in TENSOR_KINDS

    @property
    def is_parameter(self) -> bool:
        return False

    def _copy_to(self, block: Block) -> Variable:
        clone = Variable.__new__(type(self))
        clone.__dict__.update(self.__dict__, block=block)
        return clone

    def _touch(self) -> None:
        if self.block is not None:
            self.block.program._touch()

    def __repr__(self) -> str:
        kind = "" if self.type == VarType.LOD_TENSOR else f", {self.type.name}"
        shape = "" if self.shape is None else f", shape={list(self.shape)}"
        flags = ", persistable" if self.persistable else ""
        return f"{type(self).__name__}({self.name}{shape}, {dtype_name(self.dtype)}{kind}{flags})"


class Parameter(Variable):
    """A persistable, trainable variable created by a layer.

    `initializer`, `regularizer`, `learning_rate` (a multiplier of the
    optimizer's rate) and `gradient_clip` are read by the builder and the
    optimizers; they live in Python only, as in Fluid, because the startup
    program already holds the initializer op.
    """

    def __init__(
        self,
        block: Block,
        name: str,
        *,
        shape: tuple[int, ...] | list[int],
        dtype: VarType,
        trainable: bool = True,
        initializer: Any = None,
        regularizer: Any = None,
        learning_rate: float = 1.0,
        gradient_clip: Any = None,
        type: VarType = VarType.LOD_TENSOR,
        stop_gradient: bool | None = None,
        lod_level: int = 0,
    ):
        super().__init__(
            block,
            name,
            type=type,
            dtype=dtype,
            shape=shape,
            lod_level=lod_level,
            persistable=True,
            stop_gradient=(not trainable) if stop_gradient is None else stop_gradient,
        )
        self.__dict__.update(
            trainable=bool(trainable),
            initializer=initializer,
            regularizer=regularizer,
            learning_rate=float(learning_rate),
            gradient_clip=gradient_clip,
        )

    @property
    def is_parameter(self) -> bool:
        return True
