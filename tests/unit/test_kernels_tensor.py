"""Kernels of layout, copy, arithmetic, creation, feed / fetch and comparison ops:
forward against numpy, gradients against finite differences, SelectedRows
cases, random seeds, and programs with explicit feed and fetch ops.

Gradients are checked with `grad_check` below, the same comparison as
optest.check_grad: random seeds for the outputs in L = sum_o sum(out_o * seed_o)
(zero seeds for the outputs left out of L), the grad maker's ops run on them, and
the analytic gradients compared with central differences in float64, a check
where everything is zero being refused. grad_check also asserts that each
gradient has its input's shape and dtype, and takes dense inputs only
(check_grad also perturbs the values of SelectedRows inputs)."""

from __future__ import annotations

import numpy as np
import pytest
from optest import OpProgram, cast_inputs, check_output, run_op

import fluidps
from fluidps.ir.opschema import GradContext
from fluidps.ir.types import EMPTY_VAR_NAME, GRAD_SUFFIX, VarType, to_numpy_dtype
from fluidps.ops import REGISTRY
from fluidps.ops.selected_rows import SelectedRows

RNG = np.random.default_rng(11)
FP32, FP64, INT64, BOOL = (int(VarType.FP32), int(VarType.FP64), int(VarType.INT64), int(VarType.BOOL))


def rand(*shape, low=-1.0, high=1.0):
    return RNG.uniform(low, high, size=shape)


def sparse(rows, width=3, height=6):
    return SelectedRows(np.array(rows), rand(len(rows), width), height)


def _program_with_grads(op_type, inputs, attrs=None, outputs=None, no_grad=()):
    """A program running `op_type` then its grad ops; unwanted input gradients
    (by forward variable name) left out as the grad maker decides."""
    prog = OpProgram(op_type, inputs, attrs, outputs)
    block = prog.block
    for names in prog.out_slots.values():
        for name in names:
            var = block.var(name)
            block.create_var(name + GRAD_SUFFIX, shape=var.shape, dtype=var.dtype)
    for desc in REGISTRY[op_type].grad(GradContext(prog.op, frozenset(no_grad))):
        for names in desc.outputs.values():
            for name in names:
                if name != EMPTY_VAR_NAME:
                    block.create_var(name)
        REGISTRY.append_op(block, desc.type, desc.inputs, desc.outputs, desc.attrs)
    fluidps.verify(prog.program)
    return prog


def grad_check(op_type, inputs, wrt, attrs=None, outputs=None, of=None, delta=1e-6, rtol=1e-5, atol=1e-7):
    """The analytic gradients (grad maker + grad kernels) of L = sum_o sum(out_o * seed_o)
    with respect to the `wrt` input slots equal central differences, in float64.
    `of` picks the outputs in L (default: every float output); the others get zero seeds."""
    cast = cast_inputs(inputs, "float64")
    forward = OpProgram(op_type, cast, attrs, outputs)
    no_grad = {n for slot, names in forward.in_slots.items() if slot not in wrt for n in names}
    prog = _program_with_grads(op_type, cast, attrs, outputs, no_grad)
    out_names = [n for names in forward.out_slots.values() for n in names]
    values = dict(zip(out_names, forward.run(fetch=out_names), strict=True))
    of_names = {n for slot in (of or forward.out_slots) for n in forward.out_slots[slot]}
    rng = np.random.default_rng(0)
    seeds = {
        n: (rng.normal(size=v.shape) if n in of_names else np.zeros(v.shape)).astype(v.dtype)
        for n, v in values.items()
        if v.dtype.kind == "f"
    }
    feed = dict(prog.feed, **{n + GRAD_SUFFIX: seed for n, seed in seeds.items()})
    grad_names = [n + GRAD_SUFFIX for slot in wrt for n in prog.in_slots[slot]]
    analytic = dict(
        zip(grad_names, prog.exe.run(prog.program, feed=feed, fetch_list=grad_names), strict=True)
    )

    def loss(feed_values):
        outs = forward.run(feed_values, sorted(seeds))
        return sum(
            float(np.sum(o.astype(np.float64) * seeds[n])) for o, n in zip(outs, sorted(seeds), strict=True)
        )

    for slot in wrt:
        for name in forward.in_slots[slot]:
            base = forward.feed[name]
            numeric = np.zeros_like(base)
            for idx in np.ndindex(base.shape):
                at = []
                for sign in (1, -1):
                    bumped = base.copy()
                    bumped[idx] += sign * delta
                    at.append(loss(dict(forward.feed, **{name: bumped})))
                numeric[idx] = (at[0] - at[1]) / (2 * delta)
            got = analytic[name + GRAD_SUFFIX]
            assert got.shape == base.shape and got.dtype == base.dtype, (name, got.shape, got.dtype)
            np.testing.assert_allclose(got, numeric, rtol=rtol, atol=atol, err_msg=f"d L / d {name}")
            assert np.any(numeric != 0), f"{op_type}: the check of {name} is vacuous"


# -- layout --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shapes", "axis"),
    [([(2, 3), (4, 3)], 0), ([(2, 1, 4), (2, 3, 4), (2, 2, 4)], 1), ([(3, 2), (3, 5)], -1)],
)
def test_concat(shapes, axis):
    xs = [rand(*s) for s in shapes]
    check_output("concat", {"X": xs}, lambda X: {"Out": np.concatenate(X, axis=axis)}, attrs={"axis": axis})
    grad_check("concat", {"X": xs}, wrt=["X"], attrs={"axis": axis})


def test_concat_grad_skips_unwanted_inputs():
    xs = [rand(2, 2), rand(2, 3), rand(2, 1)]
    prog = _program_with_grads("concat", {"X": xs}, {"axis": 1}, no_grad={"X_1"})
    grad_op = prog.block.ops[-1]
    assert grad_op.output("X@GRAD")[1] == EMPTY_VAR_NAME
    dout = rand(2, 6)
    feed = dict(prog.feed, **{"Out_out_0@GRAD": dout})
    d0, d2 = prog.exe.run(prog.program, feed=feed, fetch_list=["X_0@GRAD", "X_2@GRAD"])
    np.testing.assert_array_equal(d0, dout[:, :2])
    np.testing.assert_array_equal(d2, dout[:, 5:])


@pytest.mark.parametrize(
    ("shape", "attrs", "n"),
    [
        ((4, 6), {"axis": 1, "num": 3}, 3),
        ((5, 2), {"axis": 0, "sections": [1, -1, 2]}, 3),
        ((2, 3, 4), {"axis": -1, "sections": [3, 1]}, 2),
    ],
)
def test_split(shape, attrs, n):
    x = rand(*shape)

    def reference(X):
        ax = attrs["axis"] % X.ndim
        if "num" in attrs:
            return {"Out": np.split(X, attrs["num"], axis=ax)}
        sizes = list(attrs["sections"])
        if -1 in sizes:
            sizes[sizes.index(-1)] = X.shape[ax] - sum(s for s in sizes if s >= 0)
        return {"Out": np.split(X, np.cumsum(sizes)[:-1], axis=ax)}

    check_output("split", {"X": x}, reference, attrs=attrs, outputs={"Out": n})
    grad_check("split", {"X": x}, wrt=["X"], attrs=attrs, outputs={"Out": n})


@pytest.mark.parametrize(
    ("shape", "target", "expected"),
    [((2, 3, 4), [0, -1], (2, 12)), ((6, 4), [-1, 3, 2], (4, 3, 2)), ((4, 3, 2), [2, 0, -1], (2, 3, 4))],
)
def test_reshape2(shape, target, expected):
    x = rand(*shape)
    check_output(
        "reshape2",
        {"X": x},
        lambda X: {"Out": X.reshape(expected), "XShape": np.empty((0, *shape))},
        attrs={"shape": target},
        outputs={"XShape": 1},
    )
    grad_check("reshape2", {"X": x}, wrt=["X"], attrs={"shape": target}, outputs={"XShape": 1}, of=["Out"])


@pytest.mark.parametrize("perm", [[1, 0], [2, 0, 1], [0, 2, 1, 3]])
def test_transpose2(perm):
    x = rand(*[2, 3, 4, 5][: len(perm)])
    check_output(
        "transpose2",
        {"X": x},
        lambda X: {"Out": np.transpose(X, perm)},
        attrs={"axis": perm},
        outputs={"XShape": 1},
    )
    grad_check("transpose2", {"X": x}, wrt=["X"], attrs={"axis": perm}, outputs={"XShape": 1}, of=["Out"])


@pytest.mark.parametrize(
    ("start", "stop", "expected"), [(1, -1, (2, 60)), (0, 1, (6, 4, 5)), (2, 2, (2, 3, 4, 5))]
)
def test_flatten_contiguous_range(start, stop, expected):
    x = rand(2, 3, 4, 5)
    attrs = {"start_axis": start, "stop_axis": stop}
    check_output(
        "flatten_contiguous_range",
        {"X": x},
        lambda X: {"Out": X.reshape(expected), "XShape": np.empty((0, 2, 3, 4, 5))},
        attrs=attrs,
        outputs={"XShape": 1},
    )
    grad_check(
        "flatten_contiguous_range", {"X": x}, wrt=["X"], attrs=attrs, outputs={"XShape": 1}, of=["Out"]
    )


def test_layout_outputs_of_parameters_are_copies():
    # An optimizer updates a parameter in place; a reshaped view would follow it.
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("w", shape=[2, 3], dtype="float32", persistable=True)
    block.create_var("o")
    REGISTRY.append_op(block, "reshape2", {"X": "w"}, {"Out": "o"}, {"shape": [3, 2]})
    exe = fluidps.Executor()
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    exe.scope["w"] = w
    (out,) = exe.run(program, fetch_list=["o"], return_numpy=False)
    assert not np.shares_memory(out, exe.scope["w"])
    np.testing.assert_array_equal(out, w.reshape(3, 2))


# -- copies ----------------------------------------------------------------------------


def test_assign():
    x = rand(3, 4)
    check_output("assign", {"X": x}, lambda X: {"Out": X})
    grad_check("assign", {"X": x}, wrt=["X"])


def test_assign_selected_rows_is_a_copy():
    x = sparse([4, 1, 4])
    out = run_op("assign", {"X": x})["Out"]
    assert isinstance(out, SelectedRows) and out.height == x.height
    np.testing.assert_array_equal(out.rows, x.rows)
    np.testing.assert_array_equal(out.value, x.value)
    assert not np.shares_memory(out.value, x.value)


@pytest.mark.parametrize(
    ("x", "in_dtype", "out_dtype", "expected"),
    [
        (np.array([1.7, -2.5], dtype=np.float32), FP32, FP64, np.array([1.7, -2.5], dtype=np.float32)),
        (np.array([1.7, -2.5, 0.0]), FP64, INT64, np.array([1, -2, 0])),
        (np.array([1.7, -2.5, 0.0]), FP64, BOOL, np.array([True, True, False])),
        (np.array([3, -4], dtype=np.int64), INT64, FP32, np.array([3.0, -4.0], dtype=np.float32)),
    ],
)
def test_cast(x, in_dtype, out_dtype, expected):
    out = run_op("cast", {"X": x}, {"in_dtype": in_dtype, "out_dtype": out_dtype})["Out"]
    want = expected.astype(to_numpy_dtype(VarType(out_dtype)))
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(out, want)


def test_cast_forward_and_grad():
    x = rand(2, 3)
    attrs = {"in_dtype": FP64, "out_dtype": FP64}
    check_output("cast", {"X": x}, lambda X: {"Out": X}, attrs=attrs, dtypes=("float64",))
    grad_check("cast", {"X": x}, wrt=["X"], attrs=attrs)
    # Through float32 and back: the gradient is cast to X's dtype; float32
    # rounding needs a larger step and a looser tolerance.
    attrs = {"in_dtype": FP64, "out_dtype": FP32}
    grad_check("cast", {"X": x}, wrt=["X"], attrs=attrs, delta=1e-3, rtol=1e-3, atol=1e-6)


def test_merge_selected_rows():
    x = sparse([3, 1, 3, 0, 1])
    out = run_op("merge_selected_rows", {"X": x})["Out"]
    assert isinstance(out, SelectedRows) and out.height == 6
    np.testing.assert_array_equal(out.rows, [0, 1, 3])
    v = x.value
    np.testing.assert_allclose(out.value, np.stack([v[3], v[1] + v[4], v[0] + v[2]]))
    check_output("merge_selected_rows", {"X": x}, lambda X: {"Out": X.to_dense()})


def test_get_tensor_from_selected_rows():
    x = sparse([5, 2, 5])
    check_output("get_tensor_from_selected_rows", {"X": x}, lambda X: {"Out": X.value})


# -- arithmetic ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [{"scale": 2.5, "bias": 0.5}, {"scale": -1.5, "bias": 0.25, "bias_after_scale": False}, {}],
)
def test_scale(attrs):
    x = rand(3, 4)
    s, b = attrs.get("scale", 1.0), attrs.get("bias", 0.0)
    after = attrs.get("bias_after_scale", True)
    check_output("scale", {"X": x}, lambda X: {"Out": s * X + b if after else s * (X + b)}, attrs=attrs)
    grad_check("scale", {"X": x}, wrt=["X"], attrs=attrs)


def test_scale_keeps_float32_and_integers():
    out = run_op("scale", {"X": rand(5)}, {"scale": 0.1, "bias": 0.3}, dtype="float32")["Out"]
    assert out.dtype == np.float32
    ints = run_op("scale", {"X": np.array([1, 2, 3], dtype=np.int64)}, {"scale": 3.0, "bias": 1.0})["Out"]
    assert ints.dtype == np.int64
    np.testing.assert_array_equal(ints, [4, 7, 10])


def test_scale_selected_rows():
    x = sparse([4, 0, 4])
    out = run_op("scale", {"X": x}, {"scale": 3.0, "bias": 1.0})["Out"]
    assert isinstance(out, SelectedRows) and out.height == x.height
    np.testing.assert_array_equal(out.rows, x.rows)
    np.testing.assert_allclose(out.value, 3.0 * x.value + 1.0)
    # Both float dtypes; the bias reaches only the rows present.
    check_output(
        "scale",
        {"X": x},
        lambda X: {"Out": SelectedRows(X.rows, 3.0 * X.value + 1.0, X.height).to_dense()},
        attrs={"scale": 3.0, "bias": 1.0},
    )


def test_sum():
    xs = [rand(3, 4) for _ in range(3)]
    check_output("sum", {"X": xs}, lambda X: {"Out": X[0] + X[1] + X[2]})
    grad_check("sum", {"X": xs}, wrt=["X"])


def test_sum_of_selected_rows_concatenates_them():
    a, b = sparse([1, 4]), sparse([4, 0, 2])
    out = run_op("sum", {"X": [a, b]})["Out"]
    assert isinstance(out, SelectedRows) and out.height == 6
    np.testing.assert_array_equal(out.rows, [1, 4, 4, 0, 2])
    np.testing.assert_array_equal(out.value, np.concatenate([a.value, b.value]))
    check_output("sum", {"X": [a, b]}, lambda X: {"Out": X[0].to_dense() + X[1].to_dense()})


def test_sum_of_dense_and_selected_rows_is_dense():
    d, s = rand(6, 3), sparse([5, 1, 5])
    for inputs in ([d, s], [s, d]):
        check_output("sum", {"X": inputs}, lambda X: {"Out": sum(_dense(v) for v in X)})
        assert isinstance(run_op("sum", {"X": inputs})["Out"], np.ndarray)


def _dense(v):
    return v.to_dense() if isinstance(v, SelectedRows) else v


@pytest.mark.parametrize(("x", "step"), [(np.array([3.0], dtype=np.float32), 1.5), (np.array([7]), 2.0)])
def test_increment(x, step):
    out = run_op("increment", {"X": x}, {"step": step})["Out"]
    assert out.dtype == x.dtype
    np.testing.assert_array_equal(out, x + x.dtype.type(step))


# -- creation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "value"), [(FP32, 0.5), (FP64, -2.25), (INT64, 3.0), (BOOL, 1.0), (int(VarType.INT32), 7.0)]
)
def test_fill_constant(dtype, value):
    out = run_op("fill_constant", {}, {"shape": [2, 3], "dtype": dtype, "value": value})["Out"]
    want = np.full((2, 3), value, dtype=to_numpy_dtype(VarType(dtype)))
    assert out.dtype == want.dtype
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize(
    ("dtype", "text", "expected"),
    [
        (INT64, str(2**62 + 1), 2**62 + 1),  # float32 (and float64) would round it
        (INT64, "12.0", 12),
        (FP32, "inf", np.inf),
        (FP64, "-1.5e-3", -1.5e-3),
    ],
)
def test_fill_constant_str_value_wins(dtype, text, expected):
    attrs = {"shape": [2], "dtype": dtype, "value": 1.0, "str_value": text}
    out = run_op("fill_constant", {}, attrs)["Out"]
    np.testing.assert_array_equal(out, np.full(2, expected, dtype=out.dtype))
    assert out.dtype == to_numpy_dtype(VarType(dtype))


def test_fill_constant_gives_fresh_arrays():
    prog = OpProgram("fill_constant", {}, {"shape": [2], "value": 1.0}, None)
    (first,) = prog.run()
    first += 5
    (second,) = prog.run()
    np.testing.assert_array_equal(second, [1.0, 1.0])


RANDOM = {
    "uniform_random": ({"min": -2.0, "max": 3.0}, lambda rng, size: rng.uniform(-2.0, 3.0, size=size)),
    "gaussian_random": ({"mean": 1.0, "std": 0.5}, lambda rng, size: rng.normal(1.0, 0.5, size=size)),
}


@pytest.mark.parametrize("op_type", sorted(RANDOM))
@pytest.mark.parametrize("dtype", [FP32, FP64])
def test_random_seed_gives_one_reproducible_stream(op_type, dtype):
    attrs, draw = RANDOM[op_type]
    attrs = dict(attrs, shape=[3, 4], seed=42, dtype=dtype)
    np_dtype = to_numpy_dtype(VarType(dtype))
    prog = OpProgram(op_type, {}, attrs, None)
    (first,), (second,) = prog.run(), prog.run()
    rng = np.random.default_rng(42)
    assert first.dtype == np_dtype
    np.testing.assert_array_equal(first, draw(rng, (3, 4)).astype(np_dtype))
    np.testing.assert_array_equal(second, draw(rng, (3, 4)).astype(np_dtype))  # the stream goes on
    # The same seed in another program starts the same stream again.
    np.testing.assert_array_equal(run_op(op_type, {}, attrs)["Out"], first)


@pytest.mark.parametrize("op_type", sorted(RANDOM))
def test_random_without_seed_differs_between_programs(op_type):
    attrs = dict(RANDOM[op_type][0], shape=[64])
    a, b = run_op(op_type, {}, attrs)["Out"], run_op(op_type, {}, attrs)["Out"]
    assert a.shape == (64,) and a.dtype == np.float32 and not np.array_equal(a, b)


def test_fill_zeros_like():
    x = rand(2, 5)
    check_output("fill_zeros_like", {"X": x}, lambda X: {"Out": np.zeros_like(X)})
    ints = run_op("fill_zeros_like", {"X": np.array([[1, 2]])})["Out"]
    assert ints.dtype == np.int64 and ints.shape == (1, 2) and not ints.any()


# -- comparisons ---------------------------------------------------------------------------

COMPARE = {"less_than": np.less, "greater_equal": np.greater_equal}


@pytest.mark.parametrize("op_type", sorted(COMPARE))
@pytest.mark.parametrize(
    ("xs", "ys", "axis"), [((3, 4), (3, 4), -1), ((2, 3, 4), (3,), 1), ((2, 3), (3,), -1)]
)
def test_compare(op_type, xs, ys, axis):
    x, y = rand(*xs), rand(*ys)
    x.reshape(-1)[0] = y.reshape(-1)[0]  # one tie, where < and >= differ from > and <=
    aligned = (1,) * (len(xs) - len(ys) if axis == -1 else axis)
    aligned = (*aligned, *ys, *(1,) * (len(xs) - len(aligned) - len(ys)))

    def reference(X, Y):
        return {"Out": COMPARE[op_type](X, Y.reshape(aligned))}

    check_output(op_type, {"X": x, "Y": y}, reference, attrs={"axis": axis})
    out = run_op(op_type, {"X": x, "Y": y}, {"axis": axis})["Out"]
    assert out.dtype == np.bool_ and out.shape == xs


def test_compare_integers():
    out = run_op("less_than", {"X": np.array([3]), "Y": np.array([5])})["Out"]
    assert out.dtype == np.bool_ and out.tolist() == [True]


# -- feed and fetch ------------------------------------------------------------------------


def test_program_with_feed_and_fetch_ops():
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("feed", type=VarType.FEED_MINIBATCH, persistable=True)
    block.create_var("fetch", type=VarType.FETCH_LIST, persistable=True)
    block.create_var("x", shape=[-1, 3], dtype="float32")
    block.create_var("y", shape=[-1, 3], dtype="float32")
    block.create_var("y2")
    REGISTRY.append_op(block, "feed", {"X": "feed"}, {"Out": "x"}, {"col": 0})
    REGISTRY.append_op(block, "feed", {"X": "feed"}, {"Out": "y"}, {"col": 1})
    REGISTRY.append_op(block, "scale", {"X": "y"}, {"Out": "y2"}, {"scale": 2.0})
    REGISTRY.append_op(block, "fetch", {"X": "y2"}, {"Out": "fetch"}, {"col": 0})
    REGISTRY.append_op(block, "fetch", {"X": "x"}, {"Out": "fetch"}, {"col": 1})
    fluidps.verify(program)
    x, y = rand(2, 3).astype(np.float32), rand(4, 3).astype(np.float32)
    exe = fluidps.Executor()
    got_y2, got_x = exe.run(program, feed={"x": x, "y": y})
    np.testing.assert_allclose(got_y2, 2 * y)
    np.testing.assert_array_equal(got_x, x)
    # A fetch list still works alongside the program's fetch ops.
    (got,) = exe.run(program, feed={"x": x, "y": y}, fetch_list=["y2"])
    np.testing.assert_allclose(got, 2 * y)


# -- schemas of the ops added here ---------------------------------------------------------

NEW_OPS = {
    "fill_zeros_like": ({"X": ([2, 3], "float32", VarType.LOD_TENSOR)}, {}, ([2, 3], VarType.FP32)),
    "merge_selected_rows": ({"X": ([10, 4], "float32", VarType.SELECTED_ROWS)}, {}, ([10, 4], VarType.FP32)),
    "get_tensor_from_selected_rows": (
        {"X": ([10, 4], "float64", VarType.SELECTED_ROWS)},
        {},
        ([-1, 4], VarType.FP64),
    ),
    "less_than": (
        {"X": ([-1, 3, 4], "float32", VarType.LOD_TENSOR), "Y": ([3], "float32", VarType.LOD_TENSOR)},
        {"axis": 1},
        ([-1, 3, 4], VarType.BOOL),
    ),
    "greater_equal": (
        {"X": ([1], "int64", VarType.LOD_TENSOR), "Y": ([1], "int64", VarType.LOD_TENSOR)},
        {},
        ([1], VarType.BOOL),
    ),
}


@pytest.mark.parametrize("op_type", sorted(NEW_OPS))
def test_new_op_schemas_verify(op_type):
    inputs, attrs, (shape, dtype) = NEW_OPS[op_type]
    program = fluidps.Program()
    block = program.global_block()
    for slot, (s, dt, kind) in inputs.items():
        block.create_var(slot.lower(), shape=s, dtype=dt, type=kind)
    block.create_var("out")
    REGISTRY.append_op(block, op_type, {slot: slot.lower() for slot in inputs}, {"Out": "out"}, attrs)
    fluidps.verify(program)
    out = block.var("out")
    assert (list(out.shape), out.dtype) == (shape, dtype)
    assert REGISTRY[op_type].grad is None and REGISTRY.has_kernel(op_type)


def test_sparse_ops_need_selected_rows():
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("x", shape=[4, 2], dtype="float32")
    block.create_var("o")
    with pytest.raises(fluidps.ShapeError, match="SelectedRows"):
        REGISTRY.append_op(block, "merge_selected_rows", {"X": "x"}, {"Out": "o"})


def test_compare_needs_one_dtype():
    program = fluidps.Program()
    block = program.global_block()
    block.create_var("x", shape=[4], dtype="float32")
    block.create_var("y", shape=[4], dtype="int64")
    block.create_var("o")
    with pytest.raises(fluidps.ShapeError, match="same dtype"):
        REGISTRY.append_op(block, "less_than", {"X": "x", "Y": "y"}, {"Out": "o"})
