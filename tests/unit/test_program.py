"""The Python IR: Program, Block, Variable, Parameter, Operator, names and guards."""

from __future__ import annotations

import pytest

import fluidps
from fluidps import layers
from fluidps.ir.types import AttrType, OpRole, VarType
from helpers import build_mlp


def test_blocks_and_sub_blocks():
    program = fluidps.Program()
    assert program.num_blocks == 1
    assert program.global_block() is program.block(0)
    assert program.global_block().parent_idx == -1
    sub = program.create_block()
    assert (sub.idx, sub.parent_idx) == (1, 0)
    assert program.current_block() is sub
    nested = program.create_block()
    assert nested.parent_idx == 1
    program.rollback()
    program.rollback()
    assert program.current_block() is program.global_block()
    with pytest.raises(fluidps.ProgramError, match="no block 7"):
        program.block(7)


def test_variables_resolve_through_parent_blocks():
    program = fluidps.Program()
    g = program.global_block()
    w = g.create_var("w", shape=[2, 3], dtype="float32", persistable=True)
    sub = program.create_block()
    local = sub.create_var("local", shape=[1], dtype="int64")
    assert sub.find_var("w") is w
    assert sub.var_recursive("local") is local
    assert g.find_var("local") is None
    assert not sub.has_var("w")
    with pytest.raises(fluidps.ProgramError, match="block 1 has no variable 'w'"):
        sub.var("w")
    assert w.shape == (2, 3) and w.dtype == VarType.FP32 and w.type == VarType.LOD_TENSOR


def test_create_var_is_idempotent_but_checks_contradictions():
    block = fluidps.Program().global_block()
    v = block.create_var("v", shape=[4], dtype="float32")
    assert block.create_var("v") is v
    assert block.create_var("v", shape=[4], dtype="float32") is v
    with pytest.raises(fluidps.ProgramError, match="dtype FP32, not INT64"):
        block.create_var("v", dtype="int64")
    with pytest.raises(fluidps.ProgramError, match="shape"):
        block.create_var("v", shape=[5])
    with pytest.raises(fluidps.ProgramError, match="unsupported dtype"):
        block.create_var("u", dtype="float128")


def test_operator_slots_and_attributes():
    block = fluidps.Program().global_block()
    x = block.create_var("x", shape=[2, 3], dtype="float32")
    # The Operator object itself, so a raw op: no defaults filled, no schema checks.
    op = block._append_op_unchecked(
        "scale", {"X": x}, {"Out": ["y"]}, {"scale": 0.1, "bias_after_scale": True}
    )
    assert op.input("X") == ["x"] and op.output("Out") == ["y"]
    assert op.input_names == ["X"] and op.output_names == ["Out"]
    assert op.input("Missing") == []
    assert op.attr_names == ["bias_after_scale", "scale"]
    # FLOAT attributes hold what the wire carries: float32.
    assert op.attr("scale") == pytest.approx(0.1) and op.attr("scale") != 0.1
    assert op.attr_type("scale") == AttrType.FLOAT
    assert op.has_attr("scale") and not op.has_attr("bias")
    with pytest.raises(fluidps.ProgramError, match="has no attribute 'bias'"):
        op.attr("bias")
    op.set_attr("dims", [1, 2])
    assert op.attr_type("dims") == AttrType.INTS
    op.set_attr("big", [2**40])
    assert op.attr_type("big") == AttrType.LONGS and op.attr("big") == [2**40]
    with pytest.raises(fluidps.ProgramError, match="out of range"):
        op.set_attr("dims", [2**40])  # keeps its INTS type
    with pytest.raises(fluidps.ProgramError, match="empty list"):
        op.set_attr("empty", [])
    op.set_attr("empty", [], AttrType.STRINGS)
    assert op.attr("empty") == []
    op.rename_input("x", "x2")
    assert op.input("X") == ["x2"]
    assert op.idx == 0


def test_insert_remove_and_revision():
    program = fluidps.Program()
    block = program.global_block()
    for name in ("x", "a", "b", "c"):
        block.create_var(name, shape=[2], dtype="float32")
    start = program.revision
    append_op = fluidps.op_registry.append_op
    a = append_op(block, "assign", {"X": ["x"]}, {"Out": ["a"]})
    b = append_op(block, "assign", {"X": ["x"]}, {"Out": ["b"]}, index=0)
    c = append_op(block, "assign", {"X": ["x"]}, {"Out": ["c"]}, index=1)
    assert block.ops == [b, c, a]
    with pytest.raises(fluidps.ProgramError, match="cannot insert an op at 4"):
        append_op(block, "assign", {"X": ["x"]}, {"Out": ["c"]}, index=4)
    assert block.remove_op(1) is c
    assert block.ops == [b, a]
    assert program.revision > start
    before = program.revision
    a.set_attr("note", "changed")
    assert program.revision == before + 1
    with pytest.raises(fluidps.ProgramError, match="no op at 5"):
        block.remove_op(5)


def test_block_attributes_are_indices_resolved_to_blocks():
    program = fluidps.Program()
    sub = program.create_block()
    program.rollback()
    # fluidps does not define `while`: only a raw op can stand for it.
    op = program.global_block()._append_op_unchecked("while", attrs={"sub_block": sub})
    assert op.attr_type("sub_block") == AttrType.BLOCK
    assert op.attr("sub_block") == 1
    assert op.block_attr("sub_block") is sub
    op.set_attr("blocks", [sub], AttrType.BLOCKS)
    assert op.blocks_attr("blocks") == [sub]


def test_fluid_names_and_parameters():
    main, startup, loss = build_mlp()
    names = [p.name for p in main.all_parameters()]
    assert names == ["fc_0.w_0", "fc_0.b_0", "fc_1.w_0", "fc_1.b_0", "fc_2.w_0", "fc_2.b_0"]
    assert [p.name for p in startup.all_parameters()] == names
    assert all(p.persistable and p.trainable for p in main.all_parameters())
    # fc lowers to mul, elementwise_add, relu: fc_0.tmp_0 .. fc_0.tmp_2.
    assert [op.output_arg_names for op in main.global_block().ops[:3]] == [
        ["fc_0.tmp_0"],
        ["fc_0.tmp_1"],
        ["fc_0.tmp_2"],
    ]
    assert loss.name == "mean_0.tmp_0"
    assert {v.name for v in main.list_vars()} >= {"x", "y", "fc_0.w_0", "mean_0.tmp_0"}


def test_unique_names_avoid_parsed_names():
    main, startup, _ = build_mlp()
    reloaded = fluidps.Program.parse_from_string(main.serialize_to_string())
    assert reloaded.unique_name("fc") == "fc_3"
    with fluidps.program_guard(reloaded, startup):
        out = layers.fc(reloaded.global_block().var("x"), 4)
    assert out.name.startswith("fc_4.")


def test_clone_is_deep():
    main, _, _ = build_mlp()
    clone = main.clone()
    assert clone.serialize_to_string() == main.serialize_to_string()
    clone.global_block().ops[0].set_attr("x_num_col_dims", 1)
    clone.global_block().var("x").shape = (-1, 3)
    assert main.global_block().var("x").shape == (-1, 64)
    assert clone.global_block().ops[0].block is clone.global_block()
    assert isinstance(clone.global_block().var("fc_0.w_0"), fluidps.Parameter)


def test_clone_for_test_drops_training_ops():
    main = fluidps.Program()
    block = main.global_block()
    for name in ("x", "w", "w@GRAD", "out"):
        block.create_var(name, shape=[2], dtype="float32", persistable=name == "w")
    block.create_var("lr", shape=[1], dtype="float32", persistable=True)
    append_op = fluidps.op_registry.append_op
    append_op(block, "elementwise_mul", {"X": "x", "Y": "w"}, {"Out": "out"}, {"op_role": 0})
    append_op(block, "dropout", {"X": "out"}, {"Out": "out"}, {"is_test": False, "op_role": 0})
    backward = int(OpRole.Backward | OpRole.Loss)
    append_op(
        block, "fill_constant", {}, {"Out": "w@GRAD"}, {"shape": [2], "value": 1.0, "op_role": backward}
    )
    append_op(
        block,
        "sgd",
        {"Param": "w", "Grad": "w@GRAD", "LearningRate": "lr"},
        {"ParamOut": "w"},
        {"op_role": 2},
    )
    test = main.clone(for_test=True)
    assert [op.type for op in test.global_block().ops] == ["elementwise_mul", "dropout"]
    assert test.global_block().ops[1].attr("is_test") is True
    assert "w@GRAD" not in test.global_block().vars
    assert "w" in test.global_block().vars
    assert len(main.global_block().ops) == 4


def test_program_guard_nests_and_requires_programs():
    outer, inner = fluidps.Program(), fluidps.Program()
    with pytest.raises(fluidps.BuilderError, match="program_guard"):
        layers.data("x", [3])
    with fluidps.program_guard(outer):
        with fluidps.program_guard(inner):
            layers.data("a", [3])
        layers.data("b", [3])
        with pytest.raises(fluidps.BuilderError, match="startup program"):
            layers.fc(outer.global_block().var("b"), 2)
    assert "a" in inner.global_block().vars and "a" not in outer.global_block().vars
    assert "b" in outer.global_block().vars
    with pytest.raises(fluidps.BuilderError, match="needs a Program"), fluidps.program_guard("main"):
        pass


def test_str_lists_blocks_vars_and_ops():
    main, _, _ = build_mlp()
    text = str(main)
    assert text.startswith("program: 1 block, ")
    assert "fc_0.w_0" in text and "parameter" in text
    assert "#0  mul  [forward]" in text
    assert "in:    X=x  Y=fc_0.w_0" in text
