"""Operators: one `OpDesc` each, its slots holding variable names."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fluidps.errors import ProgramError
from fluidps.ir.attrs import infer_attr_type, normalize_attr
from fluidps.ir.tracked import TouchOnAssign
from fluidps.ir.types import AttrType

if TYPE_CHECKING:
    from fluidps.ir.program import Block

# What a slot may be given: a name, a Variable, or a list of either.
SlotArgs = Any


def arg_names(args: SlotArgs) -> list[str]:
    """Normalize a slot's arguments (names, Variables, or a list of them) to names."""
    if args is None:
        return []
    if isinstance(args, str) or hasattr(args, "name"):
        args = [args]
    names = []
    for a in args:
        name = a if isinstance(a, str) else getattr(a, "name", None)
        if not isinstance(name, str):
            raise ProgramError(f"slot argument {a!r} is neither a variable name nor a Variable")
        names.append(name)
    return names


def _slots(mapping: Mapping[str, SlotArgs] | None) -> dict[str, list[str]]:
    return {slot: arg_names(args) for slot, args in (mapping or {}).items()}


class Operator(TouchOnAssign):
    """An op in a block: `type`, named input and output slots, typed attributes.

    Slots map a slot name (`X`, `Out@GRAD`) to a list of variable names; an
    absent or empty slot means "not given". Attributes keep their AttrType so
    they serialize exactly as they were declared or parsed. The setters, and
    assigning `type` or `is_target`, are edits of the program (its `revision` grows).
    """

    _OWNER_ATTR = "block"

    block: Block | None
    type: str
    is_target: bool
    _attrs: dict[str, tuple[AttrType, Any]]

    def __init__(
        self,
        block: Block | None,
        type: str,
        inputs: Mapping[str, SlotArgs] | None = None,
        outputs: Mapping[str, SlotArgs] | None = None,
        attrs: Mapping[str, Any] | None = None,
        attr_types: Mapping[str, AttrType] | None = None,
    ):
        if not isinstance(type, str) or not type:
            raise ProgramError(f"op type must be a non-empty string, got {type!r}")
        # Into __dict__, past __setattr__: building an op is no edit (see TouchOnAssign).
        self.__dict__.update(
            block=block,
            type=type,
            is_target=False,
            _inputs=_slots(inputs),
            _outputs=_slots(outputs),
            _attrs={},
            # Serialized OpDesc fields fluidps does not model, kept for round trips.
            _extra=b"",
        )
        types = dict(attr_types or {})
        for name, value in (attrs or {}).items():
            self._put_attr(name, value, types.get(name))

    # -- slots -------------------------------------------------------------------------

    @property
    def input_names(self) -> list[str]:
        """Names of the input slots this op has."""
        return list(self._inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def input(self, slot: str) -> list[str]:
        """Variable names in an input slot ([] when the slot is absent)."""
        return list(self._inputs.get(slot, ()))

    def output(self, slot: str) -> list[str]:
        return list(self._outputs.get(slot, ()))

    @property
    def inputs(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._inputs.items()}

    @property
    def outputs(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._outputs.items()}

    @property
    def input_arg_names(self) -> list[str]:
        """Every variable name read, in slot order."""
        return [n for args in self._inputs.values() for n in args]

    @property
    def output_arg_names(self) -> list[str]:
        return [n for args in self._outputs.values() for n in args]

    def set_input(self, slot: str, args: SlotArgs) -> None:
        self._inputs[slot] = arg_names(args)
        self._touch()

    def set_output(self, slot: str, args: SlotArgs) -> None:
        self._outputs[slot] = arg_names(args)
        self._touch()

    def rename_input(self, old: str, new: str) -> None:
        """Replace every read of `old` by `new`."""
        for args in self._inputs.values():
            args[:] = [new if a == old else a for a in args]
        self._touch()

    # -- attributes ----------------------------------------------------------------------

    @property
    def attr_names(self) -> list[str]:
        return sorted(self._attrs)

    def has_attr(self, name: str) -> bool:
        return name in self._attrs

    def attr(self, name: str) -> Any:
        """An attribute's value; BLOCK / BLOCKS attributes give block indices."""
        if name not in self._attrs:
            raise ProgramError(f"op {self.type!r} has no attribute {name!r}; it has {self.attr_names}")
        value = self._attrs[name][1]
        return list(value) if isinstance(value, list) else value

    def attr_type(self, name: str) -> AttrType:
        self.attr(name)  # raises with the available names when missing
        return self._attrs[name][0]

    def all_attrs(self) -> dict[str, Any]:
        return {name: self.attr(name) for name in self.attr_names}

    def set_attr(self, name: str, value: Any, attr_type: AttrType | None = None) -> None:
        """Set an attribute. Its type is `attr_type`, else the type it already has,
        else the type its Python value implies."""
        self._put_attr(name, value, attr_type)
        self._touch()

    def remove_attr(self, name: str) -> None:
        """Drop an attribute (one its op type does not define, after an edit of `type`)."""
        self.attr(name)  # raises with the available names when missing
        del self._attrs[name]
        self._touch()

    def block_attr(self, name: str) -> Block:
        """The sub-block a BLOCK attribute refers to."""
        return self._program_block(self.attr(name))

    def blocks_attr(self, name: str) -> list[Block]:
        return [self._program_block(i) for i in self.attr(name)]

    def _put_attr(self, name: str, value: Any, attr_type: AttrType | None) -> None:
        if not isinstance(name, str) or not name:
            raise ProgramError(f"op {self.type!r}: attribute names must be non-empty strings")
        if attr_type is None:
            attr_type = self._attrs[name][0] if name in self._attrs else infer_attr_type(name, value)
        try:
            self._attrs[name] = (AttrType(attr_type), normalize_attr(name, attr_type, value))
        except ProgramError as e:
            raise ProgramError(f"op {self.type!r}: {e}") from None

    def _program_block(self, idx: int) -> Block:
        if self.block is None:
            raise ProgramError(f"op {self.type!r} is not in a program; it has no sub-blocks")
        return self.block.program.block(idx)

    # -- identity ----------------------------------------------------------------------

    @property
    def idx(self) -> int:
        """Position of this op in its block."""
        if self.block is None:
            raise ProgramError(f"op {self.type!r} is not in a block")
        for i, op in enumerate(self.block.ops):
            if op is self:
                return i
        raise ProgramError(f"op {self.type!r} was removed from its block")

    def _touch(self) -> None:
        if self.block is not None:
            self.block.program._touch()

    def _copy_to(self, block: Block) -> Operator:
        clone = Operator.__new__(Operator)
        clone.__dict__.update(
            block=block,
            type=self.type,
            _inputs={k: list(v) for k, v in self._inputs.items()},
            _outputs={k: list(v) for k, v in self._outputs.items()},
            _attrs={k: (t, list(v) if isinstance(v, list) else v) for k, (t, v) in self._attrs.items()},
            is_target=self.is_target,
            _extra=self._extra,
        )
        return clone

    def __repr__(self) -> str:
        def slots(m: dict[str, list[str]]) -> str:
            return ", ".join(f"{k}={v}" for k, v in sorted(m.items()))

        return f"{{{slots(self._outputs)}}} = {self.type}({slots(self._inputs)})"
