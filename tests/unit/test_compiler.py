"""The executor compiler (fluidps.executor.compiler): a block's ops as numba-compiled
segments give the interpreter's results, bit for bit where they call the same
helpers; what has no compiled form runs interpreted between segments; failures name
the op; generated code is reused from disk by the next process."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fluidps
from fluidps import layers, optimizer
from fluidps.executor.compiler import Compiler, ModuleCache
from fluidps.executor.compiler.segments import COMPILE_AFTER
from fluidps.ops.selected_rows import SelectedRows
from helpers import python_output


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> ModuleCache:
    """One cache directory for the module: each generated segment compiles once."""
    return ModuleCache(tmp_path_factory.mktemp("compiled"))


def _classifier(sizes, act="relu", opt="sgd", seed=1):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [sizes[0]])
        y = layers.data("y", [1], dtype="int64")
        h = x
        for width in sizes[1:-1]:
            h = layers.fc(h, width, act=act)
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, sizes[-1]), y))
        (optimizer.Adam(0.01) if opt == "adam" else optimizer.SGD(0.1)).minimize(loss)
    return main, startup, loss


def _batches(sizes, batch, count=4, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(batch, sizes[0])).astype(np.float32),
            "y": rng.integers(0, sizes[-1], (batch, 1)),
        }
        for _ in range(count)
    ]


def _train(build, batches, steps, compiler):
    """Train `steps` steps; per step the loss and every parameter's gradient (a gradient
    one rounding off would not show in parameters an update barely moves)."""
    main, startup, loss = build()
    exe = fluidps.Executor(compile=compiler or False)  # None: the interpreter
    exe.run(startup)
    fetch = [loss.name] + [p.name + "@GRAD" for p in main.all_parameters()]
    fetched = [exe.run(main, feed=batches[i % len(batches)], fetch_list=fetch) for i in range(steps)]
    params = {p.name: exe.scope[p.name].copy() for p in main.all_parameters()}
    return fetched, params, exe, main


def _dense(value):
    """A sparse gradient (SelectedRows) as the dense one it stands for."""
    return value.to_dense() if isinstance(value, SelectedRows) else value


def _assert_same_training(build, batches, steps, cache):
    want_fetched, want_params, *_ = _train(build, batches, steps, None)
    got_fetched, got_params, exe, main = _train(build, batches, steps, Compiler(cache, compile_after=2))
    (prepared,) = exe._cache[main].values()
    assert prepared.runner.segments, "nothing was compiled"
    names = ["loss"] + [p.name + "@GRAD" for p in main.all_parameters()]
    for step, (got, want) in enumerate(zip(got_fetched, want_fetched, strict=True)):
        for name, g, w in zip(names, got, want, strict=True):
            np.testing.assert_array_equal(_dense(g), _dense(w), err_msg=f"{name} of step {step}")
    for name, want in want_params.items():
        np.testing.assert_array_equal(got_params[name], want, err_msg=name)


@pytest.mark.parametrize(
    "sizes, act, opt",
    [([16, 5], "relu", "sgd"), ([16, 32, 32, 5], "relu", "sgd"), ([16, 32, 5], "tanh", "adam"), ([16, 24, 5], "sigmoid", "sgd")],
)  # fmt: skip
def test_training_compiled_is_training_interpreted_bit_for_bit(cache, sizes, act, opt):
    """Forward, backward and the optimizer's dense updates in place, over several steps
    and batch sizes (the compiled code reads sizes at run time)."""
    batches = _batches(sizes, 8) + _batches(sizes, 3, seed=1)
    _assert_same_training(lambda: _classifier(sizes, act, opt), batches, 12, cache)


def _per_parameter_rates(opt):
    """An MLP whose second layer learns at its own rate (its own LearningRate variable)."""

    def build():
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 5
        with fluidps.program_guard(main, startup):
            x = layers.data("x", [12])
            y = layers.data("y", [1], dtype="int64")
            h = layers.fc(x, 16, act="relu")
            h = layers.fc(h, 16, act="tanh", param_attr=fluidps.ParamAttr(learning_rate=0.25))
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 4), y))
            (optimizer.Adam(0.02) if opt == "adam" else optimizer.SGD(0.2)).minimize(loss)
        return main, startup, loss

    return build


@pytest.mark.parametrize("opt", ["sgd", "adam"])
def test_updates_of_many_parameters_run_as_one_loop_with_each_op_s_arithmetic(cache, opt):
    """The six updates are one batch (one call looping over the parameters), each
    parameter at its own learning rate and (adam) its own beta powers, bit for bit as
    the interpreter's one op at a time."""
    build = _per_parameter_rates(opt)
    main, _, _ = build()
    assert f"{{{opt} x6}}" in fluidps.Executor(compile=Compiler(cache, compile_after=2)).explain(main)
    sizes = [12, 16, 16, 4]
    _assert_same_training(build, _batches(sizes, 8) + _batches(sizes, 5, seed=2), 6, cache)
    unbatched = fluidps.Executor(compile=Compiler(cache, compile_after=2, fuse=False)).explain(main)
    assert f"{opt}, {opt}" in unbatched and "{" not in unbatched  # fuse=False: one op at a time


def _elementwise(op_name):
    def build():
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 3
        with fluidps.program_guard(main, startup):
            x = layers.data("x", [6])
            y = layers.data("y", [1], dtype="int64")
            h = layers.fc(x, 4, act="sigmoid")
            w = layers.create_parameter(
                [4], "float32", default_initializer=fluidps.initializer.Uniform(0.5, 1.5)
            )
            h = getattr(layers, op_name)(h, w)
            loss = layers.mean(layers.softmax_with_cross_entropy(h, y))
            optimizer.SGD(0.1).minimize(loss)
        return main, startup, loss

    return build


@pytest.mark.parametrize(
    "op_name",
    [
        "elementwise_add",
        "elementwise_sub",
        "elementwise_mul",
        "elementwise_div",
        "elementwise_max",
        "elementwise_min",
    ],
)
def test_each_elementwise_op_and_its_gradient_compile_to_the_interpreter_s_results(cache, op_name):
    sizes = [6, 4]
    _assert_same_training(_elementwise(op_name), _batches(sizes, 5), 4, cache)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    widths=st.lists(st.integers(1, 12), min_size=0, max_size=2),
    act=st.sampled_from(["relu", "tanh", "sigmoid"]),
    opt=st.sampled_from(["sgd", "adam"]),
    batch=st.integers(1, 9),
)
def test_random_small_programs_compile_to_the_interpreter_s_results(cache, widths, act, opt, batch):
    sizes = [5, *widths, 3]
    _assert_same_training(lambda: _classifier(sizes, act, opt), _batches(sizes, batch), 3, cache)


def _embedding_classifier(vocab, dim, widths, act, opt, sparse):
    """Ids through an embedding (its gradient sparse or dense), then an MLP."""

    def build():
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 2
        with fluidps.program_guard(main, startup):
            ids = layers.data("ids", [1], dtype="int64")
            y = layers.data("y", [1], dtype="int64")
            h = layers.embedding(ids, [vocab, dim], is_sparse=sparse)
            for width in widths:
                h = layers.fc(h, width, act=act)
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 3), y))
            (optimizer.Adam(0.01) if opt == "adam" else optimizer.SGD(0.1)).minimize(loss)
        return main, startup, loss

    return build


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    vocab=st.integers(2, 30),
    dim=st.integers(1, 6),
    widths=st.lists(st.integers(1, 8), min_size=0, max_size=2),
    act=st.sampled_from(["relu", "tanh", "sigmoid"]),
    opt=st.sampled_from(["sgd", "adam"]),
    sparse=st.booleans(),
    batch=st.integers(1, 7),
)
def test_random_embedding_programs_compile_to_the_interpreter_s_results(
    cache, vocab, dim, widths, act, opt, sparse, batch
):
    """The lookup and its (sparse) gradient and update run interpreted between segments."""
    rng = np.random.default_rng(vocab * 31 + batch)
    batches = [
        {"ids": rng.integers(0, vocab, (batch, 1)), "y": rng.integers(0, 3, (batch, 1))} for _ in range(3)
    ]
    _assert_same_training(_embedding_classifier(vocab, dim, widths, act, opt, sparse), batches, 3, cache)


def _chain(ops, middle=True):
    """A 3-D input through a chain of elementwise ops: biases broadcast along the middle
    dimension (loops before, along and after it) or the last, and full operands; then a
    dense layer and a loss, trained with SGD so that every gradient is used."""

    def build():
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 4
        with fluidps.program_guard(main, startup):
            x = layers.data("x", [3, 4])
            y = layers.data("y", [1], dtype="int64")
            init = fluidps.initializer.Uniform(0.5, 1.5)
            h = x
            for i, name in enumerate(ops):
                if name.startswith("elementwise"):
                    shape, axis = ([3], 1) if middle and i % 2 == 0 else ([4], -1)
                    w = layers.create_parameter(shape, "float32", default_initializer=init)
                    h = getattr(layers, name)(h, w, axis=axis)
                elif name == "full":
                    h = layers.elementwise_mul(h, layers.sigmoid(x))  # a full operand computed apart
                else:
                    h = getattr(layers, name)(h)
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 5, num_flatten_dims=1), y))
            optimizer.SGD(0.05).minimize(loss)
        return main, startup, loss

    return build


def _chain_batches(batch, count=3, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.uniform(0.2, 1.0, (batch, 3, 4)).astype(np.float32), "y": rng.integers(0, 5, (batch, 1))}
        for _ in range(count)
    ]


@pytest.mark.parametrize(
    "ops, middle",
    [
        (["elementwise_add", "tanh", "elementwise_mul", "sigmoid"], True),
        (["elementwise_div", "exp", "elementwise_sub", "square", "sqrt"], True),
        (["elementwise_mul", "relu", "full", "elementwise_max", "log"], False),
        (["square", "elementwise_min", "elementwise_add", "tanh"], False),
    ],
)
def test_fused_elementwise_chains_give_the_interpreter_s_bits(cache, ops, middle):
    build = _chain(ops, middle)
    main, _, _ = build()
    plan = fluidps.Executor(compile=Compiler(cache, compile_after=2)).explain(main)
    assert "ops fused into" in plan and "_grad+" in plan  # forward and backward runs fused
    _assert_same_training(build, _chain_batches(4) + _chain_batches(1, seed=1), 6, cache)


def test_a_run_whose_operands_do_not_line_up_at_run_time_runs_interpreted(cache):
    """Declared alike, fed differently: Y of one row is broadcast by the interpreter. The
    fused loop's check refuses it (numba does no bounds checks) and the interpreter
    computes the step, as it would have."""

    def build():
        main, startup = fluidps.Program(), fluidps.Program()
        with fluidps.program_guard(main, startup):
            a, b = layers.data("a", [4]), layers.data("b", [4])
            out = layers.tanh(layers.relu(layers.elementwise_add(a, b)))
        return main, startup, out

    def run(compiler):
        main, startup, out = build()
        exe = fluidps.Executor(compile=compiler or False)  # None: the interpreter
        exe.run(startup)
        feeds = [(3, 3), (3, 3), (3, 1)]  # compiled at the second run; the third broadcasts b
        rng = np.random.default_rng(2)
        return [
            exe.run(
                main,
                feed={
                    "a": rng.normal(size=(n, 4)).astype(np.float32),
                    "b": rng.normal(size=(m, 4)).astype(np.float32),
                },
                fetch_list=[out],
            )[0]
            for n, m in feeds
        ]

    for got, want in zip(run(Compiler(cache, compile_after=2)), run(None), strict=True):
        np.testing.assert_array_equal(got, want)


def test_an_array_fetched_or_read_later_is_never_overwritten(cache):
    """The backward run of the hidden layer stores its gradient over the layer's
    activations, dead by then; fetched, they are kept, and hold what the interpreter's do."""
    sizes = [6, 8, 3]
    batches = _batches(sizes, 5)

    def fetch_hidden(compiler):
        main, startup, loss = _classifier(sizes)
        exe = fluidps.Executor(compile=compiler or False)  # None: the interpreter
        exe.run(startup)
        wanted = [loss.name, "fc_0.tmp_2", "fc_0.tmp_0@GRAD"]
        return [exe.run(main, feed=batches[i % 4], fetch_list=wanted) for i in range(3)], exe, main

    want, _, _ = fetch_hidden(None)
    got, exe, main = fetch_hidden(Compiler(cache, compile_after=2))
    assert "1 stored in dead arrays" in exe.explain(main)  # without the fetch, it would be
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for name, a, b in zip(["loss", "activations", "gradient"], g, w, strict=True):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} of step {step}")


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_a_gradient_of_an_operand_broadcast_at_run_time_is_the_interpreter_s(cache, fuse):
    """Y declared [-1, 4] like X, fed one row: its gradient sums X's rows, as the
    interpreter's does; the compiled code, which cannot tell from the declarations,
    checks and hands the step to the interpreter."""

    def run(compiler):
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 1
        with fluidps.program_guard(main, startup):
            a, b = layers.data("a", [4]), layers.data("b", [4])
            w = layers.create_parameter(
                [4], "float32", default_initializer=fluidps.initializer.Uniform(0.5, 1.5)
            )
            y = layers.elementwise_mul(b, w)
            loss = layers.mean(layers.elementwise_add(layers.fc(a, 4), y))
            optimizer.SGD(0.1).minimize(loss)
        exe = fluidps.Executor(compile=compiler or False)  # None: the interpreter
        exe.run(startup)
        rng = np.random.default_rng(0)
        return [
            exe.run(
                main,
                feed={
                    "a": rng.normal(size=(3, 4)).astype(np.float32),
                    "b": rng.normal(size=(m, 4)).astype(np.float32),
                },
                fetch_list=[loss, w.name + "@GRAD", y.name + "@GRAD"],
            )
            for m in (3, 3, 1, 1)
        ]

    for step, (got, want) in enumerate(
        zip(run(Compiler(cache, compile_after=2, fuse=fuse)), run(None), strict=True)
    ):
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            np.testing.assert_array_equal(g, w, err_msg=f"step {step}")


def test_explain_names_the_segments_and_why_other_ops_run_interpreted():
    main, _, _ = _classifier([8, 16, 4])
    with fluidps.program_guard(main):
        probabilities = layers.softmax(main.global_block().var("fc_1.tmp_1"))
        layers.accuracy(layers.cast(probabilities, "float64"), main.global_block().var("y"))
    text = fluidps.Executor(compile=True).explain(main)
    assert text.startswith(f"block 0: {len(main.global_block().ops)} ops, ")
    assert "one compiled call (mul, [elementwise_add+relu], mul" in text
    assert "[relu_grad+elementwise_add_grad], mul_grad" in text
    # the pre-activation (16 floats a row) and its gradient are passed along as scalars
    # ... and the hidden layer's gradient is written over its activations, dead by then
    assert "4 ops fused into 2 loops, 2 arrays never stored (128 bytes per batch row), " in text
    assert "1 stored in dead arrays (64 bytes per batch row)" in text
    assert "op #" in text and "(cast): interpreted: op 'cast' has no lowering" in text
    assert "one compiled call (top_k, accuracy" in text
    assert "one compiled call ({sgd x4})" in text  # the updates: one loop over the parameters


def test_a_failure_in_a_compiled_segment_names_the_op(cache):
    """numba does no bounds checks: a label out of range is caught before the kernel,
    and the segment, run again by the interpreter, says which op and which label."""
    main, startup, loss = _classifier([4, 3])
    exe = fluidps.Executor(compile=Compiler(cache, compile_after=2))
    exe.run(startup)
    x = np.ones((2, 4), np.float32)
    exe.run(main, feed={"x": x, "y": np.array([[0], [2]])}, fetch_list=[loss])
    before = {p.name: exe.scope[p.name].copy() for p in main.all_parameters()}
    with pytest.raises(
        fluidps.ExecutionError, match=r"op #\d+ \(softmax_with_cross_entropy\) failed: .*label 7"
    ):
        exe.run(main, feed={"x": x, "y": np.array([[0], [7]])}, fetch_list=[loss])
    for name, value in before.items():  # the failed step changed nothing
        np.testing.assert_array_equal(exe.scope[name], value, err_msg=name)
    with pytest.raises(fluidps.ExecutionError, match=r"\(elementwise_add\) failed: .*do not broadcast"):
        _run_two_feeds(cache)


def _run_two_feeds(cache):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        out = layers.relu(layers.elementwise_add(layers.data("a", [4]), layers.data("b", [4])))
    exe = fluidps.Executor(compile=Compiler(cache, compile_after=2))
    exe.run(startup)
    for b in (3, 2):  # compiled at the second run, which gets two batch sizes
        exe.run(
            main, feed={"a": np.ones((3, 4), np.float32), "b": np.ones((b, 4), np.float32)}, fetch_list=[out]
        )


_CACHED_RUN = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import fluidps
    from fluidps import layers, optimizer
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4]); y = layers.data("y", [1], dtype="int64")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(x, 3, act="relu"), y))
        optimizer.SGD(0.1).minimize(loss)
    exe = fluidps.Executor(compile=True, cache_dir=sys.argv[1])
    exe.run(startup)
    compiled_at = None
    for run in range(1, int(sys.argv[2]) + 1):
        exe.run(main, feed={"x": np.ones((2, 4), np.float32), "y": np.zeros((2, 1), np.int64)}, fetch_list=[loss])
        (prepared,) = exe._cache[main].values()
        compiled_at = compiled_at or (run if prepared.runner.segments else None)
    stats = [s.fn.stats for s in prepared.runner.segments.values()]
    print(json.dumps({"hits": sum(sum(s.cache_hits.values()) for s in stats), "compiled_at": compiled_at,
                      "misses": sum(sum(s.cache_misses.values()) for s in stats), "segments": len(stats)}))
    """
)


def test_a_block_compiles_after_some_runs_and_at_its_second_when_a_process_compiled_it_before(tmp_path):
    """A program run a few times is not worth a compile: the first process compiles at
    run COMPILE_AFTER; the next, finding the code on disk, loads it at its second run."""
    runs = []
    for count in (COMPILE_AFTER + 2, 3):
        output = python_output(_CACHED_RUN, str(tmp_path), str(count))
        runs.append(json.loads(output.strip().splitlines()[-1]))
    first, second = runs
    assert (first["compiled_at"], second["compiled_at"]) == (COMPILE_AFTER, 2)
    assert first["segments"] == second["segments"] >= 2
    assert first["misses"] == first["segments"] and first["hits"] == 0  # compiled, then stored
    assert second["hits"] == second["segments"] and second["misses"] == 0  # loaded, not compiled
    # The startup program ran once: interpreted, nothing of it compiled.
    assert len(list(tmp_path.glob("*.py"))) == first["segments"]


def test_executors_compile_unless_fluidps_compile_is_0(monkeypatch, tmp_path):
    monkeypatch.delenv("FLUIDPS_COMPILE", raising=False)
    monkeypatch.setenv("FLUIDPS_CACHE_DIR", str(tmp_path))
    exe = fluidps.Executor()  # the default
    assert exe.compiler is not None and exe.compiler.cache.directory == tmp_path
    monkeypatch.setenv("FLUIDPS_COMPILE", "1")
    assert fluidps.Executor().compiler is not None
    assert fluidps.Executor(compile=False).compiler is None  # the argument wins
    monkeypatch.setenv("FLUIDPS_COMPILE", "0")
    assert fluidps.Executor().compiler is None
    assert fluidps.Executor(compile=True).compiler is not None
    monkeypatch.setenv("FLUIDPS_COMPILE", "yes")
    with pytest.raises(fluidps.BuilderError, match="FLUIDPS_COMPILE='yes' is invalid"):
        fluidps.Executor()


def test_a_block_that_cannot_be_compiled_runs_interpreted_with_a_warning(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    main, startup, loss = _classifier([4, 3])
    exe = fluidps.Executor(compile=Compiler(ModuleCache(tmp_path / "a-file" / "cache"), compile_after=2))
    exe.run(startup)
    feed = _batches([4, 3], 2)[0]
    exe.run(main, feed=feed, fetch_list=[loss])
    with pytest.warns(
        RuntimeWarning, match="block 0 runs interpreted: it could not be compiled .*cannot write"
    ):
        (second,) = exe.run(main, feed=feed, fetch_list=[loss])
    (prepared,) = exe._cache[main].values()
    assert not prepared.runner.segments and np.isfinite(second)
