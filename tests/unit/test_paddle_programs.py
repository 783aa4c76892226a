"""ProgramDescs written by PaddlePaddle 3.3 (legacy static graph) parse and keep everything.

summary.json was produced by Paddle's own generated protobuf module, an
independent parse of the same bytes (see fixtures/paddle/make_fixtures.py).
"""

from __future__ import annotations

import pytest

import fluidps
from fluidps.ir.types import VarType
from helpers import paddle_fixture, paddle_summary

FILES = [
    ("adam_sparse", "main.pb"),
    ("adam_sparse", "startup.pb"),
    ("sgd_tanh", "main.pb"),
    ("sgd_tanh", "startup.pb"),
    ("lenet_infer", "model.pdmodel"),
]


def load(fixture: str, file: str) -> fluidps.Program:
    return fluidps.Program.parse_from_string((paddle_fixture(fixture) / file).read_bytes())


@pytest.mark.parametrize(("fixture", "file"), FILES)
def test_paddle_programs_verify(fixture, file):
    program = load(fixture, file)
    assert program.format_version == 3003001
    fluidps.verify(program)


@pytest.mark.parametrize("fixture", ["adam_sparse", "sgd_tanh", "lenet_infer"])
def test_ops_slots_and_attribute_values_are_kept(fixture):
    file = "model.pdmodel" if fixture == "lenet_infer" else "main.pb"
    program = load(fixture, file)
    expected = paddle_summary(fixture)["main"]
    assert program.num_blocks == len(expected["blocks"])
    for block, want in zip(program.blocks, expected["blocks"], strict=True):
        assert [op.type for op in block.ops] == [op["type"] for op in want["ops"]]
        for op, want_op in zip(block.ops, want["ops"], strict=True):
            assert op.inputs == want_op["inputs"]
            assert op.outputs == want_op["outputs"]
            for name, attr in want_op["attrs"].items():
                assert op.attr_type(name).name == attr["type"], (op.type, name)
                assert op.attr(name) == pytest.approx(attr["value"]), (op.type, name)
        for name, var in want["vars"].items():
            ours = block.var(name)
            assert int(ours.type) == var["type"]
            assert ours.persistable == var["persistable"]
            if var["dtype"] is not None:
                assert int(ours.dtype) == var["dtype"]
                assert list(ours.shape) == var["shape"]


def test_training_program_semantics():
    program = load("adam_sparse", "main.pb")
    block = program.global_block()
    assert [p.name for p in program.all_parameters()] == [
        "embedding_0.w_0",
        "fc_0.b_0",
        "fc_0.w_0",
        "fc_1.b_0",
        "fc_1.w_0",
    ]
    assert block.var("embedding_0.w_0@GRAD").type == VarType.SELECTED_ROWS
    seed = next(op for op in block.ops if op.attr("op_role") == 257)
    assert seed.type == "fill_constant"
    adams = [op for op in block.ops if op.type == "adam"]
    assert len(adams) == 5 and all(op.attr("op_role") == 2 for op in adams)
    assert adams[0].attr("op_role_var") == ["embedding_0.w_0", "embedding_0.w_0@GRAD"]
    # The not-wanted gradient of concat's second input is Paddle's @EMPTY@ placeholder.
    concat_grad = next(op for op in block.ops if op.type == "concat_grad")
    assert concat_grad.output("X@GRAD")[1] == "@EMPTY@"


@pytest.mark.parametrize(("fixture", "file"), FILES)
def test_paddle_programs_round_trip(fixture, file):
    program = load(fixture, file)
    data = program.serialize_to_string()
    again = fluidps.Program.parse_from_string(data)
    assert again.serialize_to_string() == data
    assert [op.all_attrs() for op in again.global_block().ops] == [
        op.all_attrs() for op in program.global_block().ops
    ]


def test_clone_for_test_of_a_paddle_training_program():
    program = load("adam_sparse", "main.pb")
    test = program.clone(for_test=True)
    types = [op.type for op in test.global_block().ops]
    assert "adam" not in types and not any(t.endswith("_grad") for t in types)
    assert types[-1] == "reduce_mean"
    fluidps.verify(test)


# Paddle 2.x/3.x slots and attributes for features fluidps does not implement. Paddle
# writes them empty (or False); a program that fills one is refused, naming op and slot.
EXTRA_SLOTS = [("reshape2", "Shape"), ("reshape2", "ShapeTensor")] + [
    ("adam", slot) for slot in ("SkipUpdate", "Beta1Tensor", "Moment2Max", "MasterParam")
]


@pytest.mark.parametrize(("op_type", "slot"), EXTRA_SLOTS, ids=[f"{o}.{s}" for o, s in EXTRA_SLOTS])
def test_filled_extra_input_slots_are_rejected(op_type, slot):
    program = load("adam_sparse", "main.pb")
    block = program.global_block()
    index, op = next((i, op) for i, op in enumerate(block.ops) if op.type == op_type)
    assert op.input(slot) == []  # as Paddle wrote it
    block.create_var("extra_input", shape=[2], dtype="int32", persistable=True)
    op.set_input(slot, ["extra_input"])
    with pytest.raises(fluidps.VerifyError) as info:
        fluidps.verify(program)
    assert (
        f"block 0, op #{index} ({op_type}): input '{slot}' = ['extra_input'] "
        "asks for a feature fluidps does not implement"
    ) in str(info.value)


def test_quantized_ops_are_rejected():
    program = load("adam_sparse", "main.pb")
    block = program.global_block()
    index, op = next((i, op) for i, op in enumerate(block.ops) if op.type == "reshape2")
    assert op.attr("with_quant_attr") is False  # as Paddle wrote it
    op.set_attr("with_quant_attr", True)
    with pytest.raises(fluidps.VerifyError) as info:
        fluidps.verify(program)
    assert (
        f"block 0, op #{index} (reshape2): attribute with_quant_attr=True asks for something "
        "fluidps does not implement: quantized programs are not supported"
    ) in str(info.value)


@pytest.mark.parametrize(("op_type", "slot"), EXTRA_SLOTS, ids=[f"{o}.{s}" for o, s in EXTRA_SLOTS])
def test_running_a_program_with_a_filled_extra_slot_is_refused(op_type, slot):
    """The executor verifies what it runs, even a program nobody verified:
    adam with SkipUpdate would otherwise apply the update it was told to skip."""
    program = load("adam_sparse", "main.pb")
    op = next(op for op in program.global_block().ops if op.type == op_type)
    program.global_block().create_var("extra_input", shape=[1], dtype="bool", persistable=True)
    op.set_input(slot, ["extra_input"])
    with pytest.raises(
        fluidps.VerifyError,
        match=rf"\({op_type}\): input '{slot}' = \['extra_input'\] asks for a feature fluidps does not implement",
    ):
        fluidps.Executor().run(program)


def test_running_a_quantized_op_is_refused():
    program = load("adam_sparse", "main.pb")
    op = next(op for op in program.global_block().ops if op.type == "reshape2")
    op.set_attr("with_quant_attr", True)
    with pytest.raises(
        fluidps.VerifyError,
        match=r"\(reshape2\): attribute with_quant_attr=True asks for something fluidps does not implement",
    ):
        fluidps.Executor().run(program)
