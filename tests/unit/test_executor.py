"""Executor and Scope: feeding, fetching, caching, and errors a person can act on."""

from __future__ import annotations

import numpy as np
import pytest

import fluidps
from fluidps import layers
from fluidps.ops.selected_rows import SelectedRows


def _linear():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [3])
        out = layers.fc(x, 2, act="relu")
    return main, startup, x, out


def test_scope_mapping_and_parent_chain():
    parent = fluidps.Scope()
    parent["w"] = [[1.0, 2.0]]
    child = parent.new_scope()
    child["b"] = np.zeros(2, np.float32)
    assert "w" in child and "b" in child and "b" not in parent
    assert isinstance(child["w"], np.ndarray) and child["w"].shape == (1, 2)
    assert child.owner("w") is parent and child.find("nope") is None
    assert list(child) == ["b"] and len(parent) == 1
    with pytest.raises(KeyError, match="'nope' is not in the scope"):
        child["nope"]
    child["rows"] = SelectedRows([1, 1], np.ones((2, 2)), height=4)
    assert isinstance(child["rows"], SelectedRows)


def test_run_startup_then_main_fetch_by_variable_and_name():
    main, startup, _x, out = _linear()
    exe = fluidps.Executor()
    assert exe.run(startup) == []
    w, b = exe.scope["fc_0.w_0"], exe.scope["fc_0.b_0"]
    assert w.shape == (3, 2) and w.dtype == np.float32 and not b.any()
    feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    by_var, by_name = exe.run(main, feed=feed, fetch_list=[out, "fc_0.tmp_0"])
    np.testing.assert_allclose(by_var, np.maximum(feed["x"] @ w + b, 0), rtol=1e-6)
    np.testing.assert_allclose(by_name, feed["x"] @ w, rtol=1e-6)


def test_run_batches_yields_what_run_gives_each_batch_taking_each_batch_one_step_early():
    main, startup, _x, out = _linear()
    exe = fluidps.Executor()
    exe.run(startup)
    feeds = [{"x": np.full((2, 3), k, np.float32)} for k in range(3)]
    taken = []

    def batches():
        for feed in feeds:
            taken.append(len(taken))
            yield feed

    steps = exe.run_batches(main, batches(), [out])
    first = next(steps)
    assert taken == [0, 1]  # the next batch is known while the first runs
    got = [first, *steps]
    assert len(got) == 3
    for feed, (value,) in zip(feeds, got, strict=True):
        np.testing.assert_array_equal(value, exe.run(main, feed=feed, fetch_list=[out])[0])
    assert list(exe.run_batches(main, [], [out])) == []


def test_explicit_scope_keeps_values_apart():
    main, startup, _, out = _linear()
    exe = fluidps.Executor()
    a, b = fluidps.Scope(), fluidps.Scope()
    exe.run(startup, scope=a)
    exe.run(startup, scope=b)
    b["fc_0.w_0"] = np.zeros((3, 2), np.float32)
    feed = {"x": np.ones((1, 3), np.float32)}
    (out_a,) = exe.run(main, feed=feed, fetch_list=[out], scope=a)
    (out_b,) = exe.run(main, feed=feed, fetch_list=[out], scope=b)
    assert out_a.any() and not out_b.any()
    assert "fc_0.w_0" not in exe.scope


def test_prepared_programs_are_cached_per_version_and_names():
    main, startup, _, out = _linear()
    exe = fluidps.Executor()
    exe.run(startup)
    first = exe.prepare(main, ["x"], [out.name])
    assert exe.prepare(main, ["x"], [out.name]) is first
    assert exe.prepare(main, ["x"], ["fc_0.tmp_0"]) is not first
    with fluidps.program_guard(main, startup):
        layers.scale(out, 2.0)
    assert exe.prepare(main, ["x"], [out.name]) is not first


def test_prepared_programs_are_keyed_by_the_feed_names():
    main, startup, _, out = _linear()
    with fluidps.program_guard(main, startup):
        layers.data("y", [3])  # a second data variable `out` does not read
    exe = fluidps.Executor()
    exe.run(startup)
    both = exe.prepare(main, ["x", "y"], [out.name])
    assert exe.prepare(main, ["y", "x"], [out.name]) is both  # a feed dict's order is no key
    x_only = exe.prepare(main, ["x"], [out.name])
    assert x_only is not both and exe.prepare(main, ["x"], [out.name]) is x_only
    # exe.run prepares by the feed dict's keys: both entries are reused, neither replaced.
    batch = np.ones((2, 3), np.float32)
    (with_y,) = exe.run(main, feed={"y": batch, "x": batch}, fetch_list=[out])
    (without_y,) = exe.run(main, feed={"x": batch}, fetch_list=[out])
    np.testing.assert_array_equal(with_y, without_y)
    assert exe.prepare(main, {"y": 0, "x": 0}.keys(), [out.name]) is both
    assert exe.prepare(main, {"x": 0}.keys(), [out.name]) is x_only
    assert exe.prepare(main, ["y"], [out.name]) not in (both, x_only)


def test_persistable_fetches_are_copies():
    main, startup, _, _ = _linear()
    exe = fluidps.Executor()
    exe.run(startup)
    (w,) = exe.run(main, feed={"x": np.ones((1, 3), np.float32)}, fetch_list=["fc_0.w_0"])
    w[:] = 7
    assert not (exe.scope["fc_0.w_0"] == 7).any()


def test_feed_errors_say_what_to_do():
    main, startup, _, out = _linear()
    exe = fluidps.Executor()
    exe.run(startup)
    with pytest.raises(
        fluidps.FeedError, match="feed 'y' is not a variable of the program; its data variables are x"
    ):
        exe.run(main, feed={"y": np.ones((1, 3), np.float32)}, fetch_list=[out])
    with pytest.raises(
        fluidps.FeedError, match=r"has dtype float64; the program declares float32: pass the array \.astype"
    ):
        exe.run(main, feed={"x": np.ones((1, 3))}, fetch_list=[out])
    with pytest.raises(fluidps.FeedError, match=r"has shape \[2, 4\]; the program declares \[-1, 3\]"):
        exe.run(main, feed={"x": np.ones((2, 4), np.float32)}, fetch_list=[out])
    with pytest.raises(fluidps.FeedError, match=r"reads 'x' .* neither fed nor computed"):
        exe.run(main, fetch_list=[out])
    # Lists are converted to the declared dtype.
    (value,) = exe.run(main, feed={"x": [[1, 2, 3]]}, fetch_list=[out])
    assert value.shape == (1, 2)


def test_missing_parameters_and_unknown_fetches():
    main, _, _, out = _linear()
    exe = fluidps.Executor()
    with pytest.raises(
        fluidps.ExecutionError, match=r"'fc_0\.w_0' is not initialized in the scope: run the startup program"
    ):
        exe.run(main, feed={"x": np.ones((1, 3), np.float32)}, fetch_list=[out])
    with pytest.raises(fluidps.ProgramError, match="needs a Program"):
        exe.run(None)


def test_kernel_failures_name_block_op_and_variables():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        emb = layers.embedding(ids, [10, 4])
    exe = fluidps.Executor()
    exe.run(startup)
    with pytest.raises(fluidps.ExecutionError) as info:
        exe.run(main, feed={"ids": np.array([[3], [12]], np.int64)}, fetch_list=[emb])
    text = str(info.value)
    assert "block 0, op #0 (lookup_table) failed" in text
    assert "12" in text and "10" in text
    assert "ids int64[2, 1]" in text and "embedding_0.w_0 float32[10, 4]" in text


def _two_inputs(combine):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        y = layers.data("y", [4])
        out = combine(x, y)
    return main, startup, out


@pytest.mark.parametrize(
    "combine, why",
    [
        (layers.elementwise_add, r"shapes \[3, 4\] and \[2, 4\] do not broadcast"),
        (lambda x, y: layers.concat([x, y], axis=1), r"inputs differ in dimension 0 \(3 vs 2\)"),
        (lambda x, y: layers.elementwise_mul(layers.fc(x, 4), y), r"shapes \[3, 4\] and \[2, 4\] do not broadcast"),
    ],
)  # fmt: skip
def test_values_that_do_not_fit_together_at_run_time_are_explained_in_our_words(combine, why):
    """The declared shapes let batch sizes vary, so feeds of different batch sizes pass the
    feed check; the op that meets them says which shapes clash (its shape inference run on
    the values it was given), not numpy's or numba's words."""
    main, startup, out = _two_inputs(combine)
    exe = fluidps.Executor()
    exe.run(startup)
    feed = {"x": np.ones((3, 4), np.float32), "y": np.ones((2, 4), np.float32)}
    with pytest.raises(fluidps.ExecutionError, match=why) as info:
        exe.run(main, feed=feed, fetch_list=[out])
    assert "do not fit together; check the feeds' shapes" in str(info.value)
    assert "broadcast argument" not in str(info.value) and "must match exactly" not in str(info.value)


def test_an_empty_batch_runs():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        outs = [layers.fc(x, 3, act="relu"), layers.reshape(x, [0, -1, 2]), layers.softmax(x)]
    exe = fluidps.Executor()
    exe.run(startup)
    got = exe.run(main, feed={"x": np.ones((0, 4), np.float32)}, fetch_list=outs)
    assert [g.shape for g in got] == [(0, 3), (0, 2, 2), (0, 4)]


def _edited(build, op_type: str, **attrs):
    """A program of `build`'s ops whose `op_type` op got `attrs` (as a file could say)."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        build()
    (op,) = [op for op in main.global_block().ops if op.type == op_type]
    for name, value in attrs.items():
        op.set_attr(name, value)
    return fluidps.Program.parse_from_string(main.serialize_to_string())


@pytest.mark.parametrize(
    "build, op_type, attrs, why",
    [
        (lambda: layers.cast(layers.data("x", [3]), "float64"), "cast", {"out_dtype": 999},
         "out_dtype=999 is not an element type"),
        (lambda: layers.reduce_sum(layers.data("x", [3]), dim=1), "reduce_sum", {"dim": [99]},
         "dim 99 is out of range for rank 2"),
        (lambda: layers.elementwise_add(layers.data("x", [3]), layers.data("y", [3])), "elementwise_add",
         {"axis": 7}, r"axis=7 cannot align .*: axis must be in \[-1, rank\(X\) - rank\(Y\)\]"),
        (lambda: layers.conv2d(layers.data("x", [1, 8, 8]), 2, 3), "conv2d", {"dilations": [0, 0]},
         r"dilations=\[0, 0\]"),
        (lambda: layers.pool2d(layers.data("x", [1, 8, 8]), 2), "pool2d", {"ksize": [0, 0]}, r"bad ksize=\[0, 0\]"),
        (lambda: layers.pool2d(layers.data("x", [1, 8, 8]), 2), "pool2d", {"paddings": [-1, -1]},
         r"paddings=\[-1, -1\] must be >= 0"),
        (lambda: layers.conv2d(layers.data("x", [1, 8, 8]), 2, 3), "conv2d", {"strides": [0, 0]},
         r"strides=\[0, 0\]"),
    ],
)  # fmt: skip
def test_a_program_the_kernels_would_misread_is_refused_before_it_runs(build, op_type, attrs, why):
    """Executor.run verifies each program version once, before building a kernel: an
    attribute outside its op's rules is a VerifyError naming the block, the op and the
    rule, never numpy's words, a wrong result or a crash in a kernel."""
    program = _edited(build, op_type, **attrs)
    with pytest.raises(fluidps.VerifyError, match=rf"block 0, op #0 \({op_type}\): .*{why}"):
        fluidps.Executor().run(program, feed={}, fetch_list=[])


@pytest.mark.parametrize("shape", [[2**40], [2**62, 2**62]])
def test_a_constant_too_large_to_make_is_an_error_naming_the_op(shape):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        out = layers.fill_constant([2], "float32", 1.0)
    main.global_block().ops[0].set_attr("shape", shape)
    out.shape = tuple(shape)  # declared as made: verify has nothing to say
    with pytest.raises(fluidps.ExecutionError, match=r"op #0 \(fill_constant\): cannot build its kernel"):
        fluidps.Executor().run(main, fetch_list=[])


def test_a_block_that_is_its_own_parent_is_refused_before_it_runs():
    main, _, _, _ = _linear()
    main.create_block()
    main.rollback()
    main.block(1).parent_idx = 1
    with pytest.raises(fluidps.VerifyError, match="block 1: bad block index: parent_idx 1"):
        fluidps.Executor().run(main, feed={"x": np.ones((1, 3), np.float32)})


def test_programs_with_feed_and_fetch_ops_run(tmp_path):
    main, startup, _x, out = _linear()
    exe = fluidps.Executor()
    exe.run(startup)
    fluidps.io.save_inference_model(str(tmp_path), ["x"], [out], exe, main)
    program, feed_names, fetch_targets = fluidps.io.load_inference_model(str(tmp_path), exe)
    assert next(op.type for op in program.global_block().ops) == "feed"
    assert [op.type for op in program.global_block().ops][-1] == "fetch"
    batch = np.ones((2, 3), np.float32)
    (via_fetch_ops,) = exe.run(program, feed={feed_names[0]: batch})
    (direct,) = exe.run(main, feed={"x": batch}, fetch_list=[out])
    np.testing.assert_allclose(via_fetch_ops, direct)
    assert fetch_targets[0].name == out.name


def test_return_numpy_false_keeps_selected_rows():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [2], dtype="int64")
        loss = layers.mean(layers.embedding_v2(ids, [6, 3], is_sparse=True))
    (_, grad), *_ = fluidps.append_backward(loss)
    exe = fluidps.Executor()
    exe.run(startup)
    (value,) = exe.run(main, feed={"ids": np.array([[1, 4]])}, fetch_list=[grad], return_numpy=False)
    assert isinstance(value, SelectedRows) and value.height == 6 and sorted(value.rows) == [1, 4]
