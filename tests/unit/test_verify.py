"""verify(): each invariant caught, with messages naming block, op and variable."""

from __future__ import annotations

import pytest

import fluidps
from fluidps.ir.types import AttrType
from helpers import build_every_layer, build_mlp


def _problems(program: fluidps.Program) -> str:
    with pytest.raises(fluidps.VerifyError) as info:
        fluidps.verify(program)
    assert info.value.problems == fluidps.check(program)
    return "\n".join(info.value.problems)


def _tiny() -> fluidps.Program:
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("x", shape=[-1, 4], dtype="float32", need_check_feed=True)
    block.create_var("w", shape=[4, 3], dtype="float32", persistable=True)
    block.create_var("out", shape=[-1, 3], dtype="float32")
    attrs = {"x_num_col_dims": 1, "y_num_col_dims": 1}
    fluidps.op_registry.append_op(block, "mul", {"X": "x", "Y": "w"}, {"Out": "out"}, attrs)
    return program


def test_programs_built_by_fluidps_verify():
    for program in (*build_every_layer(), *build_mlp()[:2], _tiny()):
        fluidps.verify(program)
        assert fluidps.check(program) == []


def test_undefined_input():
    program = _tiny()
    program.global_block().ops[0].set_input("Y", ["nowhere"])
    assert "block 0, op #0 (mul): input Y reads 'nowhere', which no enclosing block declares" in _problems(
        program
    )


def test_undeclared_output():
    program = _tiny()
    program.global_block().ops[0].set_output("Out", ["ghost"])
    assert "output Out writes 'ghost', which no enclosing block declares" in _problems(program)


def test_read_before_write():
    program = _tiny()
    block = program.global_block()
    block.create_var("y", shape=[-1, 3], dtype="float32")
    fluidps.op_registry.append_op(block, "relu", {"X": "out"}, {"Out": "y"}, index=0)
    assert "op #0 (relu): input X reads 'out' before op #1 writes it" in _problems(program)


def test_unknown_op():
    program = _tiny()
    program.global_block()._append_op_unchecked("frobnicate", {"X": "x"}, {"Out": "out"})
    assert "block 0, op #1 (frobnicate): unknown op type 'frobnicate'" in _problems(program)


def test_wrong_slot():
    program = _tiny()
    program.global_block().ops[0].set_input("Z", ["x"])
    assert "has no input slot 'Z' (its input slots: X, Y)" in _problems(program)


def test_missing_and_overfull_slots():
    program = _tiny()
    op = program.global_block().ops[0]
    op.set_input("Y", [])
    op.set_output("Out", ["out", "out"])
    text = _problems(program)
    assert "input slot 'Y' is required but missing" in text
    assert "output slot 'Out' takes one variable, got 2" in text


def test_wrong_attribute_type():
    program = _tiny()
    program.global_block().ops[0].set_attr("x_num_col_dims", "one", AttrType.STRING)
    assert "attribute 'x_num_col_dims' has type STRING, expected INT" in _problems(program)


def test_int_and_long_are_interchangeable():
    program = _tiny()
    program.global_block().ops[0].set_attr("x_num_col_dims", 1, AttrType.LONG)
    fluidps.verify(program)


def test_unknown_attribute_and_unsupported_value():
    program = _tiny()
    op = program.global_block().ops[0]
    op.set_attr("fancy", True)
    op.set_attr("force_fp32_output", True, AttrType.BOOLEAN)
    text = _problems(program)
    assert "has attribute 'fancy' (BOOLEAN) that op 'mul' does not define" in text
    assert "attribute force_fp32_output=True asks for something fluidps does not implement" in text


def test_extra_slot_must_stay_empty():
    program = _tiny()
    block = program.global_block()
    block.create_var("lr", shape=[1], dtype="float32", persistable=True)
    block.create_var("master", shape=[4, 3], dtype="float32", persistable=True)
    # op_registry.append_op refuses the extra slot; only a raw op can carry it.
    block._append_op_unchecked(
        "sgd",
        {"Param": "w", "Grad": "w", "LearningRate": "lr", "MasterParam": "master"},
        {"ParamOut": "w"},
    )
    assert "input 'MasterParam' = ['master'] asks for a feature fluidps does not implement" in _problems(
        program
    )


def test_bad_block_indices():
    program = _tiny()
    program.create_block()
    program.create_block()
    program.rollback()
    program.rollback()
    program.block(1).parent_idx = 9
    program.block(2).parent_idx = 2
    program.global_block().forward_block_idx = 4
    text = _problems(program)
    assert "block 1: bad block index: parent_idx 9 (program has 3 blocks)" in text
    assert "block 2: bad block index: parent_idx 2" in text
    assert "block 0: bad block index: forward_block_idx 4" in text


def _chain(depth: int) -> fluidps.Program:
    """Blocks nested `depth` deep, each reading block 0's x into a variable of its own."""
    program = fluidps.Program()
    program.global_block().create_var("x", shape=[2, 3], dtype="float32", persistable=True)
    for i in range(1, depth):
        block = program.create_block(parent_idx=i - 1)
        block.create_var(f"y{i}", shape=[2, 3], dtype="float32")
        # unchecked: append_op's own inference would walk the chain (as a parser does not)
        block._append_op_unchecked("scale", {"X": ["x"]}, {"Out": [f"y{i}"]}, {"scale": 2.0})
    return program


@pytest.mark.timeout(120)  # a hang guard: the quadratic walk took minutes on 8,000 blocks
def test_verify_is_linear_in_how_deep_blocks_nest():
    program = fluidps.Program.parse_from_string(_chain(20_000).serialize_to_string())
    assert fluidps.check(program) == []
    program.block(5).parent_idx = 9  # a loop: 9 -> 8 -> ... -> 5 -> 9; the blocks below it too
    problems = fluidps.check(program)
    looped = sorted(int(p.split()[1].rstrip(":")) for p in problems if "bad block index: parent_idx" in p)
    assert looped[:6] == [5, 6, 7, 8, 9, 10] and len(looped) == 20_000 - 5


def test_block_attribute_out_of_range_on_a_known_op():
    program = _tiny()
    op = program.global_block().ops[0]
    op.set_attr("sub_block", 3, AttrType.BLOCK)
    op.set_attr("sub_blocks", [0], AttrType.BLOCKS)
    text = _problems(program)
    assert "attribute 'sub_block': bad block index 3 (program has 1 blocks)" in text
    assert "attribute 'sub_blocks': bad block index 0" in text


def test_shape_and_dtype_consistency():
    program = _tiny()
    block = program.global_block()
    block.var("out").shape = (-1, 5)
    assert "'out' is declared with shape [-1, 5] but the op makes [-1, 3]" in _problems(program)
    block.var("out").shape = (-1, 3)
    block.var("out").dtype = fluidps.VarType.FP64
    assert "'out' is declared FP64 but the op makes FP32" in _problems(program)


def test_shape_errors_name_op_inputs_and_shapes():
    program = _tiny()
    program.global_block().var("w").shape = (5, 3)
    text = _problems(program)
    assert "op 'mul': X flattened to [.., 4] cannot multiply Y flattened to [5, ..]" in text
    assert "X=[x [-1, 4] float32] Y=[w [5, 3] float32]" in text


def test_tensor_without_dtype_and_bad_dims():
    program = _tiny()
    block = program.global_block()
    block.create_var("nodtype", shape=[1])
    block.create_var("bad", shape=[-3, 2], dtype="float32")
    text = _problems(program)
    assert "variable 'nodtype' (LOD_TENSOR) has no dtype" in text
    assert "variable 'bad' has invalid shape [-3, 2]" in text


def test_every_problem_is_reported_at_once():
    program = _tiny()
    block = program.global_block()
    block._append_op_unchecked("frobnicate")
    block.ops[0].set_input("Z", ["x"])
    assert len(fluidps.check(program)) == 2
