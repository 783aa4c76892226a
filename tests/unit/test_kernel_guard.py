"""What a program cannot do to the process running it (issue 43, items 1, 2 and 6).

numba's kernels do no bounds checks, so a program whose values do not fit together must
be refused before a kernel sees them: by verify, where the declarations tell, and by the
block runner's shape guard (fluidps.executor.shape_guard), where only the values do.
Cases that crashed the process before are run in a subprocess (with its memory bounded),
so that a regression fails its test instead of killing the test runner.
"""

from __future__ import annotations

import resource
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import fluidps
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.compiler import Compiler, ModuleCache

ISOLATED_MEMORY = 4 << 30  # what a subprocess may map: a runaway allocation fails there, not here


def isolated(code: str, timeout: float = 240) -> str:
    """Run `code` in a fresh interpreter (memory bounded); its stdout, once it exits cleanly."""

    def bound_memory() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ISOLATED_MEMORY, ISOLATED_MEMORY))

    result = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=bound_memory,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr[-3000:]}"
    return result.stdout


PRELUDE = """
import warnings
import numpy as np
import fluidps
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.compiler import Compiler, ModuleCache
warnings.simplefilter("ignore")


def program(op_type, inputs, outputs, attrs=None, **declared):
    main = fluidps.Program()
    block = main.global_block()
    for name, shape in declared.items():
        block.create_var(name, shape=shape, dtype="float32", need_check_feed=True)
    block._append_op_unchecked(op_type, inputs, outputs, attrs or {})  # past the builder's checks
    return main


def outcome(call):
    try:
        call()
        return "ran"
    except fluidps.Error as e:
        return f"{type(e).__name__}: {e}".replace("\\n", " | ")  # one line per outcome
"""


def activation_grad(op_type: str, grad_shape: list[int]) -> fluidps.Program:
    main = fluidps.Program()
    block = main.global_block()
    for name, shape in (("x", [-1, 4096]), ("g", grad_shape), ("dx", [-1, 4096])):
        block.create_var(name, shape=shape, dtype="float32", need_check_feed=True)
    source = "X" if op_type == "log_grad" else "Out"
    block._append_op_unchecked(op_type, {source: "x", "Out@GRAD": "g"}, {"X@GRAD": "dx"})
    return main


# -- 1. a gradient that does not match its forward variable -----------------------------------


@pytest.mark.parametrize("op_type", ["relu_grad", "tanh_grad", "log_grad"])
def test_a_gradient_of_another_shape_than_its_variable_fails_verify(op_type):
    (problem,) = fluidps.check(activation_grad(op_type, [1]))
    assert f"block 0, op #0 ({op_type})" in problem
    assert "Out@GRAD (g [1] float32) does not match forward output Out" in problem
    assert "[-1, 4096]" in problem and "fix the program that computes or feeds 'g'" in problem


@pytest.mark.parametrize("op_type", ["relu_grad", "tanh_grad", "log_grad"])
def test_running_such_a_gradient_is_refused_not_a_heap_corruption(op_type):
    out = isolated(f"""
        source = "X" if {op_type!r} == "log_grad" else "Out"
        main = program({op_type!r}, {{source: "x", "Out@GRAD": "g"}}, {{"X@GRAD": "dx"}},
                       x=[-1, 4096], g=[1], dx=[-1, 4096])
        feed = {{"x": np.ones((4, 4096), "float32"), "g": np.ones(1, "float32")}}
        print(outcome(lambda: fluidps.Executor(compile=False).run(main, feed=feed, fetch_list=["dx"])))
    """)
    assert out.startswith("VerifyError") and "Out@GRAD (g [1] float32) does not match" in out


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreted", "compiled"])
@pytest.mark.parametrize("op_type", ["relu_grad", "tanh_grad", "log_grad"])
def test_fed_batches_that_differ_are_refused_before_the_kernel_runs(op_type, compiled, tmp_path):
    """Both declared [-1, 4096], so verify passes; the values (4, 4096) and (3, 4096) do not
    fit, and the guard says so before the kernel (or the compiled segment) would read past g."""
    out = isolated(f"""
        source = "X" if {op_type!r} == "log_grad" else "Out"
        main = program({op_type!r}, {{source: "x", "Out@GRAD": "g"}}, {{"X@GRAD": "dx"}},
                       x=[-1, 4096], g=[-1, 4096], dx=[-1, 4096])
        compiler = Compiler(ModuleCache({str(tmp_path)!r}), min_ops=1, compile_after=1) if {compiled} else False
        exe = fluidps.Executor(compile=compiler)
        feed = {{"x": np.ones((64, 4096), "float32"), "g": np.ones((3, 4096), "float32")}}
        print(outcome(lambda: exe.run(main, feed=feed, fetch_list=["dx"])))
        print("compiled ops:", exe.compiled_ops())
    """)
    assert out.startswith(f"ExecutionError: block 0, op #0 ({op_type}) failed: op '{op_type}': Out@GRAD")
    assert "g [3, 4096] float32" in out and "[64, 4096]" in out and "values it was given at run time" in out
    assert f"compiled ops: {int(compiled)}" in out


# -- 2. attributes that size allocations -------------------------------------------------------

AXIS_RULE = r"axis must be in [-1, rank(X) - rank(Y)] = [-1, 1]"


def elementwise_add_grad(axis: int) -> fluidps.Program:
    main = fluidps.Program()
    block = main.global_block()
    for name, shape in (("x", [-1, 4]), ("y", [4]), ("g", [-1, 4]), ("dx", [-1, 4]), ("dy", [4])):
        block.create_var(name, shape=shape, dtype="float32", need_check_feed=True)
    block._append_op_unchecked(
        "elementwise_add_grad",
        {"X": "x", "Y": "y", "Out@GRAD": "g"},
        {"X@GRAD": "dx", "Y@GRAD": "dy"},
        {"axis": axis},
    )
    return main


@pytest.mark.parametrize("axis", [2**31 - 1, 7, -5])
def test_a_grad_ops_axis_is_checked_by_its_forward_ops_rule_in_verify(axis):
    (problem,) = fluidps.check(elementwise_add_grad(axis))
    assert (
        "op #0 (elementwise_add_grad)" in problem and "checked as its forward op 'elementwise_add'" in problem
    )
    assert f"attribute axis={axis}" in problem and AXIS_RULE in problem


@pytest.mark.parametrize("axis", [2**31 - 1, 7])
def test_a_grad_ops_bad_axis_is_an_error_at_run_time_not_an_allocation(axis):
    """Past verify (a block runner alone), the guard says the same before the kernel
    would build a 2**31-element shape tuple."""
    out = isolated(f"""
        main = program("elementwise_add_grad", {{"X": "x", "Y": "y", "Out@GRAD": "g"}},
                       {{"X@GRAD": "dx", "Y@GRAD": "dy"}}, {{"axis": {axis}}},
                       x=[-1, 4], y=[4], g=[-1, 4], dx=[-1, 4], dy=[4])
        env = {{"x": np.ones((2, 4), "float32"), "y": np.ones(4, "float32"), "g": np.ones((2, 4), "float32")}}
        print(outcome(lambda: fluidps.Executor().run(main, feed=env)))
        print(outcome(lambda: BlockRunner(main.global_block()).run(env)))
    """)
    verified, ran = out.splitlines()
    assert verified.startswith("VerifyError") and AXIS_RULE in verified
    assert ran.startswith("ExecutionError: block 0, op #0 (elementwise_add_grad) failed")
    assert f"attribute axis={axis}" in ran and AXIS_RULE in ran


@pytest.mark.parametrize(
    "op_type, shape",
    [("fill_constant", [2**40]), ("uniform_random", [2**20, 2**20]), ("gaussian_random", [2**38])],
)
def test_an_output_larger_than_memory_is_refused_before_anything_is_allocated(op_type, shape):
    main = fluidps.Program()
    block = main.global_block()
    block.create_var("out", shape=shape, dtype="float32")
    block._append_op_unchecked(op_type, {}, {"Out": "out"}, {"shape": shape, "dtype": 5})
    with pytest.raises(fluidps.ExecutionError) as info:
        fluidps.Executor().run(main, fetch_list=[])
    message = str(info.value)
    assert message.startswith(
        f"block 0, op #0 ({op_type}): cannot build its kernel: its output 'out' would be"
    )
    assert (
        "bytes of memory this machine can give" in message and f"check its attribute shape={shape}" in message
    )


def test_an_output_its_inputs_make_too_large_is_refused_at_run_time():
    """Broadcasting x (n, 1) with y (1, n) makes n * n elements: no attribute to blame,
    so the message names the inputs; the kernel never runs."""
    from fluidps.executor.shape_guard import memory_limit

    n = int(np.sqrt(memory_limit() // 4)) + 1024
    main = fluidps.Program()
    block = main.global_block()
    for name, shape in (("x", [-1, 1]), ("y", [1, -1]), ("out", [-1, -1])):
        block.create_var(name, shape=shape, dtype="float32", need_check_feed=True)
    block._append_op_unchecked("elementwise_add", {"X": "x", "Y": "y"}, {"Out": "out"}, {"axis": -1})
    feed = {"x": np.ones((n, 1), np.float32), "y": np.ones((1, n), np.float32)}
    with pytest.raises(
        fluidps.ExecutionError, match=r"op #0 \(elementwise_add\) failed: its output 'out' would be"
    ):
        fluidps.Executor(compile=False).run(main, feed=feed, fetch_list=[])


def test_a_memory_error_in_a_kernel_says_out_of_memory_and_names_the_op():
    main = fluidps.Program()
    block = main.global_block()
    for name in ("x", "out"):
        block.create_var(name, shape=[-1, 3], dtype="float32")
    block._append_op_unchecked("relu", {"X": "x"}, {"Out": "out"})
    runner = BlockRunner(block)

    def exhausted(env):
        raise MemoryError  # what numpy raises when an allocation fails: no words of its own

    runner.runners[0] = exhausted
    with pytest.raises(fluidps.ExecutionError, match=r"block 0, op #0 \(relu\) failed: out of memory"):
        runner.run({"x": np.ones((2, 3), np.float32)})


# -- 6. what inference must prove for compiled segments ---------------------------------------


def test_a_compiled_segments_mismatch_is_caught_naming_the_op_inside_it(tmp_path, mlp):
    main, startup, loss = mlp
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.SGD(0.1).minimize(loss)
    exe = fluidps.Executor(compile=Compiler(ModuleCache(tmp_path), compile_after=1))
    exe.run(startup)
    startup_ops = exe.compiled_ops()
    rng = np.random.default_rng(0)
    x, y = rng.random((8, 64), dtype=np.float32), rng.integers(0, 10, (8, 1))
    exe.run(main, feed={"x": x, "y": y}, fetch_list=[loss])
    assert exe.compiled_ops() - startup_ops == len(main.global_block().ops)  # all of it compiled
    with pytest.raises(fluidps.ExecutionError) as info:
        exe.run(main, feed={"x": x, "y": y[:5]}, fetch_list=[loss])
    message = str(info.value)
    assert (
        "(softmax_with_cross_entropy) failed" in message
        and "Label must have shape [8, 1], got [5, 1]" in message
    )
    assert "(inferred)" in message  # the logits, which the segment had not made yet


def test_a_beta_power_with_no_element_is_refused_before_a_compiled_adam_writes_it(tmp_path):
    """Compiled adam reads and writes Beta1Pow's element [0] unchecked: adam's inference
    says a beta power holds one value, and the guard holds a run to it."""
    out = isolated(f"""
        main = fluidps.Program()
        block = main.global_block()
        for name, shape in [("p", [4, 5]), ("m1", [4, 5]), ("m2", [4, 5]), ("lr", [1]), ("b1", [-1]), ("b2", [1])]:
            block.create_var(name, shape=shape, dtype="float32", persistable=True)
        block.create_var("g", shape=[4, 5], dtype="float32", need_check_feed=True)
        slots = dict(Param="p", Moment1="m1", Moment2="m2", Beta1Pow="b1", Beta2Pow="b2")
        block._append_op_unchecked("adam", {{**slots, "Grad": "g", "LearningRate": "lr"}},
                                   {{k + "Out": v for k, v in slots.items()}})
        exe = fluidps.Executor(compile=Compiler(ModuleCache({str(tmp_path)!r}), min_ops=1, compile_after=1))
        for name in ("p", "m1", "m2"):
            exe.scope[name] = np.zeros((4, 5), np.float32)
        exe.scope["lr"], exe.scope["b1"], exe.scope["b2"] = (np.full(n, 0.5, np.float32) for n in (1, 0, 1))
        print(outcome(lambda: exe.run(main, feed={{"g": np.ones((4, 5), np.float32)}})))
    """)
    assert out.startswith(
        "ExecutionError: block 0, op #0 (adam) failed: op 'adam': Beta1Pow b1 [0] float32 must hold one value"
    )


# -- found by the fuzzer: inference and kernels sized by an attribute before checking it ------


def test_a_split_into_more_parts_than_outputs_is_refused_before_the_parts_are_listed():
    """split's inference made a list of `num` sections (2**31 - 1: 16 GB) before it
    compared them with its outputs."""
    out = isolated("""
        main = program("split", {"X": "x"}, {"Out": ["a", "b"]}, {"num": 2**31 - 1, "axis": 1},
                       x=[-1, 4], a=[-1, 2], b=[-1, 2])
        print(outcome(lambda: fluidps.verify(main)))
        print(outcome(lambda: BlockRunner(main.global_block()).run({"x": np.ones((2, 4), "float32")})))
    """)
    verified, ran = out.splitlines()
    assert (
        verified.startswith("VerifyError") and "attribute num=2147483647 makes 2147483647 parts" in verified
    )
    assert ran.startswith("ExecutionError: block 0, op #0 (split) failed") and "num=2147483647" in ran


@pytest.mark.parametrize(
    "op_type, col", [("fetch", 2**31 - 1), ("fetch", -1), ("feed", 2**31 - 1), ("feed", -2)]
)
def test_a_feed_or_fetch_column_outside_its_list_is_refused(op_type, col):
    """The executor sizes the feed list by the largest column (and fetch grew its list to
    `col`): a column past the program's feed / fetch ops was a 16 GB list."""
    holder = fluidps.VarType.FEED_MINIBATCH if op_type == "feed" else fluidps.VarType.FETCH_LIST
    main = fluidps.Program()
    block = main.global_block()
    block.create_var("x", shape=[-1, 4], dtype="float32")
    block.create_var(op_type, type=holder, persistable=True)
    slots = ({"X": op_type}, {"Out": "x"}) if op_type == "feed" else ({"X": "x"}, {"Out": op_type})
    block._append_op_unchecked(op_type, *slots, {"col": col})
    (problem,) = fluidps.check(main)
    assert f"op #0 ({op_type})" in problem and f"attribute col={col} must be in [0, 1)" in problem
    with pytest.raises(fluidps.ExecutionError, match=rf"op #0 \({op_type}\) failed: .*col={col}"):
        BlockRunner(block).run({"x": np.ones((2, 4), np.float32), "feed": [np.ones((2, 4), np.float32)]})
