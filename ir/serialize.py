"""The one place where protobuf messages and Python IR objects meet.

Parsing keeps every field fluidps does not model: each object stores the
serialized remainder of its message (`_extra`), and writing merges it back, so
a program from a newer Paddle survives a parse/serialize round trip.

Writing is deterministic: variables sorted by name (as Paddle writes them),
slots and attributes sorted by name, so the same program gives the same bytes.
"""

from __future__ import annotations

from google.protobuf.message import DecodeError, Message

from fluidps.errors import ProgramError, ProgramParseError
from fluidps.ir import framework_pb2 as pb
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.types import AttrType, VarType
from fluidps.ir.variable import Parameter, Variable

# -- bytes <-> messages -----------------------------------------------------------------


def parse_program(data: bytes) -> Program:
    """Parse serialized ProgramDesc bytes; anything malformed raises ProgramParseError."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProgramParseError(f"expected the bytes of a ProgramDesc, got {type(data).__name__}")
    msg = pb.ProgramDesc()
    try:
        msg.ParseFromString(bytes(data))
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ProgramParseError(f"not a ProgramDesc ({len(data)} bytes): {e}") from None
    return program_from_proto(msg)


def serialize_program(program: Program) -> bytes:
    return program_to_proto(program).SerializeToString(deterministic=True)


# -- message -> Python ------------------------------------------------------------------


def _text(value, where: str) -> str:
    """A proto2 string field; protobuf hands back bytes when they are not UTF-8."""
    if not isinstance(value, str):
        raise ProgramParseError(f"{where}: {bytes(value)[:40]!r} is not valid UTF-8 text")
    return value


def program_from_proto(msg: pb.ProgramDesc) -> Program:
    if not msg.blocks:
        raise ProgramParseError("ProgramDesc has no blocks (is this really a program file?)")
    program = Program()
    blocks = []
    for i, b in enumerate(msg.blocks):
        if b.HasField("idx") and b.idx != i:
            raise ProgramParseError(f"block at position {i} says its idx is {b.idx}")
        default_parent = -1 if i == 0 else 0
        block = Block(program, i, b.parent_idx if b.HasField("parent_idx") else default_parent)
        block.forward_block_idx = b.forward_block_idx
        blocks.append(block)
        # Filled as plain containers and handed over once: each tracked mutation costs a call.
        variables: dict[str, Variable] = {}
        for v in b.vars:
            var = _var_from_proto(block, v)
            if var.name in variables:
                raise ProgramParseError(f"block {i} declares variable {var.name!r} twice")
            variables[var.name] = var
            program._names.reserve(var.name)
        block.vars = variables
        block.ops = [_op_from_proto(block, o, f"block {i}, op {j}") for j, o in enumerate(b.ops)]
        block._extra = _residual(b, ["idx", "parent_idx", "vars", "ops", "forward_block_idx"])
    program.blocks = blocks
    if msg.HasField("version"):
        program.format_version = msg.version.version
    program._extra = _residual(msg, ["blocks", "version"])
    if not any(v.is_parameter for v in program.list_vars()):
        _mark_fluid1_parameters(program)
    program._revision = 0  # a parsed program is a new one, not an edited one
    return program


def _tensor_desc(t: pb.VarType) -> tuple[pb.VarType.TensorDesc | None, int]:
    """The TensorDesc and lod level of a variable type, for the kinds that have them."""
    if t.type == VarType.LOD_TENSOR and t.HasField("lod_tensor"):
        return (t.lod_tensor.tensor if t.lod_tensor.HasField("tensor") else None), t.lod_tensor.lod_level
    if t.type == VarType.LOD_TENSOR_ARRAY and t.HasField("tensor_array"):
        arr = t.tensor_array
        return (arr.tensor if arr.HasField("tensor") else None), arr.lod_level
    if t.type == VarType.SELECTED_ROWS and t.HasField("selected_rows"):
        return t.selected_rows, 0
    return None, 0


def _var_from_proto(block: Block, v: pb.VarDesc) -> Variable:
    where = f"block {block.idx}"
    if not _text(v.name, f"{where}: a variable name"):
        raise ProgramParseError(f"{where}: a VarDesc has no name")
    if not v.HasField("type") or not v.type.HasField("type"):
        raise ProgramParseError(
            f"{where}: variable {v.name!r} has no type, or one fluidps does not know "
            "(written by a newer Paddle?)"
        )
    desc, lod_level = _tensor_desc(v.type)
    dtype = VarType(desc.data_type) if desc is not None and desc.HasField("data_type") else None
    shape = tuple(desc.dims) if desc is not None else None
    common = dict(type=VarType(v.type.type), lod_level=lod_level, stop_gradient=v.stop_gradient)
    if v.is_parameter:
        var: Variable = Parameter(
            block, v.name, shape=shape or (), dtype=dtype, trainable=not v.stop_gradient, **common
        )
        var.shape = shape
        var.persistable = v.persistable
    else:
        var = Variable(
            block,
            v.name,
            dtype=dtype,
            shape=shape,
            persistable=v.persistable,
            need_check_feed=v.need_check_feed,
            **common,
        )
    rest = pb.VarDesc()
    rest.CopyFrom(v)
    for field in ("name", "persistable", "need_check_feed", "is_parameter", "stop_gradient"):
        rest.ClearField(field)
    t = rest.type
    t.ClearField("type")
    for holder in (t.lod_tensor, t.tensor_array):
        holder.ClearField("lod_level")
        holder.tensor.ClearField("data_type")
        holder.tensor.ClearField("dims")
    t.selected_rows.ClearField("data_type")
    t.selected_rows.ClearField("dims")
    var._extra = _strip_empty(rest).SerializeToString(deterministic=True)
    return var


def _op_from_proto(block: Block, o: pb.OpDesc, where: str) -> Operator:
    if not _text(o.type, f"{where}: an op type"):
        raise ProgramParseError(f"{where}: an OpDesc has no type")
    where = f"{where} ({o.type})"
    inputs = _slots_from_proto(o.inputs, where, "input")
    outputs = _slots_from_proto(o.outputs, where, "output")
    op = Operator(block, o.type, inputs, outputs)
    for a in o.attrs:
        if not _text(a.name, f"{where}: an attribute name"):
            raise ProgramParseError(f"{where}: an attribute has no name")
        if not a.HasField("type"):
            raise ProgramParseError(
                f"{where}: attribute {a.name!r} has no type, or one fluidps does not know "
                "(written by a newer Paddle?)"
            )
        # Paddle writes some attributes twice (once as an op attribute, once as
        # a runtime one); its loader keeps the last, and so do we.
        try:
            op._put_attr(a.name, _attr_value(a, f"{where}: attribute {a.name!r}"), AttrType(a.type))
        except ProgramError as e:
            raise ProgramParseError(f"{where}: {e}") from None
    op.is_target = o.is_target
    op._extra = _residual(o, ["type", "inputs", "outputs", "attrs", "is_target"])
    return op


def _slots_from_proto(vars_, where: str, kind: str) -> dict[str, list[str]]:
    slots: dict[str, list[str]] = {}
    for var in vars_:
        if not _text(var.parameter, f"{where}: an {kind} slot name"):
            raise ProgramParseError(f"{where}: an {kind} slot has no name")
        if var.parameter in slots:
            raise ProgramParseError(f"{where}: {kind} slot {var.parameter!r} appears twice")
        slots[var.parameter] = [_text(a, f"{where}: {kind} {var.parameter}") for a in var.arguments]
    return slots


def _scalar_value(s: pb.Scalar):
    if s.type == pb.Scalar.BOOLEAN:
        return s.b
    if s.type == pb.Scalar.LONG:
        return s.i
    if s.type == pb.Scalar.COMPLEX128:
        return complex(s.c.r, s.c.i)
    return s.r


_ATTR_FIELD = {
    AttrType.INT: "i",
    AttrType.FLOAT: "f",
    AttrType.STRING: "s",
    AttrType.INTS: "ints",
    AttrType.FLOATS: "floats",
    AttrType.STRINGS: "strings",
    AttrType.BOOLEAN: "b",
    AttrType.BOOLEANS: "bools",
    AttrType.BLOCK: "block_idx",
    AttrType.LONG: "l",
    AttrType.BLOCKS: "blocks_idx",
    AttrType.LONGS: "longs",
    AttrType.FLOAT64S: "float64s",
    AttrType.VAR: "var_name",
    AttrType.VARS: "vars_name",
    AttrType.FLOAT64: "float64",
}


_TEXT_ATTRS = (AttrType.STRING, AttrType.STRINGS, AttrType.VAR, AttrType.VARS)


def _attr_value(a: pb.OpDesc.Attr, where: str):
    t = AttrType(a.type)
    if t == AttrType.SCALAR:
        return _scalar_value(a.scalar)
    if t == AttrType.SCALARS:
        return [_scalar_value(s) for s in a.scalars]
    value = getattr(a, _ATTR_FIELD[t])
    if t in _TEXT_ATTRS:
        return _text(value, where) if isinstance(value, (str, bytes)) else [_text(v, where) for v in value]
    return list(value) if hasattr(value, "__len__") else value


def _mark_fluid1_parameters(program: Program) -> None:
    """Fluid 1.x did not write `is_parameter`. There, the variables an optimizer
    updates (its `Param` slot) are the trainable parameters."""
    updated = {n for b in program.blocks for op in b.ops for n in op.input("Param")}
    block = program.global_block()
    for name in sorted(updated):
        var = block.vars.get(name)
        if var is None or not var.persistable or var.shape is None or var.dtype is None:
            continue
        param = Parameter(block, name, shape=var.shape, dtype=var.dtype, type=var.type, stop_gradient=False)
        param._extra = var._extra
        block.vars[name] = param


# -- Python -> message ------------------------------------------------------------------


def program_to_proto(program: Program) -> pb.ProgramDesc:
    msg = pb.ProgramDesc()
    for block in program.blocks:
        b = msg.blocks.add()
        b.idx = block.idx
        b.parent_idx = block.parent_idx
        for name in sorted(block.vars):
            _var_to_proto(block.vars[name], b.vars.add())
        for op in block.ops:
            _op_to_proto(op, b.ops.add())
        if block.forward_block_idx != -1:
            b.forward_block_idx = block.forward_block_idx
        b.MergeFromString(block._extra)
    msg.version.version = program.format_version
    msg.MergeFromString(program._extra)
    return msg


def _var_to_proto(var: Variable, v: pb.VarDesc) -> None:
    v.name = var.name
    v.type.type = var.type
    desc = None
    if var.type == VarType.LOD_TENSOR:
        v.type.lod_tensor.lod_level = var.lod_level
        desc = v.type.lod_tensor.tensor
    elif var.type == VarType.LOD_TENSOR_ARRAY:
        v.type.tensor_array.lod_level = var.lod_level
        desc = v.type.tensor_array.tensor
    elif var.type == VarType.SELECTED_ROWS:
        desc = v.type.selected_rows
    if desc is not None:
        if var.dtype is not None:
            desc.data_type = var.dtype
        if var.shape is not None:
            desc.dims.extend(var.shape)
    v.persistable = var.persistable
    if var.need_check_feed:
        v.need_check_feed = True
    if var.is_parameter:
        v.is_parameter = True
    v.stop_gradient = var.stop_gradient
    v.MergeFromString(var._extra)


def _op_to_proto(op: Operator, o: pb.OpDesc) -> None:
    o.type = op.type
    for slot, args in sorted(op.inputs.items()):
        o.inputs.add(parameter=slot, arguments=args)
    for slot, args in sorted(op.outputs.items()):
        o.outputs.add(parameter=slot, arguments=args)
    for name in op.attr_names:
        _attr_to_proto(name, op.attr_type(name), op.attr(name), o.attrs.add())
    if op.is_target:
        o.is_target = True
    o.MergeFromString(op._extra)


def _set_scalar(s: pb.Scalar, value) -> None:
    if isinstance(value, bool):
        s.type, s.b = pb.Scalar.BOOLEAN, value
    elif isinstance(value, int):
        s.type, s.i = pb.Scalar.LONG, value
    elif isinstance(value, complex):
        s.type = pb.Scalar.COMPLEX128
        s.c.r, s.c.i = value.real, value.imag
    else:
        s.type, s.r = pb.Scalar.FLOAT64, value


def _attr_to_proto(name: str, attr_type: AttrType, value, a: pb.OpDesc.Attr) -> None:
    a.name = name
    a.type = attr_type
    if attr_type == AttrType.SCALAR:
        _set_scalar(a.scalar, value)
    elif attr_type == AttrType.SCALARS:
        for v in value:
            _set_scalar(a.scalars.add(), v)
    elif isinstance(value, list):
        getattr(a, _ATTR_FIELD[attr_type]).extend(value)
    else:
        setattr(a, _ATTR_FIELD[attr_type], value)


# -- residuals --------------------------------------------------------------------------


def _residual(msg: Message, modelled: list[str]) -> bytes:
    """The serialized part of `msg` outside the fields fluidps models."""
    rest = type(msg)()
    rest.CopyFrom(msg)
    for field in modelled:
        rest.ClearField(field)
    return rest.SerializeToString(deterministic=True)


def _strip_empty(msg: Message) -> Message:
    """Clear sub-messages that clearing the modelled fields left empty."""
    for field, value in list(msg.ListFields()):
        if field.message_type is not None and not field.is_repeated:
            _strip_empty(value)
            if value.ByteSize() == 0:
                msg.ClearField(field.name)
    return msg
