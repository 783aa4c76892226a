"""Hashed (auto-growing) embedding tables: layers.sparse_embedding over raw int64 ids.

Locally the table is a SparseTable in the scope; in a job it is sharded over the
pservers by id and a sync one-trainer job trains exactly like local training. Jobs
run in one process (pservers on threads, over inproc://), as in test_distributed_tables.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import numpy as np
import pytest
from job_harness import PserverThreads
from rpc_harness import SECRET

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import BuilderError, ExecutionError, RemoteError
from fluidps.executor.transport.settings import RpcSettings
from fluidps.initializer import Normal, Uniform
from fluidps.ops.sparse_table import SparseTable, owners
from fluidps.param_attr import ParamAttr

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
DIM, FIELDS = 4, 3
TABLE = "sparse_embedding_0.w_0"
OPTIMIZERS = {
    "sgd": lambda: optimizer.SGD(0.5),
    "adagrad": lambda: optimizer.Adagrad(0.1),
    "adam": lambda: optimizer.Adam(0.05),
    "ftrl": lambda: optimizer.Ftrl(0.1, l1=0.001, l2=0.01),
}


def ctr_model(make_optimizer, padding_idx=None, **table):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 7
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS, 1], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.sparse_embedding(ids, [-1, DIM], padding_idx=padding_idx, **table)
        logits = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 2)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        make_optimizer().minimize(loss)
    return main, startup, loss


def batches(steps, seed=0, batch=16, space=2**40):
    """Raw feature hashes: a heavy-tailed draw over a small vocabulary, scattered over
    [0, space) (so ids repeat within and across batches, and are nowhere contiguous)."""
    rng = np.random.default_rng(seed)
    vocabulary = rng.integers(0, space, 500)
    for _ in range(steps):
        ranks = np.minimum(rng.zipf(1.3, (batch, FIELDS)) - 1, len(vocabulary) - 1)
        ids = vocabulary[ranks].astype(np.int64)
        yield {"ids": ids[..., None], "label": (ranks[:, :1] % 2).astype(np.int64)}


def rows_by_id(table: SparseTable) -> dict[int, np.ndarray]:
    ids, values = table.items()
    return dict(zip(ids.tolist(), values, strict=True))


def assert_same_rows(got: dict[int, np.ndarray], want: dict[int, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for i, row in want.items():
        np.testing.assert_array_equal(got[i], row)


class Job:
    """A sync job of one trainer in this process."""

    def __init__(self, main, startup, pservers, config=None):
        tag = uuid.uuid4().hex[:8]
        self.endpoints = [f"inproc://hashed-{tag}-{i}" for i in range(pservers)]
        self.transpiler = fluidps.DistributeTranspiler(config or fluidps.DistributeTranspilerConfig())
        self.plan = self.transpiler.transpile(0, main, ",".join(self.endpoints), 1, startup_program=startup)
        self.servers = PserverThreads(self.transpiler, self.endpoints, SETTINGS)
        self.exe = self.servers.trainer_executor()
        self.exe.run(self.transpiler.get_trainer_startup_program())
        self.program = self.transpiler.get_trainer_program()

    def shards(self, name=TABLE) -> list[SparseTable]:
        return [self.servers.executors[s.endpoint].scope[s.name] for s in self.plan.slices_of(name)]

    def rows(self, name=TABLE) -> dict[int, np.ndarray]:
        """Every row of the table, from all its shards (a test's privilege)."""
        self.servers.wait_serving()  # each shard restored (a pserver only the table lives on, too)
        out = {}
        for shard in self.shards(name):
            out |= rows_by_id(shard)
        return out

    def train_beside(self, local, main, loss, feeds, compare=True, batched=False):
        """Train the job and `local` (on `main`) on the same feeds; with `compare`, every
        loss equal. `batched`: the job by exe.run_batches (each step told the next batch)."""
        feeds = list(feeds)
        if batched:
            remote = [value for (value,) in self.exe.run_batches(self.program, feeds, [loss])]
        else:
            remote = [self.exe.run(self.program, feed=feed, fetch_list=[loss])[0] for feed in feeds]
        for feed, value in zip(feeds, remote, strict=True):
            (expected,) = local.run(main, feed=feed, fetch_list=[loss])
            if compare:
                np.testing.assert_array_equal(value, expected)

    def local_twin(self, main, startup):
        """A local Executor starting from the job's dense values (the table starts empty)."""
        local = fluidps.Executor()
        local.run(startup)
        for p in main.all_parameters():
            if p.name != TABLE:
                local.scope[p.name] = np.array(self.exe.scope[p.name], copy=True)
        return local

    def close(self):
        problems = self.exe.close()
        self.servers.join()
        assert problems == []


# -- local --------------------------------------------------------------------------------


def test_rows_are_created_on_first_sight_and_start_from_values_that_depend_only_on_the_id():
    main, startup, loss = ctr_model(
        OPTIMIZERS["sgd"], param_attr=ParamAttr(initializer=Normal(0.0, 0.5, seed=3))
    )
    exe = fluidps.Executor()
    exe.run(startup)
    table = exe.scope[TABLE]
    assert isinstance(table, SparseTable) and len(table) == 0
    feed = next(batches(1))
    (before,) = exe.run(
        main.clone(for_test=True), feed=feed, fetch_list=[main.global_block().ops[0].output("Out")[0]]
    )
    assert len(table) == 0  # reading creates nothing
    exe.run(main, feed=feed, fetch_list=[loss])
    ids = np.unique(feed["ids"])
    assert len(table) == len(ids)  # one row per distinct id trained
    other = fluidps.Executor()
    other.run(startup)
    np.testing.assert_array_equal(
        other.scope[TABLE].lookup(ids[::-1].copy())[::-1], other.scope[TABLE].lookup(ids)
    )
    np.testing.assert_array_equal(before.reshape(-1, DIM), other.scope[TABLE].lookup(feed["ids"].reshape(-1)))


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "ftrl"])
def test_a_hashed_table_trains_like_a_dense_sparse_table_holding_the_same_initial_rows(rule):
    """The same ids remapped to rows of a fixed lookup_table initialized with the hashed
    table's initial rows: every loss and every trained row agree (Adam differs by design:
    a hashed row keeps its own beta powers)."""
    feeds = list(batches(8))
    vocabulary = np.unique(np.concatenate([f["ids"].reshape(-1) for f in feeds]))
    main, startup, loss = ctr_model(OPTIMIZERS[rule])
    exe = fluidps.Executor()
    exe.run(startup)
    initial = exe.scope[TABLE].lookup(vocabulary)

    dense_main, dense_startup = fluidps.Program(), fluidps.Program()
    dense_startup.random_seed = 7
    with fluidps.program_guard(dense_main, dense_startup):
        ids = layers.data("ids", [FIELDS, 1], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.embedding(ids, [len(vocabulary), DIM], is_sparse=True)
        logits = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 2)
        dense_loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        OPTIMIZERS[rule]().minimize(dense_loss)
    dense = fluidps.Executor()
    dense.run(dense_startup)
    dense.scope["embedding_0.w_0"] = initial.copy()
    for p in ("fc_0.w_0", "fc_0.b_0"):
        dense.scope[p] = np.array(exe.scope[p], copy=True)
    for feed in feeds:
        (hashed,) = exe.run(main, feed=feed, fetch_list=[loss])
        remapped = dict(feed, ids=np.searchsorted(vocabulary, feed["ids"]))
        (expected,) = dense.run(dense_main, feed=remapped, fetch_list=[dense_loss])
        np.testing.assert_allclose(hashed, expected, rtol=1e-6)
    np.testing.assert_allclose(
        exe.scope[TABLE].lookup(vocabulary), dense.scope["embedding_0.w_0"], rtol=1e-5, atol=1e-7
    )


def test_admission_by_count_drops_updates_until_an_id_was_seen_min_count_times():
    main, startup, loss = ctr_model(OPTIMIZERS["sgd"], min_count=3)
    exe = fluidps.Executor()
    exe.run(startup)
    table = exe.scope[TABLE]
    feed = {"ids": np.array([[[5], [6], [7]]] * 2, np.int64), "label": np.array([[1], [0]], np.int64)}
    initial = table.lookup(np.array([5, 6, 7]))
    for step in range(3):
        assert len(table) == 0 and table.stats()["pending_ids"] == (3 if step else 0)
        np.testing.assert_array_equal(table.lookup(np.array([5, 6, 7])), initial)  # updates dropped
        exe.run(main, feed=feed, fetch_list=[loss])
    assert len(table) == 3 and table.stats()["pending_ids"] == 0
    assert not np.array_equal(table.lookup(np.array([5, 6, 7])), initial)  # the third sighting trained


def test_admission_by_probability_admits_about_that_share_of_new_ids():
    table = SparseTable("t", fluidps.ops.sparse_table.TableSettings(dim=2, admit_probability=0.25, seed=1))
    table.use_rule(fluidps.ops.sparse_table.Rule("sgd"))
    ids = np.arange(20_000, dtype=np.int64) * 7919
    table.update(ids, np.ones((len(ids), 2), np.float32), 0.1)
    assert 0.23 < len(table) / len(ids) < 0.27
    assert table.stats()["dropped_updates"] == len(ids) - len(table)


def test_shrink_evicts_rows_past_their_ttl_and_rows_whose_decayed_score_is_low():
    Settings, Rule = fluidps.ops.sparse_table.TableSettings, fluidps.ops.sparse_table.Rule
    g = np.ones((1, 2), np.float32)
    hot, cold = np.array([1], np.int64), np.array([2], np.int64)

    by_ttl = SparseTable("t", Settings(dim=2, ttl_steps=2, shrink_every=1))
    by_ttl.use_rule(Rule("sgd"))
    for step, ids in enumerate([hot, cold, cold, cold]):
        by_ttl.update(ids, g, 0.1)
        assert sorted(rows_by_id(by_ttl)) == ([1] if step == 0 else [2] if step == 3 else [1, 2])
    assert by_ttl.stats()["evicted"] == 1  # hot, once 3 > ttl_steps steps had passed

    by_score = SparseTable("t", Settings(dim=2, score_decay=0.5, delete_threshold=1.0, shrink_every=1))
    by_score.use_rule(Rule("sgd"))
    by_score.update(np.array([1, 1, 1, 1, 2, 2, 2, 2], np.int64), np.ones((8, 2), np.float32), 0.1)
    assert sorted(rows_by_id(by_score)) == [1, 2]  # scores 4 * 0.5 = 2 each
    by_score.update(hot, g, 0.1)  # hot: (2 + 1) * 0.5; cold: 2 * 0.5 = 1.0, still kept
    assert sorted(rows_by_id(by_score)) == [1, 2]
    by_score.update(hot, g, 0.1)  # hot: 1.25; cold: 0.5 < 1.0, evicted
    assert sorted(rows_by_id(by_score)) == [1]
    assert by_score.shrink() == 1  # on demand: hot 1.25 * 0.5 < 1.0
    assert len(by_score) == 0 and by_score.stats()["evicted"] == 2


def test_ttl_eviction_keeps_a_table_bounded_over_a_drifting_id_stream_while_it_admits_new_ids():
    """Ids drift (each step's come from a window that moves on, as a click log's popular
    ids do), so rows keep being created and keep expiring. At step c + j after a shrink
    at c (j < shrink_every), the rows left were updated in steps c - ttl .. c + j, so at
    most ttl + shrink_every steps' ids are held: at most that many times the ids a step
    brings, and at most the ids whose window those steps' windows cover."""
    ttl, every, drift, width, batch, steps = 6, 3, 8, 64, 16, 240
    main, startup, loss = ctr_model(OPTIMIZERS["sgd"], min_count=2, ttl_steps=ttl, shrink_every=every)
    exe = fluidps.Executor()
    exe.run(startup)
    rng = np.random.default_rng(3)
    per_step = batch * FIELDS
    bound = min((ttl + every) * per_step, width + (ttl + every) * drift)
    created, history = 0, []
    for step in range(steps):
        ranks = step * drift + rng.integers(0, width, (batch, FIELDS))
        ids = (ranks * 0x9E3779B1 + 12345) % 2**40  # raw hashes: scattered, one per rank
        exe.run(main, feed={"ids": ids[..., None], "label": (ranks[:, :1] % 2)}, fetch_list=[loss])
        stats = exe.scope[TABLE].stats()
        assert stats["steps"] == step + 1
        assert stats["rows"] <= bound, (step, stats)
        assert stats["pending_ids"] <= bound, (step, stats)  # ids seen once expire too
        assert stats["rows"] == stats["created"] - stats["evicted"]
        history.append(stats)
        created = stats["created"]
    assert created > 10 * bound  # ids came and went: many more rows were made than are held
    late = history[steps // 2 :]
    for before, after in zip(late, late[every:], strict=False):  # it keeps admitting, and evicting
        assert after["created"] > before["created"] and after["evicted"] > before["evicted"]
    assert min(s["rows"] for s in late) > 0


def test_a_full_table_refuses_new_rows_or_evicts_its_lowest_scored_ones():
    Settings, Rule = fluidps.ops.sparse_table.TableSettings, fluidps.ops.sparse_table.Rule
    strict = SparseTable("t", Settings(dim=2, max_rows=3))
    strict.use_rule(Rule("sgd"))
    strict.update(np.array([1, 2, 3], np.int64), np.ones((3, 2), np.float32), 0.1)
    before = strict.to_arrays()
    with pytest.raises(
        ExecutionError, match=r"hashed table 't' holds 3 rows, its max_rows is 3.*evict_when_full"
    ):
        strict.update(np.array([4], np.int64), np.ones((1, 2), np.float32), 0.1)
    np.testing.assert_array_equal(strict.to_arrays()["values"], before["values"])  # nothing lost
    loose = SparseTable("t", Settings(dim=2, max_rows=3, evict_when_full=True))
    loose.use_rule(Rule("sgd"))
    loose.update(np.array([1, 1, 2, 2, 3], np.int64), np.ones((5, 2), np.float32), 0.1)  # 3 scores lowest
    loose.update(np.array([4], np.int64), np.ones((1, 2), np.float32), 0.1)
    assert sorted(rows_by_id(loose)) == [1, 2, 4]


def test_padding_ids_read_zeros_and_train_nothing():
    main, startup, _loss = ctr_model(OPTIMIZERS["sgd"], padding_idx=0)
    exe = fluidps.Executor()
    exe.run(startup)
    exe.run(main, feed={"ids": np.array([[[0], [9], [0]]], np.int64), "label": np.array([[1]], np.int64)})
    assert sorted(rows_by_id(exe.scope[TABLE])) == [9]


def test_bad_ids_and_bad_settings_say_what_to_do():
    main, startup, _loss = ctr_model(OPTIMIZERS["sgd"])
    exe = fluidps.Executor()
    exe.run(startup)
    with pytest.raises(ExecutionError, match=r"id -3 of hashed table 'sparse_embedding_0.w_0' is negative"):
        exe.run(
            main, feed={"ids": np.array([[[1], [-3], [2]]], np.int64), "label": np.array([[1]], np.int64)}
        )
    assert len(exe.scope[TABLE]) == 0  # nothing applied
    with pytest.raises(BuilderError, match="Momentum cannot train the hashed table"):
        ctr_model(lambda: optimizer.Momentum(0.1, 0.9))
    with pytest.raises(fluidps.Error, match="min_count must be >= 1"):
        ctr_model(OPTIMIZERS["sgd"], min_count=0)
    with pytest.raises(BuilderError, match="Uniform or Normal"):
        ctr_model(OPTIMIZERS["sgd"], param_attr=ParamAttr(initializer=fluidps.initializer.Constant(1.0)))


# -- distributed ----------------------------------------------------------------------------


@pytest.mark.parametrize("batched", [False, True], ids=["run", "run_batches"])
@pytest.mark.parametrize("pservers", [1, 2])
@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam"])
def test_sync_job_with_a_hashed_table_trains_exactly_like_local(rule, pservers, batched):
    """Also with each step told the next batch, whose rows (admitted, evicted or not yet
    created) are then read behind the step's barrier."""
    main, startup, loss = ctr_model(OPTIMIZERS[rule], min_count=2, ttl_steps=3, shrink_every=2)
    job = Job(main, startup, pservers)
    try:
        assert TABLE not in job.exe.scope
        local = job.local_twin(main, startup)
        job.train_beside(local, main, loss, batches(10), batched=batched)
        assert (job.exe.runtime.trainer.prefetches["served_ahead"] >= 9) == batched
        want = rows_by_id(local.scope[TABLE])
        assert_same_rows(job.rows(), want)
        assert len(want) > 10
        for k, shard in enumerate(job.shards()):  # each id on the pserver the rule says
            ids, _ = shard.items()
            assert (owners(ids, pservers) == k).all()
        assert local.scope[TABLE].stats()["evicted"] > 0
    finally:
        job.close()
    # A hashed table's rules (SGD's too) sum a gradient's repeated ids first: the trainer
    # sends each id once, summed, and the job still trains bit for bit like local, above.
    received = sum(
        count for stats in job.servers.final_stats.values() for count in stats["received_row_counts"].values()
    )
    assert received == sum(len(np.unique(feed["ids"])) for feed in batches(10))


def test_the_plan_and_programs_show_a_hashed_table_sharded_by_id():
    main, startup, _ = ctr_model(OPTIMIZERS["adam"])
    t = fluidps.DistributeTranspiler()
    plan = t.transpile(0, main, "127.0.0.1:6170,127.0.0.1:6171", 1, startup_program=startup)
    assert plan.distributed_tables() == [TABLE] and plan.to_dict()["hashed_tables"] == [TABLE]
    assert "hashed table sparse_embedding_0.w_0: rows created by id in 2 shard(s)" in plan.summary()
    assert "mix64(i) mod 2" in plan.summary()
    trainer = t.get_trainer_program().global_block()
    assert TABLE not in trainer.vars
    types = [op.type for op in trainer.ops]
    assert "distributed_lookup_table" in types and "shard_selected_rows" in types
    for k, ep in enumerate(plan.endpoints):
        _, startup_k = t.get_pserver_programs(ep)
        (create,) = [op for op in startup_k.global_block().ops if op.type == "hashed_table"]
        assert (create.attr("shard"), create.attr("shards"), create.attr("seed")) == (k, 2, 7)


def test_a_pserver_refuses_prefetches_of_ids_it_does_not_own_and_the_job_goes_on():
    main, startup, loss = ctr_model(OPTIMIZERS["sgd"])
    job = Job(main, startup, 2)
    try:
        ids = np.arange(50, dtype=np.int64)
        foreign = ids[owners(ids, 2) == 1]
        trainer = job.exe.runtime.trainer
        shard0 = job.plan.slices_of(TABLE)[0]
        bad = [
            (foreign, rf"id {foreign[0]} does not belong to shard 0 of 2 of hashed table '{shard0.name}'"),
            (np.array([4, -2], np.int64), "id -2 of hashed table .* is negative"),
        ]
        for rows, message in bad:
            with pytest.raises(RemoteError, match=rf"pserver {shard0.endpoint}.*{message}"):
                trainer.prefetch([(shard0.endpoint, shard0.name, rows)], trainer_id=0)
        mine = ids[owners(ids, 2) == 0]
        (got,) = trainer.prefetch([(shard0.endpoint, shard0.name, mine)], trainer_id=0)
        np.testing.assert_array_equal(got, job.shards()[0].lookup(mine))  # initial values, nothing created
        assert len(job.shards()[0]) == 0
        job.exe.run(job.program, feed=next(batches(1)), fetch_list=[loss])  # the job goes on
    finally:
        job.close()


def test_the_trainer_holds_nothing_of_the_table_whatever_the_ids():
    main, startup, loss = ctr_model(OPTIMIZERS["adagrad"])
    job = Job(main, startup, 2)
    try:
        for feed in batches(5, space=2**62):
            job.exe.run(job.program, feed=feed, fetch_list=[loss])
        trainer_values = [job.exe.scope[n] for n in job.exe.scope]
        assert not any(isinstance(v, SparseTable) for v in trainer_values)
        assert sum(len(s) for s in job.shards()) > 0
    finally:
        job.close()


def test_uniform_initializers_are_honoured():
    _main, startup, _ = ctr_model(
        OPTIMIZERS["sgd"], param_attr=ParamAttr(initializer=Uniform(0.5, 0.75, seed=2))
    )
    exe = fluidps.Executor()
    exe.run(startup)
    rows = exe.scope[TABLE].lookup(np.arange(1000, dtype=np.int64))
    assert rows.min() >= 0.5 and rows.max() < 0.75


# -- checkpoints ------------------------------------------------------------------------------


def test_checkpoints_keep_rows_state_and_counters_and_restore_onto_more_pservers(tmp_path):
    """2 pservers checkpoint a trained hashed table; 3 pservers restore it (each keeping the
    ids the rule gives it) and train on exactly like local training continued from there."""
    main, startup, loss = ctr_model(OPTIMIZERS["adam"], min_count=2, ttl_steps=50, shrink_every=3)
    config = fluidps.DistributeTranspilerConfig(checkpoint_dir=str(tmp_path / "ckpt"))
    feeds = list(batches(12))
    first = Job(main, startup, 2, config)
    local = first.local_twin(main, startup)
    try:
        first.train_beside(local, main, loss, feeds[:6], compare=False)
        dense = {p.name: np.array(first.exe.scope[p.name]) for p in main.all_parameters() if p.name != TABLE}
        saved = first.rows()
        pending = sum(s.stats()["pending_ids"] for s in first.shards())
    finally:
        first.close()  # each pserver writes its end checkpoint
    assert pending > 0  # ids seen once, waiting for admission, are kept too

    second = Job(main, startup, 3, config)
    try:
        second.exe.run(second.transpiler.get_trainer_startup_program())  # the restored values
        for name, value in dense.items():
            np.testing.assert_array_equal(second.exe.scope[name], value)
        assert_same_rows(second.rows(), saved)
        for k, shard in enumerate(second.shards()):
            assert (owners(shard.items()[0], 3) == k).all()
        assert sum(s.stats()["pending_ids"] for s in second.shards()) == pending
        second.train_beside(local, main, loss, feeds[6:])
        final = second.rows()
    finally:
        second.close()
    want = rows_by_id(local.scope[TABLE])
    assert_same_rows(final, want)

    out = tmp_path / "model"
    fluidps.io.merge_checkpoints(tmp_path / "ckpt", out)
    with np.load(out / f"{TABLE}.npz") as merged:
        ids, rows = merged["ids"], merged["rows"]
    assert ids.tolist() == sorted(want)
    np.testing.assert_array_equal(rows, [want[i] for i in ids.tolist()])


def test_the_lookup_gradient_matches_finite_differences():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS, 1], dtype="int64")
        emb = layers.sparse_embedding(
            ids, [-1, DIM], dtype="float64", param_attr=ParamAttr(initializer=Normal(0, 1))
        )
        loss = layers.mean(layers.square(layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 2)))
        test = main.clone(for_test=True)
        optimizer.SGD(0.0).minimize(loss)
    exe = fluidps.Executor()
    exe.run(startup)
    feed = {"ids": np.array([[[3], [2**50], [3]], [[7], [3], [2**50]]], np.int64)}
    (grad,) = exe.run(
        main, feed=feed, fetch_list=[f"{TABLE}@GRAD"], return_numpy=False
    )  # lr 0: rows created as they were
    grad = grad.merged()
    table = exe.scope[TABLE]
    assert sorted(grad.rows.tolist()) == [3, 7, 2**50] and len(table) == 3
    eps = 1e-6
    for k, i in enumerate(grad.rows.tolist()):
        row = table.rows.rows_of(np.array([i]))[0]
        for j in range(DIM):
            table.rows.values[row, j] += eps
            (up,) = exe.run(test, feed=feed, fetch_list=[loss])
            table.rows.values[row, j] -= 2 * eps
            (down,) = exe.run(test, feed=feed, fetch_list=[loss])
            table.rows.values[row, j] += eps
            np.testing.assert_allclose(grad.value[k, j], (up - down) / (2 * eps), rtol=1e-5, atol=1e-8)


# -- delta checkpoints ----------------------------------------------------------------------


def test_a_delta_holds_only_rows_updated_since_its_base_and_rebuilds_the_table_exactly():
    """Between a base and a delta rows are updated, created, evicted by TTL and score, and
    every score decays: base + delta is the table's whole content, bit for bit."""
    from fluidps.ops.sparse_table import Rule, TableSettings, apply_delta

    settings = TableSettings(dim=3, ttl_steps=9, score_decay=0.8, delete_threshold=0.05, shrink_every=2)
    table = SparseTable("t", settings)
    table.use_rule(Rule("adam"))
    rng = np.random.default_rng(0)

    def train(ids):
        table.update(ids, rng.normal(size=(len(ids), 3)).astype(np.float32), 0.01)

    cold = rng.integers(0, 2**50, 2000)
    train(cold)
    for _ in range(3):
        train(cold[200:])  # cold[:200] will expire, the others stay
    base, since = table.to_arrays(), table.clock
    created, evicted = table.created, table.evicted
    hot = np.concatenate([cold[-50:], rng.integers(0, 2**50, 30)])  # 30 new ids
    for _ in range(8):
        train(hot)
    assert table.created == created + 30 and table.evicted == evicted + 200

    delta, whole = table.to_arrays(since), table.to_arrays()
    assert sorted(delta["ids"]) == sorted(hot) and len(whole["ids"]) == 2000 - 200 + 30
    assert (
        delta["values"].nbytes + delta["state"].nbytes < (whole["values"].nbytes + whole["state"].nbytes) / 10
    )
    rebuilt = apply_delta(base, delta, "t")
    assert sorted(rebuilt) == sorted(whole)
    for key, array in whole.items():
        np.testing.assert_array_equal(rebuilt[key], array, err_msg=key)

    restored = SparseTable("t", settings)
    restored.restore([rebuilt])
    assert rows_by_id(restored).keys() == rows_by_id(table).keys()
    other = SparseTable("t", settings)
    other.use_rule(Rule("adam"))
    with pytest.raises(ExecutionError, match="delta was taken against another base"):
        apply_delta(other.to_arrays(), delta, "t")
    with pytest.raises(ExecutionError, match="apply_delta to a delta first"):
        restored.restore([delta])


def test_scheduled_deltas_restore_exactly_and_pruning_keeps_the_base_they_need(tmp_path):
    """Checkpoints every 2 steps, a base every 4: base, delta, delta, delta. Keeping 2,
    the base of the kept deltas stays. 3 pservers restore the newest delta of 2 and train
    on exactly like local training; a lost base is named, not silently skipped."""
    main, startup, loss = ctr_model(OPTIMIZERS["adagrad"], ttl_steps=4, shrink_every=3, score_decay=0.9)
    config = fluidps.DistributeTranspilerConfig(
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_every_steps=2,
        checkpoint_base_every=4,
        checkpoint_keep=2,
    )
    feeds = list(batches(12, batch=32))
    first = Job(main, startup, 2, config)
    local = first.local_twin(main, startup)
    try:
        first.train_beside(local, main, loss, feeds[:8], compare=False)
        saved = first.rows()
    finally:
        first.close()  # no end checkpoint: step 8's is the last
    kept = sorted(fluidps.io.checkpoints.scan(tmp_path / "ckpt"), key=lambda c: (c.pserver_id, c.count))
    assert [(c.pserver_id, c.count, c.kind, c.base, c.step) for c in kept] == [
        (p, count, kind, base, step)
        for p in (0, 1)
        for count, kind, base, step in [(1, "base", None, 2), (3, "delta", 1, 6), (4, "delta", 1, 8)]
    ]

    second = Job(main, startup, 3, config)
    try:
        second.exe.run(second.transpiler.get_trainer_startup_program())
        assert_same_rows(second.rows(), saved)
        second.train_beside(local, main, loss, feeds[8:])
    finally:
        second.close()
    # After a restore the schedule starts with a base.
    assert [
        (c.step, c.kind) for c in fluidps.io.checkpoints.scan(tmp_path / "ckpt") if c.pserver_id == 2
    ] == [
        (10, "base"),
        (12, "delta"),
    ]

    want = rows_by_id(local.scope[TABLE])
    fluidps.io.merge_checkpoints(tmp_path / "ckpt", tmp_path / "model")  # newest: deltas of 3 shards
    with np.load(tmp_path / "model" / f"{TABLE}.npz") as merged:
        assert merged["ids"].tolist() == sorted(want)
        np.testing.assert_array_equal(merged["rows"], [want[i] for i in sorted(want)])

    # Pserver 2's base lost: its delta is unusable, and its shard is nowhere else.
    (lost,) = [
        c for c in fluidps.io.checkpoints.scan(tmp_path / "ckpt") if c.pserver_id == 2 and c.kind == "base"
    ]
    lost.data_path.write_bytes(b"garbage")
    with pytest.raises(
        fluidps.CheckpointError, match=r"saved in 3 shards, but no intact checkpoint holds shard\(s\) \[2\]"
    ):
        fluidps.io.merge_checkpoints(tmp_path / "ckpt")
    listed = subprocess.run(
        [sys.executable, "-m", "fluidps", "checkpoint", "list", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert listed.returncode == 1
    assert [
        line.split("  ")[-1][:28] for line in listed.stdout.splitlines() if line.startswith("pserver 2")
    ] == [
        "BAD: checkpoint pserver-2-00",
        "BAD: its base #1 is missing ",
    ]
    (newest,) = [line for line in listed.stdout.splitlines() if line.startswith("pserver 0 #6")]
    assert "delta of #5" in newest and newest.endswith("ok")
