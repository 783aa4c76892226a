"""A pserver's optimize blocks run joined as one block: the same bits as block by block."""

from types import SimpleNamespace

import numpy as np
import pytest

import fluidps
from fluidps import layers
from fluidps.errors import ExecutionError
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.compiler import Compiler, ModuleCache
from fluidps.executor.ps.joined_blocks import JoinedBlocks, joined_block
from fluidps.profiling import Profile
from fluidps.transpiler import DistributeTranspiler, DistributeTranspilerConfig

ENDPOINT = "127.0.0.1:6170"


def _pserver_program(optimizer, mode="sync"):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", shape=[8], dtype="float32")
        y = layers.data("y", shape=[1], dtype="float32")
        hidden = layers.fc(x, size=16, act="relu")
        loss = layers.mean(layers.elementwise_sub(layers.fc(hidden, size=1), y))
        optimizer.minimize(loss)
    t = DistributeTranspiler(DistributeTranspilerConfig(slice_var_up=False, mode=mode))
    t.transpile(0, program=main, pservers=ENDPOINT, trainers=1, startup_program=startup)
    return t.get_pserver_programs(ENDPOINT)


def _optimize_blocks(program):
    return [b.idx for b in program.blocks[1:] if any(op.type in ("sgd", "adam") for op in b.ops)]


def _env(program, startup, seed):
    env = {}
    BlockRunner(startup.global_block()).run(env)
    rng = np.random.default_rng(seed)
    for block in program.blocks[1:]:
        for op in block.ops:
            for grad, param in zip(op.input("Grad"), op.input("Param"), strict=True):
                env[grad] = rng.standard_normal(env[param].shape).astype(env[param].dtype)
    return env


def test_a_joined_block_holds_the_blocks_ops_in_order_and_leaves_the_program_as_it_was():
    program, _ = _pserver_program(fluidps.optimizer.Adam(0.01))
    ids = _optimize_blocks(program)
    assert len(ids) == 4
    before = program.serialize_to_string()
    order = [ids[2], ids[0], ids[3]]
    joined = joined_block(program, order)
    assert [op.type for op in joined.ops] == [op.type for i in order for op in program.block(i).ops]
    assert [op.input("Param") for op in joined.ops] == [
        op.input("Param") for i in order for op in program.block(i).ops
    ]
    assert joined.program is not program and joined.parent_idx == program.block(ids[0]).parent_idx
    assert program.serialize_to_string() == before


def test_a_joined_async_block_takes_every_gradient_off_its_queue_first():
    """Each async block dequeues its gradient, then updates: joined, the dequeues come
    first, so the updates sit side by side (one compiled call), each block's order kept."""
    program, _ = _pserver_program(fluidps.optimizer.Adam(0.01), mode="async")
    ids = _optimize_blocks(program)
    assert all([op.type for op in program.block(i).ops] == ["dequeue", "adam"] for i in ids)
    joined = joined_block(program, ids)
    assert [op.type for op in joined.ops] == ["dequeue"] * len(ids) + ["adam"] * len(ids)
    queues = [op.attr("queue_name") for op in joined.ops[: len(ids)]]
    assert queues == [op.input("Grad")[0] for op in joined.ops[len(ids) :]]


def test_blocks_that_declare_the_same_variable_are_not_joined():
    program, _ = _pserver_program(fluidps.optimizer.SGD(0.1))
    first, second = _optimize_blocks(program)[:2]
    program.block(second).create_var(name="scratch", shape=[1], dtype="float32")
    program.block(first).create_var(name="scratch", shape=[1], dtype="float32")
    assert joined_block(program, [first, second]) is None


@pytest.mark.parametrize(
    "optimizer",
    [lambda: fluidps.optimizer.SGD(0.1), lambda: fluidps.optimizer.Adam(0.01)],
    ids=["sgd", "adam"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["interpreted", "compiled"])
def test_blocks_run_joined_give_the_bits_of_each_block_run_alone(optimizer, compiled, tmp_path):
    program, startup = _pserver_program(optimizer())  # (an optimizer keeps its program's accumulators)
    ids = _optimize_blocks(program)
    compiler = Compiler(ModuleCache(tmp_path), compile_after=2) if compiled else None

    def runner_for(block):
        return BlockRunner(block, compute="optimize", compiler=compiler)

    alone = _env(program, startup, seed=1)
    together = {name: np.array(value) for name, value in alone.items()}
    singles = {i: runner_for(program.block(i)) for i in ids}
    joined = JoinedBlocks(program, {i: runner_for(program.block(i)) for i in ids}, runner_for)
    for _ in range(4):  # compiled from the second run
        for i in ids:
            singles[i].run(alone)
        joined.run(ids, together)
    for name, value in alone.items():
        np.testing.assert_array_equal(together[name], value, err_msg=name)
    assert joined.sets == [ids]
    if compiled:  # one compiled call for all the updates
        (runner,) = joined.runners
        assert runner.compiled_ops == len(runner.block.ops) and len(runner.segments) == 1


def test_a_failing_joined_block_names_the_blocks_it_joins():
    program, startup = _pserver_program(fluidps.optimizer.SGD(0.1))
    ids = _optimize_blocks(program)
    env = _env(program, startup, seed=2)
    grad = program.block(ids[1]).ops[0].input("Grad")[0]
    env[grad] = np.zeros((3, 3), dtype=np.float32)  # not its parameter's shape
    runners = {i: BlockRunner(program.block(i)) for i in ids}
    with pytest.raises(
        ExecutionError, match=rf"optimize blocks \[{ids[0]}, {ids[1]}\], run joined as one: .*sgd"
    ):
        JoinedBlocks(program, runners, BlockRunner).run(ids[:2], env)


def test_compiled_optimize_blocks_count_as_optimize_in_a_profile(tmp_path):
    program, startup = _pserver_program(fluidps.optimizer.Adam(0.01))
    ids = _optimize_blocks(program)
    runtime = SimpleNamespace(profile=Profile())  # what a profiled process's runtime gives
    compiler = Compiler(ModuleCache(tmp_path), compile_after=2)

    def runner_for(block):
        return BlockRunner(block, runtime, compute="optimize", compiler=compiler)

    joined = JoinedBlocks(program, {i: runner_for(program.block(i)) for i in ids}, runner_for)
    env = _env(program, startup, seed=3)
    for _ in range(3):
        joined.run(ids, env)
    assert joined.runners[0].compiled_ops == len(ids)
    calls = runtime.profile.report()["calls"]
    assert calls == {"optimize": len(ids) + 2}  # run 1 op by op, then one compiled call a run
