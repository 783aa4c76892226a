"""A sync pserver holds a distributed table's update and applies the rows the next
PREFETCH asks for first (fluidps.executor.ps.rows_first): the same bits as applied whole,
on the pserver's own optimize blocks."""

import copy

import numpy as np
import pytest

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import ExecutionError
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.ps.rows_first import RowsFirst, split_block
from fluidps.ops import REGISTRY
from fluidps.ops.selected_rows import SelectedRows

ENDPOINT = "127.0.0.1:6170"
ROWS, WIDTH = 200, 4
TABLE = "embedding_0.w_0"
OPTIMIZERS = {
    "sgd": lambda: optimizer.SGD(0.5),
    "momentum": lambda: optimizer.Momentum(0.1, momentum=0.9),
    "adagrad": lambda: optimizer.Adagrad(0.1),
    "ftrl": lambda: optimizer.Ftrl(0.1, l1=0.01, l2=0.01),
    "lazy_adam": lambda: optimizer.Adam(0.05, lazy_mode=True),
}


class Pserver:
    """The pserver program of a CTR-like model with a distributed table, its startup
    values, and the optimize block of the table's gradient."""

    def __init__(self, make_optimizer, trainers):
        main, startup = fluidps.Program(), fluidps.Program()
        startup.random_seed = 3
        with fluidps.program_guard(main, startup):
            ids = layers.data("ids", [3], dtype="int64")
            label = layers.data("label", [1], dtype="int64")
            emb = layers.embedding_v2(ids, [ROWS, WIDTH], is_sparse=True, is_distributed=True)
            logits = layers.fc(layers.reshape(emb, [-1, 3 * WIDTH]), 2)
            make_optimizer().minimize(layers.mean(layers.softmax_with_cross_entropy(logits, label)))
        t = fluidps.DistributeTranspiler()
        t.transpile(0, main, ENDPOINT, trainers, startup_program=startup)
        self.program, startup = t.get_pserver_programs(ENDPOINT)
        serve = self.program.global_block().ops[0]
        (self.table,) = serve.attr("distributed_tables")
        blocks = dict(item.rsplit(":", 1) for item in serve.attr("grad_to_block_id"))
        self.grad = next(g for g in blocks if g.startswith(TABLE))
        self.block = self.program.block(int(blocks[self.grad]))
        self.dense_block = self.program.block(int(next(b for g, b in blocks.items() if g != self.grad)))
        self.copies = [f"{self.grad}.trainer_{t}" for t in range(trainers)] if trainers > 1 else [self.grad]
        self.start = {}
        BlockRunner(startup.global_block()).run(self.start)

    def split(self):
        return split_block(self.block, [self.table], self.copies)

    def env(self, grads):
        env = copy.deepcopy(self.start)
        env.update(zip(self.copies, grads, strict=True))
        return env

    def persistables(self, env):
        return {n: env[n] for n, v in self.program.global_block().vars.items() if v.persistable and n in env}


def gradients(copies, seed, unique=False):
    """A SelectedRows per trainer, with repeated rows; or, `unique`, with each row once,
    as a trainer's distributed lookup sends them (in no order either way)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(copies):
        rows = rng.integers(0, ROWS, 60)
        if unique:
            rows = rng.permutation(np.unique(rows))
        out.append(SelectedRows(rows, rng.standard_normal((len(rows), WIDTH)).astype(np.float32), ROWS))
    return out


@pytest.mark.parametrize("unique", [False, True], ids=["repeated_rows", "unique_rows"])
@pytest.mark.parametrize("trainers", [1, 2])
@pytest.mark.parametrize("rule", sorted(OPTIMIZERS))
def test_the_rows_asked_for_are_final_first_and_the_whole_update_is_bit_for_bit_the_same(
    rule, trainers, unique
):
    ps = Pserver(OPTIMIZERS[rule], trainers)
    grads = gradients(trainers, seed=1, unique=unique)
    whole = ps.env(grads)
    runner = BlockRunner(ps.block)
    for _ in range(3):  # a few steps: Adam's beta powers move once a step, not once a part
        runner.run(whole)
        whole.update(zip(ps.copies, grads, strict=True))

    held = ps.env(grads)
    runner = BlockRunner(ps.block)
    rows_first = RowsFirst(held, {ps.grad: ps.split()}, lambda grads: [runner.run(held) for _ in grads])
    touched = np.unique(np.concatenate([g.rows for g in grads]))
    asked = np.concatenate([touched[::3], np.setdiff1d(np.arange(ROWS), touched)[:5]])  # and rows not updated
    for step in range(3):
        before = held[ps.table].copy()
        assert rows_first.hold([ps.grad]) == [] and rows_first.pending == [ps.grad]
        rows_first.first({ps.table: asked})
        rest = np.setdiff1d(touched, asked)
        if step == 2:  # the asked rows hold their final values before the rest is applied
            np.testing.assert_array_equal(held[ps.table][asked], whole[ps.table][asked])
        np.testing.assert_array_equal(held[ps.table][rest], before[rest])  # not yet
        assert rows_first.pending == [ps.grad]
        rows_first.flush()
        assert rows_first.pending == []
        held.update(zip(ps.copies, grads, strict=True))
    expected, got = ps.persistables(whole), ps.persistables(held)
    assert sorted(expected) == sorted(got)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)
    counts = rows_first.counts
    assert counts["held"] == counts["cut"] == 3
    assert counts["rows_first"] + counts["rows_after"] == 3 * sum(len(g.rows) for g in grads)


def test_an_update_whose_rows_are_all_asked_for_is_applied_whole_and_one_none_are_is_held():
    ps = Pserver(OPTIMIZERS["lazy_adam"], 1)
    (grad,) = gradients(1, seed=2)
    expected = ps.env([grad])
    BlockRunner(ps.block).run(expected)
    untouched = np.setdiff1d(np.arange(ROWS), grad.rows)
    for asked, applied in ((np.unique(grad.rows), True), (untouched, False)):
        env = ps.env([grad])
        runner = BlockRunner(ps.block)
        rows_first = RowsFirst(env, {ps.grad: ps.split()}, lambda grads, e=env, r=runner: r.run(e))
        rows_first.hold([ps.grad])
        assert not rows_first.asked
        rows_first.first({ps.table: asked})
        assert rows_first.asked and rows_first.counts["cut"] == 0
        np.testing.assert_array_equal(env[ps.table][asked], expected[ps.table][asked])  # up to date
        assert rows_first.pending == ([] if applied else [ps.grad])
        rows_first.flush()
        np.testing.assert_array_equal(env[ps.table], expected[ps.table])
        assert rows_first.pending == [] and not rows_first.asked
    # A table not asked for is not touched.
    env = ps.env([grad])
    rows_first = RowsFirst(env, {ps.grad: ps.split()}, lambda grads: pytest.fail("applied"))
    rows_first.hold([ps.grad])
    rows_first.first({"another_table.block0": np.arange(5)})
    assert rows_first.pending == [ps.grad]


def test_a_second_prefetch_has_the_rest_applied_whole():
    """Two trainers' PREFETCHes: the first cuts the update, the second has what is left
    applied whole (not cut again), and the result is that of the whole update."""
    ps = Pserver(OPTIMIZERS["lazy_adam"], 2)
    grads = gradients(2, seed=4)
    expected = ps.env(grads)
    BlockRunner(ps.block).run(expected)
    env = ps.env(grads)
    runner = BlockRunner(ps.block)
    runs = []
    rows_first = RowsFirst(env, {ps.grad: ps.split()}, lambda g: runs.append(runner.run(env)))
    rows_first.hold([ps.grad])
    touched = np.unique(np.concatenate([g.rows for g in grads]))
    rows_first.first({ps.table: touched[::4]})
    assert rows_first.pending == [ps.grad] and len(runs) == 1
    rows_first.first({ps.table: touched[1::4]})
    assert rows_first.pending == [] and len(runs) == 2 and rows_first.counts["cut"] == 1
    for name, value in ps.persistables(expected).items():
        np.testing.assert_array_equal(env[name], value, err_msg=name)


def test_an_update_held_twice_is_refused():
    ps = Pserver(OPTIMIZERS["sgd"], 1)
    rows_first = RowsFirst(ps.env(gradients(1, 0)), {ps.grad: ps.split()}, lambda grads: None)
    rows_first.hold([ps.grad])
    with pytest.raises(ExecutionError, match="is held already"):
        rows_first.hold([ps.grad])


def test_only_row_local_updates_of_a_distributed_table_are_held():
    ps = Pserver(OPTIMIZERS["lazy_adam"], 2)
    split = ps.split()
    assert split.table == ps.table and split.inputs == tuple(ps.copies)
    assert split.scalars == tuple(ps.block.ops[-1].output(s)[0] for s in ("Beta1PowOut", "Beta2PowOut"))
    assert split_block(ps.dense_block, [ps.table], ["fc_0.w_0@GRAD"]) is None  # not a table
    # Adam that is not lazy decays every row of the table each step: it cannot be cut.
    assert Pserver(lambda: optimizer.Adam(0.05), 1).split() is None
    # Another input mixed into the gradient (a regularizer reading the table), or shared
    # state written by another op (Fluid 1.x's beta-power scale ops): not cut.
    power = split.scalars[0]
    for inputs, output in (([ps.copies[0], ps.table], [ps.grad]), ([power], [power])):
        program = ps.program.clone()
        block = program.block(ps.block.idx)
        REGISTRY.append_op(
            block, "sum" if len(inputs) > 1 else "scale", {"X": inputs}, {"Out": output}, index=0
        )
        assert split_block(block, [ps.table], ps.copies) is None
    rows_first = RowsFirst(ps.env(gradients(2, 0)), {ps.grad: split}, lambda grads: None)
    assert rows_first.hold([ps.grad, "fc_0.w_0@GRAD"]) == ["fc_0.w_0@GRAD"]
    assert rows_first.holds([ps.table]) and not rows_first.holds(["fc_0.w_0"])


def test_a_first_part_that_fails_is_not_applied_again_and_leaves_the_shared_state():
    ps = Pserver(OPTIMIZERS["lazy_adam"], 1)
    bad = SelectedRows(np.array([3, 7, 8, 9]), np.ones((4, WIDTH + 1), np.float32), ROWS)  # too wide
    env = ps.env([bad])
    runner = BlockRunner(ps.block)
    rows_first = RowsFirst(env, {ps.grad: ps.split()}, lambda grads: runner.run(env))
    powers = {name: env[name].copy() for name in ps.split().scalars}
    rows_first.hold([ps.grad])
    with pytest.raises(ExecutionError, match=rf"does not match Param of shape \[{ROWS}, {WIDTH}\]"):
        rows_first.first({ps.table: np.array([3, 8])})
    assert rows_first.pending == []
    for name, value in powers.items():
        np.testing.assert_array_equal(env[name], value)


def test_the_rows_one_cut_asked_for_are_not_taken_as_asked_by_the_next():
    """The asked rows are marked for their cut only: rows an earlier cut asked for are
    never taken for asked ones."""
    ps = Pserver(OPTIMIZERS["sgd"], 1)
    grads = [gradients(1, seed=s)[0] for s in range(4)]
    expected = ps.env(grads[:1])
    runner = BlockRunner(ps.block)
    env = ps.env(grads[:1])
    rows_first = RowsFirst(env, {ps.grad: ps.split()}, lambda g: runner.run(env))
    for step, grad in enumerate(grads):
        env[ps.grad] = expected[ps.grad] = grad
        BlockRunner(ps.block).run(expected)
        rows_first.hold([ps.grad])
        asked = np.unique(grad.rows)[step::3]
        before = rows_first.counts["rows_first"]
        rows_first.first({ps.table: asked})
        np.testing.assert_array_equal(env[ps.table][asked], expected[ps.table][asked])
        # Only this cut's rows count as asked: none of an earlier cut's.
        assert rows_first.counts["rows_first"] - before == np.isin(grad.rows, asked).sum()
        rows_first.flush()
        np.testing.assert_array_equal(env[ps.table], expected[ps.table])
    assert rows_first.counts["cut"] == 4


def test_rows_outside_the_table_are_refused_not_marked():
    """Rows are checked where they arrive (the SEND, the PREFETCH); should one reach the cut
    anyway, it is refused, naming the table, before anything is applied."""
    ps = Pserver(OPTIMIZERS["sgd"], 1)
    env = ps.env(gradients(1, seed=5))
    rows_first = RowsFirst(env, {ps.grad: ps.split()}, lambda grads: pytest.fail("applied"))
    rows_first.hold([ps.grad])
    with pytest.raises(ExecutionError, match=rf"{ps.table}.* outside its {ROWS} rows"):
        rows_first.first({ps.table: np.array([1, ROWS])})
    assert not rows_first._marks[ps.table].any()  # the rows it marked before the bad one, unmarked
