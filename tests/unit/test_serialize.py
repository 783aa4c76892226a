"""Serialization: byte-identical round trips, determinism, and hostile bytes."""

from __future__ import annotations

import contextlib

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import fluidps
from fluidps.ir import framework_pb2 as pb
from fluidps.ir.printer import program_to_dict, program_to_text
from fluidps.ir.types import AttrType
from helpers import build_every_layer, build_mlp, paddle_fixture


def _round_trip(program: fluidps.Program) -> bytes:
    data = program.serialize_to_string()
    again = fluidps.Program.parse_from_string(data).serialize_to_string()
    assert again == data
    return data


def test_every_layer_round_trips_byte_identical():
    main, startup = build_every_layer()
    _round_trip(main)
    _round_trip(startup)
    parsed = fluidps.Program.parse_from_string(main.serialize_to_string())
    assert [op.type for op in parsed.global_block().ops] == [op.type for op in main.global_block().ops]
    for before, after in zip(main.global_block().ops, parsed.global_block().ops, strict=True):
        assert before.inputs == after.inputs and before.outputs == after.outputs
        assert before.all_attrs() == after.all_attrs()
    for name, var in main.global_block().vars.items():
        other = parsed.global_block().var(name)
        assert (var.shape, var.dtype, var.type, var.persistable, var.is_parameter) == (
            other.shape,
            other.dtype,
            other.type,
            other.persistable,
            other.is_parameter,
        )


def test_building_twice_gives_the_same_bytes():
    first = [p.serialize_to_string() for p in build_every_layer()]
    second = [p.serialize_to_string() for p in build_every_layer()]
    assert first == second


def test_attributes_and_slots_are_written_sorted():
    main, _, _ = build_mlp()
    msg = pb.ProgramDesc()
    msg.ParseFromString(main.serialize_to_string())
    for op in msg.blocks[0].ops:
        names = [a.name for a in op.attrs]
        assert names == sorted(names)
        assert [v.parameter for v in op.inputs] == sorted(v.parameter for v in op.inputs)
    assert [v.name for v in msg.blocks[0].vars] == sorted(v.name for v in msg.blocks[0].vars)


def test_sub_blocks_and_every_attribute_type_round_trip():
    program = fluidps.Program()
    block = program.global_block()
    sub = program.create_block()
    sub.create_var("inner", shape=[3], dtype="int32")
    program.rollback()
    values = {
        "i": (AttrType.INT, -7),
        "f": (AttrType.FLOAT, 0.25),
        "s": (AttrType.STRING, "héllo"),
        "ints": (AttrType.INTS, [1, -2]),
        "floats": (AttrType.FLOATS, [0.5, 1.5]),
        "strings": (AttrType.STRINGS, ["a", "b"]),
        "b": (AttrType.BOOLEAN, True),
        "bools": (AttrType.BOOLEANS, [True, False]),
        "blk": (AttrType.BLOCK, 1),
        "l": (AttrType.LONG, 2**40),
        "blks": (AttrType.BLOCKS, [1]),
        "longs": (AttrType.LONGS, [2**40, -1]),
        "f64s": (AttrType.FLOAT64S, [0.1, 0.2]),
        "var": (AttrType.VAR, "inner"),
        "vars": (AttrType.VARS, ["inner"]),
        "f64": (AttrType.FLOAT64, 0.1),
        "scalar": (AttrType.SCALAR, 3),
        "scalars": (AttrType.SCALARS, [True, 2.5, 1 + 2j]),
    }
    # An op of no known type, with one attribute of every type: only a raw op can be that.
    op = block._append_op_unchecked(
        "custom",
        attrs={k: v for k, (_, v) in values.items()},
        attr_types={k: t for k, (t, _) in values.items()},
    )
    op.is_target = True
    data = _round_trip(program)
    parsed = fluidps.Program.parse_from_string(data)
    assert parsed.num_blocks == 2 and parsed.block(1).parent_idx == 0
    parsed_op = parsed.global_block().ops[0]
    assert parsed_op.is_target
    for name, (attr_type, value) in values.items():
        assert parsed_op.attr_type(name) == attr_type
        assert parsed_op.attr(name) == value
    assert parsed_op.block_attr("blk") is parsed.block(1)


def test_float_attributes_store_their_float32_value():
    block = fluidps.Program().global_block()
    x, y = (block.create_var(name, shape=[2], dtype="float32") for name in ("x", "y"))
    op = fluidps.op_registry.append_op(block, "scale", {"X": x}, {"Out": y}, {"scale": 0.1})
    assert op.attr_type("scale") == AttrType.FLOAT
    assert op.attr("scale") == float(np.float32(0.1))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "no blocks"),
        (b"\xff\xff\xff", "not a ProgramDesc"),
        (b"hello world, not a program", "not a ProgramDesc"),
        ("text", "expected the bytes"),
    ],
)
def test_malformed_input_raises_parse_errors(data, message):
    with pytest.raises(fluidps.ProgramParseError, match=message):
        fluidps.Program.parse_from_string(data)


def test_truncated_program_is_rejected():
    data = build_mlp()[0].serialize_to_string()
    with pytest.raises(fluidps.ProgramParseError):
        fluidps.Program.parse_from_string(data[: len(data) // 2])


def test_missing_required_fields_are_named():
    msg = pb.ProgramDesc()
    block = msg.blocks.add(idx=0, parent_idx=-1)
    block.vars.add(name="x")  # no type
    with pytest.raises(fluidps.ProgramParseError, match="variable 'x' has no type"):
        fluidps.Program.parse_from_string(msg.SerializeToString())
    msg.blocks[0].ClearField("vars")
    msg.blocks[0].ops.add()  # no type
    with pytest.raises(fluidps.ProgramParseError, match="block 0, op 0: an OpDesc has no type"):
        fluidps.Program.parse_from_string(msg.SerializeToString())
    msg.blocks[0].ops[0].type = "relu"
    msg.blocks[0].ops[0].attrs.add(name="alpha")  # no type
    with pytest.raises(fluidps.ProgramParseError, match="attribute 'alpha' has no type"):
        fluidps.Program.parse_from_string(msg.SerializeToString())
    msg.blocks[0].ClearField("ops")
    msg.blocks.add(idx=5)
    with pytest.raises(fluidps.ProgramParseError, match="position 1 says its idx is 5"):
        fluidps.Program.parse_from_string(msg.SerializeToString())


def _exercise(data: bytes) -> None:
    """Parsing anything either fails with a fluidps.Error or gives a program
    that verify, the printers and the serializer all handle."""
    try:
        program = fluidps.Program.parse_from_string(data)
    except fluidps.Error:
        return
    assert isinstance(fluidps.check(program), list)
    program_to_text(program)
    program_to_dict(program)
    fluidps.Program.parse_from_string(program.serialize_to_string())


_SEEDS = [
    build_mlp()[0].serialize_to_string(),
    build_every_layer()[0].serialize_to_string(),
    (paddle_fixture("adam_sparse") / "main.pb").read_bytes(),
    (paddle_fixture("lenet_infer") / "model.pdmodel").read_bytes(),
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_random_bytes_raise_only_fluidps_errors(data):
    _exercise(data)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_programs_raise_only_fluidps_errors(data):
    raw = bytearray(data.draw(st.sampled_from(_SEEDS)))
    for _ in range(data.draw(st.integers(1, 8))):
        kind = data.draw(st.sampled_from(["flip", "delete", "insert", "truncate"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind == "flip" and raw:
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif kind == "delete" and raw:
            del raw[pos : pos + data.draw(st.integers(1, 16))]
        elif kind == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            del raw[pos:]
    _exercise(bytes(raw))


def _training_mlp() -> tuple[fluidps.Program, fluidps.Program]:
    main, startup, loss = build_mlp()
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.Adam(0.01).minimize(loss)
    return main, startup


_MLP_MAIN, _MLP_STARTUP = _training_mlp()
_MLP_FEED = {"x": np.ones((4, 64), np.float32), "y": np.zeros((4, 1), np.int64)}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_programs_run_or_fail_with_fluidps_errors(data):
    """A parseable mutation of a training program, run by the Executor (which verifies
    it first) on a real feed: it trains, or fails with a fluidps.Error, never numpy's or
    Python's own error and never a crash in a kernel."""
    raw = bytearray(_MLP_MAIN.serialize_to_string())
    for _ in range(data.draw(st.integers(1, 8))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        program = fluidps.Program.parse_from_string(bytes(raw))
    except fluidps.Error:
        return
    exe = fluidps.Executor()
    exe.run(_MLP_STARTUP)
    with contextlib.suppress(fluidps.Error):
        exe.run(program, feed=_MLP_FEED, fetch_list=[])
