"""Op definitions: schemas, shape inference and grad makers, op by op."""

from __future__ import annotations

import pytest

import fluidps
from fluidps.ir.attrs import normalize_attr
from fluidps.ir.opschema import REQUIRED, GradContext
from fluidps.ir.types import EMPTY_VAR_NAME, GRAD_SUFFIX, VarType
from fluidps.ops import REGISTRY
from helpers import build_every_layer, paddle_summary

FORWARD_OPS = {
    "feed", "fetch", "fill_constant", "uniform_random", "gaussian_random", "assign", "cast", "scale", "sum",
    "mul", "matmul", "elementwise_add", "elementwise_sub", "elementwise_mul", "elementwise_div",
    "elementwise_max", "elementwise_min", "relu", "sigmoid", "tanh", "exp", "log", "sqrt", "square", "softmax",
    "cross_entropy", "softmax_with_cross_entropy", "mean", "reduce_sum", "reduce_mean", "concat", "split",
    "reshape2", "transpose2", "flatten_contiguous_range", "lookup_table", "lookup_table_v2", "conv2d", "pool2d",
    "dropout", "accuracy", "top_k", "increment", "sgd", "momentum", "adam", "adagrad",
}  # fmt: skip
NOT_DIFFERENTIABLE = {
    "feed", "fetch", "fill_constant", "uniform_random", "gaussian_random", "accuracy", "increment",
    "sgd", "momentum", "adam", "adagrad",
}  # fmt: skip


def test_the_issue_op_list_is_registered():
    assert set(REGISTRY) >= FORWARD_OPS
    for op_type in FORWARD_OPS - NOT_DIFFERENTIABLE:
        assert REGISTRY[op_type].grad is not None, op_type
    for op_type in NOT_DIFFERENTIABLE:
        assert REGISTRY[op_type].grad is None, op_type


@pytest.mark.parametrize("op_type", sorted(REGISTRY))
def test_schema_is_well_formed(op_type):
    schema = REGISTRY[op_type]
    for slots in (schema.inputs, schema.outputs):
        names = [s.name for s in slots]
        assert len(names) == len(set(names))
    for spec in schema.all_attr_specs:
        if spec.default is not REQUIRED:
            normalize_attr(spec.name, spec.type, spec.default)
            if spec.supported is not None:
                assert spec.supported(spec.default), (op_type, spec.name)


def test_unknown_op_suggests_close_names():
    with pytest.raises(fluidps.UnknownOpError, match="did you mean elementwise_add"):
        REGISTRY.schema("elementwise_ad")


# -- shape inference ---------------------------------------------------------------------


def infer(op_type, inputs, outputs, attrs=None):
    """Append one op to a fresh block; return {output name: (shape, dtype name, kind)}."""
    program = fluidps.Program()
    block = program.global_block()
    slots = {}
    for slot, args in inputs.items():
        names = []
        for i, (shape, dtype) in enumerate(args):
            name = f"{slot.lower()}{i}"
            block.create_var(name, shape=shape, dtype=dtype)
            names.append(name)
        slots[slot] = names
    for names in outputs.values():
        for name in names:
            block.create_var(name)
    REGISTRY.append_op(block, op_type, slots, outputs, attrs)
    fluidps.verify(program)
    return {
        name: (list(block.var(name).shape), block.var(name).dtype.name, block.var(name).type.name)
        for names in outputs.values()
        for name in names
    }


F32, I64 = "float32", "int64"
CASES = [
    ("mul", {"X": [([-1, 3, 4], F32)], "Y": [([12, 5], F32)]}, {"Out": ["o"]}, {"x_num_col_dims": 1}, {"o": [-1, 5]}),
    ("mul", {"X": [([2, 3, 4], F32)], "Y": [([4, 5], F32)]}, {"Out": ["o"]}, {"x_num_col_dims": 2}, {"o": [2, 3, 5]}),
    ("matmul", {"X": [([7, 2, 3], F32)], "Y": [([3, 4], F32)]}, {"Out": ["o"]}, {}, {"o": [7, 2, 4]}),
    ("matmul", {"X": [([3, 2], F32)], "Y": [([4, 3], F32)]}, {"Out": ["o"]}, {"transpose_X": True, "transpose_Y": True}, {"o": [2, 4]}),
    ("matmul", {"X": [([3], F32)], "Y": [([3], F32)]}, {"Out": ["o"]}, {}, {"o": [1]}),
    ("elementwise_add", {"X": [([-1, 5], F32)], "Y": [([5], F32)]}, {"Out": ["o"]}, {"axis": 1}, {"o": [-1, 5]}),
    ("elementwise_mul", {"X": [([2, 3, 4], F32)], "Y": [([3], F32)]}, {"Out": ["o"]}, {"axis": 1}, {"o": [2, 3, 4]}),
    ("elementwise_sub", {"X": [([4], F32)], "Y": [([2, 4], F32)]}, {"Out": ["o"]}, {}, {"o": [2, 4]}),
    ("elementwise_div", {"X": [([2, 1], F32)], "Y": [([1, 3], F32)]}, {"Out": ["o"]}, {}, {"o": [2, 3]}),
    ("relu", {"X": [([-1, 7], F32)]}, {"Out": ["o"]}, {}, {"o": [-1, 7]}),
    ("softmax", {"X": [([2, 7], F32)]}, {"Out": ["o"]}, {"axis": 0}, {"o": [2, 7]}),
    ("cross_entropy", {"X": [([-1, 10], F32)], "Label": [([-1, 1], I64)]}, {"Y": ["o"]}, {}, {"o": [-1, 1]}),
    ("softmax_with_cross_entropy", {"Logits": [([-1, 10], F32)], "Label": [([-1, 1], I64)]}, {"Softmax": ["s"], "Loss": ["l"]}, {}, {"s": [-1, 10], "l": [-1, 1]}),
    ("softmax_with_cross_entropy", {"Logits": [([4, 10], F32)], "Label": [([4, 10], F32)]}, {"Softmax": ["s"], "Loss": ["l"]}, {"soft_label": True}, {"s": [4, 10], "l": [4, 1]}),
    ("mean", {"X": [([-1, 3], F32)]}, {"Out": ["o"]}, {}, {"o": []}),
    ("reduce_sum", {"X": [([2, 3, 4], F32)]}, {"Out": ["o"]}, {"dim": [1, -1]}, {"o": [2]}),
    ("reduce_mean", {"X": [([2, 3, 4], F32)]}, {"Out": ["o"]}, {"dim": [1], "keep_dim": True}, {"o": [2, 1, 4]}),
    ("reduce_sum", {"X": [([2, 3], F32)]}, {"Out": ["o"]}, {"reduce_all": True}, {"o": []}),
    ("concat", {"X": [([-1, 2], F32), ([-1, 3], F32)]}, {"Out": ["o"]}, {"axis": 1}, {"o": [-1, 5]}),
    ("split", {"X": [([4, 10], F32)]}, {"Out": ["a", "b"]}, {"sections": [3, -1], "axis": 1}, {"a": [4, 3], "b": [4, 7]}),
    ("split", {"X": [([4, 10], F32)]}, {"Out": ["a", "b"]}, {"num": 2, "axis": 0}, {"a": [2, 10], "b": [2, 10]}),
    ("reshape2", {"X": [([-1, 3, 4], F32)]}, {"Out": ["o"], "XShape": ["xs"]}, {"shape": [0, -1]}, {"o": [-1, 12], "xs": [0, -1, 3, 4]}),
    ("reshape2", {"X": [([6, 4], F32)]}, {"Out": ["o"]}, {"shape": [-1, 3, 2]}, {"o": [4, 3, 2]}),
    ("transpose2", {"X": [([2, 3, 4], F32)]}, {"Out": ["o"], "XShape": ["xs"]}, {"axis": [2, 0, 1]}, {"o": [4, 2, 3], "xs": [0, 2, 3, 4]}),
    ("flatten_contiguous_range", {"X": [([-1, 2, 3, 4], F32)]}, {"Out": ["o"]}, {"start_axis": 1, "stop_axis": -1}, {"o": [-1, 24]}),
    ("lookup_table", {"W": [([100, 8], F32)], "Ids": [([-1, 1], I64)]}, {"Out": ["o"]}, {}, {"o": [-1, 8]}),
    ("lookup_table_v2", {"W": [([100, 8], F32)], "Ids": [([-1, 26], I64)]}, {"Out": ["o"]}, {}, {"o": [-1, 26, 8]}),
    ("conv2d", {"Input": [([-1, 3, 32, 32], F32)], "Filter": [([8, 3, 5, 5], F32)]}, {"Output": ["o"]}, {"paddings": [2, 2], "strides": [2, 2]}, {"o": [-1, 8, 16, 16]}),
    ("conv2d", {"Input": [([1, 4, 9, 9], F32)], "Filter": [([6, 2, 3, 3], F32)]}, {"Output": ["o"]}, {"groups": 2, "dilations": [2, 2]}, {"o": [1, 6, 5, 5]}),
    ("conv2d", {"Input": [([1, 1, 7, 7], F32)], "Filter": [([1, 1, 3, 3], F32)]}, {"Output": ["o"]}, {"padding_algorithm": "SAME", "strides": [2, 2]}, {"o": [1, 1, 4, 4]}),
    ("pool2d", {"X": [([-1, 3, 7, 7], F32)]}, {"Out": ["o"]}, {"pooling_type": "max", "ksize": [2, 2], "strides": [2, 2]}, {"o": [-1, 3, 3, 3]}),
    ("pool2d", {"X": [([-1, 3, 7, 7], F32)]}, {"Out": ["o"]}, {"pooling_type": "avg", "ksize": [2, 2], "strides": [2, 2], "ceil_mode": True}, {"o": [-1, 3, 4, 4]}),
    ("pool2d", {"X": [([2, 3, 7, 7], F32)]}, {"Out": ["o"]}, {"pooling_type": "avg", "ksize": [1, 1], "global_pooling": True}, {"o": [2, 3, 1, 1]}),
    ("dropout", {"X": [([-1, 5], F32)]}, {"Out": ["o"], "Mask": ["m"]}, {"dropout_prob": 0.3}, {"o": [-1, 5], "m": [-1, 5]}),
    ("top_k", {"X": [([-1, 10], F32)]}, {"Out": ["o"], "Indices": ["i"]}, {"k": 3}, {"o": [-1, 3], "i": [-1, 3]}),
    ("accuracy", {"Out": [([-1, 3], F32)], "Indices": [([-1, 3], I64)], "Label": [([-1, 1], I64)]}, {"Accuracy": ["a"], "Correct": ["c"], "Total": ["t"]}, {}, {"a": [], "c": [], "t": []}),
    ("fill_constant", {}, {"Out": ["o"]}, {"shape": [2, 3], "dtype": int(VarType.INT64), "value": 1.0}, {"o": [2, 3]}),
    ("cast", {"X": [([3], F32)]}, {"Out": ["o"]}, {"in_dtype": int(VarType.FP32), "out_dtype": int(VarType.FP64)}, {"o": [3]}),
    ("sum", {"X": [([3, 2], F32), ([3, 2], F32)]}, {"Out": ["o"]}, {}, {"o": [3, 2]}),
    ("scale", {"X": [([3, 2], F32)]}, {"Out": ["o"]}, {"scale": 2.0}, {"o": [3, 2]}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("op_type", "inputs", "outputs", "attrs", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_shape_inference(op_type, inputs, outputs, attrs, expected):
    got = infer(op_type, inputs, outputs, attrs)
    assert {name: shape for name, (shape, _, _) in got.items()} == expected


def test_inferred_dtypes():
    got = infer("top_k", {"X": [([4, 9], F32)]}, {"Out": ["o"], "Indices": ["i"]}, {"k": 2})
    assert got["o"][1] == "FP32" and got["i"][1] == "INT64"
    got = infer("cast", {"X": [([3], F32)]}, {"Out": ["o"]}, {"in_dtype": 5, "out_dtype": 3})
    assert got["o"][1] == "INT64"
    got = infer("dropout", {"X": [([3], F32)]}, {"Out": ["o"], "Mask": ["m"]})
    assert got["m"][1] == "UINT8"


SHAPE_ERRORS = [
    ("mul", {"X": [([2, 3], F32)], "Y": [([4, 5], F32)]}, {"Out": ["o"]}, {}, "cannot multiply"),
    ("elementwise_add", {"X": [([2, 3], F32)], "Y": [([4], F32)]}, {"Out": ["o"]}, {}, "do not broadcast"),
    ("elementwise_add", {"X": [([2, 3], F32)], "Y": [([3], "float64")]}, {"Out": ["o"]}, {}, "same dtype"),
    ("concat", {"X": [([2, 3], F32), ([3, 4], F32)]}, {"Out": ["o"]}, {"axis": 1}, "differ in dimension 0"),
    ("reshape2", {"X": [([6, 4], F32)]}, {"Out": ["o"]}, {"shape": [5, -1]}, "cannot reshape"),
    ("transpose2", {"X": [([2, 3], F32)]}, {"Out": ["o"]}, {"axis": [0, 0]}, "not a permutation"),
    ("softmax_with_cross_entropy", {"Logits": [([4, 10], F32)], "Label": [([4, 1], F32)]}, {"Softmax": ["s"], "Loss": ["l"]}, {}, "hard labels must be int64"),
    ("lookup_table", {"W": [([100, 8], F32)], "Ids": [([4, 3], I64)]}, {"Out": ["o"]}, {}, r"Ids must have shape \[..., 1\]"),
    ("conv2d", {"Input": [([1, 3, 8, 8], F32)], "Filter": [([4, 2, 3, 3], F32)]}, {"Output": ["o"]}, {}, "3 channels but Filter expects 2"),
    ("pool2d", {"X": [([1, 1, 2, 2], F32)]}, {"Out": ["o"]}, {"pooling_type": "max", "ksize": [3, 3]}, "larger than the padded input"),
    ("top_k", {"X": [([4, 2], F32)]}, {"Out": ["o"], "Indices": ["i"]}, {"k": 3}, "larger than the last dimension"),
    ("split", {"X": [([4, 9], F32)]}, {"Out": ["a", "b"]}, {"num": 2, "axis": 1}, "does not split into 2"),
    ("reduce_sum", {"X": [([2, 3], F32)]}, {"Out": ["o"]}, {"dim": [2]}, "dim 2 is out of range"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("op_type", "inputs", "outputs", "attrs", "message"), SHAPE_ERRORS, ids=[c[0] for c in SHAPE_ERRORS]
)
def test_shape_errors(op_type, inputs, outputs, attrs, message):
    with pytest.raises(fluidps.ShapeError, match=message) as info:
        infer(op_type, inputs, outputs, attrs)
    assert f"op {op_type!r}" in str(info.value) and "inputs:" in str(info.value)


def test_failed_append_leaves_the_block_unchanged():
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("x", shape=[2, 3], dtype="float32")
    block.create_var("y", shape=[4, 5], dtype="float32")
    block.create_var("o")
    with pytest.raises(fluidps.ShapeError):
        REGISTRY.append_op(block, "mul", {"X": "x", "Y": "y"}, {"Out": "o"})
    assert block.ops == [] and block.var("o").shape is None


def test_append_op_checks_attributes_and_slots():
    block = fluidps.Program().global_block()
    block.create_var("x", shape=[2], dtype="float32")
    block.create_var("o")
    with pytest.raises(fluidps.ProgramError, match="has no attribute 'alpha'"):
        REGISTRY.append_op(block, "relu", {"X": "x"}, {"Out": "o"}, {"alpha": 1.0})
    with pytest.raises(fluidps.UnsupportedError, match="amsgrad=True is not implemented"):
        REGISTRY.append_op(block, "adam", {}, {}, {"amsgrad": True})
    with pytest.raises(fluidps.ProgramError, match="has no input slot 'Y'"):
        REGISTRY.append_op(block, "relu", {"X": "x", "Y": "x"}, {"Out": "o"})
    with pytest.raises(fluidps.ProgramError, match="needs attribute 'ksize'"):
        REGISTRY.append_op(block, "pool2d", {"X": "x"}, {"Out": "o"}, {"pooling_type": "max"})


def _adam_block():
    block = fluidps.Program().global_block()
    for name, shape in (("p", [4, 3]), ("g", [4, 3]), ("m1", [4, 3]), ("m2", [4, 3])):
        block.create_var(name, shape=shape, dtype="float32")
    for name in ("lr", "b1p", "b2p", "t"):
        block.create_var(name, shape=[1], dtype="float32")
    block.create_var("skip", shape=[1], dtype="bool")
    inputs = {"Param": "p", "Grad": "g", "Moment1": "m1", "Moment2": "m2", "LearningRate": "lr"}
    inputs |= {"Beta1Pow": "b1p", "Beta2Pow": "b2p"}
    outputs = {"ParamOut": "p", "Moment1Out": "m1", "Moment2Out": "m2"}
    return block, inputs, outputs


@pytest.mark.parametrize(
    ("slot", "var"),
    [("SkipUpdate", "skip"), ("Beta1Tensor", "t"), ("Moment2Max", "m2"), ("MasterParam", "p")],
)
def test_adam_refuses_paddle_extra_inputs(slot, var):
    block, inputs, outputs = _adam_block()
    REGISTRY.append_op(block, "adam", {**inputs, slot: []}, outputs)  # empty, as Paddle writes it
    with pytest.raises(fluidps.UnsupportedError, match=f"op 'adam': input '{slot}' is not implemented"):
        REGISTRY.append_op(block, "adam", {**inputs, slot: var}, outputs)
    assert len(block.ops) == 1


@pytest.mark.parametrize("slot", ["Shape", "ShapeTensor"])
def test_reshape2_refuses_shape_tensors(slot):
    block = fluidps.Program().global_block()
    block.create_var("x", shape=[2, 6], dtype="float32")
    block.create_var("shape", shape=[2], dtype="int32")
    for name in ("o", "xshape"):
        block.create_var(name)
    outputs = {"Out": "o", "XShape": "xshape"}
    with pytest.raises(fluidps.UnsupportedError, match=f"op 'reshape2': input '{slot}' is not implemented"):
        REGISTRY.append_op(block, "reshape2", {"X": "x", slot: "shape"}, outputs, {"shape": [3, 4]})
    assert block.ops == []
    REGISTRY.append_op(block, "reshape2", {"X": "x", slot: []}, outputs, {"shape": [3, 4]})
    assert block.var("o").shape == (3, 4)


def test_quantized_ops_are_refused():
    block = fluidps.Program().global_block()
    block.create_var("x", shape=[2], dtype="float32")
    block.create_var("o")
    with pytest.raises(
        fluidps.UnsupportedError,
        match="op 'relu': with_quant_attr=True is not implemented: quantized programs are not supported",
    ):
        REGISTRY.append_op(block, "relu", {"X": "x"}, {"Out": "o"}, {"with_quant_attr": True})
    assert block.ops == []


# -- grad makers --------------------------------------------------------------------------


def grad_descs(op, no_grad=()):
    return REGISTRY[op.type].grad(GradContext(op, frozenset(no_grad)))


def _op(program, op_type):
    return next(op for op in program.global_block().ops if op.type == op_type)


def test_fluid_slotting_of_grad_ops():
    main, _ = build_every_layer()
    (mul,) = grad_descs(_op(main, "mul"))
    assert mul.type == "mul_grad"
    assert set(mul.inputs) == {"X", "Y", "Out@GRAD"} and set(mul.outputs) == {"X@GRAD", "Y@GRAD"}
    (relu,) = grad_descs(_op(main, "relu"))
    assert set(relu.inputs) == {"Out", "Out@GRAD"} and set(relu.outputs) == {"X@GRAD"}
    (swce,) = grad_descs(_op(main, "softmax_with_cross_entropy"))
    assert set(swce.inputs) == {"Label", "Softmax", "Loss@GRAD"} and set(swce.outputs) == {"Logits@GRAD"}
    (rmean,) = grad_descs(_op(main, "reduce_mean"))
    assert set(rmean.inputs) == {"X", "Out@GRAD"} and set(rmean.outputs) == {"X@GRAD"}
    op = _op(main, "mul")
    assert mul.inputs["Out@GRAD"] == [op.output("Out")[0] + GRAD_SUFFIX]
    assert mul.attrs["x_num_col_dims"] == op.attr("x_num_col_dims")


def test_unwanted_gradients_are_left_out():
    main, _ = build_every_layer()
    op = _op(main, "mul")
    (desc,) = grad_descs(op, no_grad={op.input("X")[0]})
    assert set(desc.outputs) == {"Y@GRAD"}
    assert grad_descs(op, no_grad=set(op.input_arg_names)) == []
    concat = _op(main, "concat")
    (desc,) = grad_descs(concat, no_grad={concat.input("X")[1]})
    assert desc.outputs["X@GRAD"][1] == EMPTY_VAR_NAME
    assert desc.outputs["X@GRAD"][0] == concat.input("X")[0] + GRAD_SUFFIX


def test_grad_makers_that_reuse_forward_ops():
    main, _ = build_every_layer()
    sum_op = _op(main, "sum")
    descs = grad_descs(sum_op)
    assert [d.type for d in descs] == ["scale", "scale"]
    assert all(d.attrs["scale"] == 1.0 for d in descs)
    (split,) = grad_descs(_op(main, "split"))
    assert split.type == "concat" and split.attrs["axis"] == 1
    (cast,) = grad_descs(_op(main, "cast"))
    assert (cast.type, cast.attrs) == (
        "cast",
        {"in_dtype": int(VarType.FP64), "out_dtype": int(VarType.FP32)},
    )
    (scale,) = grad_descs(_op(main, "scale"))
    assert scale.type == "scale" and scale.attrs["bias"] == 0.0 and scale.attrs["scale"] == 0.5


def test_grad_ops_of_every_layer_verify():
    """Append every forward op's grad ops, declaring gradient variables by name;
    grad-op inference must then reproduce the forward shapes and verify()."""
    main, _ = build_every_layer()
    block = main.global_block()
    forward = list(block.ops)
    for op in reversed(forward):
        schema = REGISTRY[op.type]
        if schema.grad is None:
            continue
        no_grad = {
            n for n in op.input_arg_names if block.var(n).stop_gradient and not block.var(n).is_parameter
        }
        for desc in schema.grad(GradContext(op, frozenset(no_grad))):
            for names in (*desc.inputs.values(), *desc.outputs.values()):
                for name in names:
                    if name.endswith(GRAD_SUFFIX) and name not in block.vars:
                        base = block.var(name[: -len(GRAD_SUFFIX)])
                        block.create_var(name, shape=base.shape, dtype=base.dtype)
            grad_op = REGISTRY.append_op(block, desc.type, desc.inputs, desc.outputs, desc.attrs)
            for name in grad_op.output_arg_names:
                if name == EMPTY_VAR_NAME:
                    continue
                base = block.find_var(name[: -len(GRAD_SUFFIX)])
                assert block.var(name).shape == base.shape, name
    fluidps.verify(main)
    lookup_grad = _op(main, "lookup_table_v2_grad")
    assert block.var(lookup_grad.output("W@GRAD")[0]).type == VarType.SELECTED_ROWS


@pytest.mark.parametrize("fixture", ["adam_sparse", "sgd_tanh"])
def test_grad_makers_read_what_paddles_grad_ops_read(fixture):
    """For each forward op of a Paddle training program, our grad maker uses the
    same non-empty slots as the grad op Paddle wrote."""
    ops = paddle_summary(fixture)["main"]["blocks"][0]["ops"]
    paddle_grads = {}
    for op in ops:
        if op["type"].endswith("_grad"):
            key = tuple(op["inputs"].get("Out@GRAD", []) or op["inputs"].get("Loss@GRAD", []))
            paddle_grads[(op["type"], key)] = op
    program = fluidps.Program.parse_from_string(
        (__import__("helpers").paddle_fixture(fixture) / "main.pb").read_bytes()
    )
    compared = 0
    for op in program.global_block().ops:
        schema = REGISTRY[op.type]
        if op.type.endswith("_grad") or schema.grad is None or op.attr("op_role") != 0:
            continue
        for desc in schema.grad(GradContext(op)):
            key = tuple(desc.inputs.get("Out@GRAD", []) or desc.inputs.get("Loss@GRAD", []))
            theirs = paddle_grads.get((desc.type, key))
            if theirs is None:
                continue
            ours_in = {k for k, v in desc.inputs.items() if v}
            theirs_in = {k for k, v in theirs["inputs"].items() if v}
            assert ours_in == theirs_in, desc.type
            assert {k for k, v in desc.outputs.items() if v} >= {k for k, v in theirs["outputs"].items() if v}
            compared += 1
    assert compared >= 5
