"""Distributed lookup tables: the table stays on the pservers, trainers prefetch the rows
of their batch, and a sync one-trainer job trains exactly like local training.

Jobs run in one process (pservers on threads, over inproc://), as in
test_runtime_inproc; the multi-process path is tests/distributed's.
"""

from __future__ import annotations

import subprocess
import sys
import uuid

import numpy as np
import pytest
from job_harness import PserverThreads
from rpc_harness import SECRET, free_port

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import RemoteError, TransportError, UnsupportedError
from fluidps.executor.runtime import Runtime, RuntimeConfig
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
ROWS, WIDTH, FIELDS = 1000, 4, 3
TABLE = "embedding_0.w_0"
OPTIMIZERS = {
    "sgd": lambda: optimizer.SGD(0.5),
    "adagrad": lambda: optimizer.Adagrad(0.1),
    "lazy_adam": lambda: optimizer.Adam(0.05, lazy_mode=True),
}


def ctr_model(make_optimizer, padding_idx=None, distributed=True, v2=True):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 7
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS] if v2 else [FIELDS, 1], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        embed = layers.embedding_v2 if v2 else layers.embedding
        emb = embed(ids, [ROWS, WIDTH], is_sparse=True, is_distributed=distributed, padding_idx=padding_idx)
        logits = layers.fc(layers.reshape(emb, [-1, FIELDS * WIDTH]), 2)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        make_optimizer().minimize(loss)
    return main, startup, loss


def batches(steps, seed=0, batch=16, v2=True):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        # Heavy-tailed ids (some repeat within a batch), spread over the whole table.
        ids = ((rng.zipf(1.5, (batch, FIELDS)) - 1) * 37 % ROWS).astype(np.int64)
        yield {
            "ids": ids if v2 else ids[..., None],
            "label": (ids[:, :1] % 2).astype(np.int64),  # learnable from the first field's rows
        }


def inproc_endpoints(n):
    tag = uuid.uuid4().hex[:8]
    return [f"inproc://table-{tag}-{i}" for i in range(n)]


class Job:
    """A sync job of one trainer in this process."""

    def __init__(self, main, startup, pservers, config=None):
        self.endpoints = inproc_endpoints(pservers)
        self.transpiler = fluidps.DistributeTranspiler(
            config or fluidps.DistributeTranspilerConfig(min_block_size=8)
        )
        self.plan = self.transpiler.transpile(0, main, ",".join(self.endpoints), 1, startup_program=startup)
        self.servers = PserverThreads(self.transpiler, self.endpoints, SETTINGS)
        self.exe = self.servers.trainer_executor()
        self.exe.run(self.transpiler.get_trainer_startup_program())
        self.program = self.transpiler.get_trainer_program()

    def table(self, name=TABLE):
        """The whole table, gathered from the pservers' blocks (a test's privilege). A round
        trip to each pserver first: a sync pserver applies the table update it holds after
        a step's answers before it handles another request."""
        self.servers.wait_serving()
        blocks = self.plan.slices_of(name)
        return np.concatenate([np.asarray(self.servers.executors[s.endpoint].scope[s.name]) for s in blocks])

    def local_twin(self, main, startup):
        """A local Executor starting from the job's values (the table from the pservers)."""
        local = fluidps.Executor()
        local.run(startup)
        for p in main.all_parameters():
            local.scope[p.name] = (
                self.table(p.name)
                if p.name in self.plan.distributed_tables()
                else np.array(self.exe.scope[p.name], copy=True)
            )
        return local

    def close(self):
        problems = self.exe.close()
        self.servers.join()
        assert problems == []


@pytest.mark.parametrize("pservers", [1, 2])
@pytest.mark.parametrize("rule", sorted(OPTIMIZERS))
def test_sync_job_with_a_distributed_table_trains_exactly_like_local(rule, pservers):
    main, startup, loss = ctr_model(OPTIMIZERS[rule])
    job = Job(main, startup, pservers)
    try:
        assert TABLE not in job.exe.scope  # the trainer never holds the table
        local = job.local_twin(main, startup)
        initial = job.table()
        for feed in batches(8):
            (remote,) = job.exe.run(job.program, feed=feed, fetch_list=[loss])
            (expected,) = local.run(main, feed=feed, fetch_list=[loss])
            np.testing.assert_array_equal(remote, expected)
        np.testing.assert_array_equal(job.table(), local.scope[TABLE])
        assert not np.array_equal(job.table(), initial)  # it trained
        assert TABLE not in job.exe.scope
        assert job.exe.runtime.trainer.prefetches["served_ahead"] == 0  # run() is not told the next batch
    finally:
        job.close()
    # Each step, every pserver with a block of the table held its update after the answers.
    held = [stats["rows_first"]["held"] for stats in job.servers.final_stats.values()]
    assert held == [8] * pservers
    # Adagrad and Adam sum a gradient's repeated rows before applying them, so the trainer
    # sends each row once, summed (and still trains bit for bit like local, above); SGD
    # applies each repeat in turn, so its repeats travel.
    received = sum(
        count for stats in job.servers.final_stats.values() for count in stats["received_row_counts"].values()
    )
    looked_up = [feed["ids"].reshape(-1) for feed in batches(8)]
    summed = rule != "sgd"
    assert received == sum(len(np.unique(ids)) if summed else len(ids) for ids in looked_up)
    ops = {op.type: op for op in job.program.global_block().ops}
    assert ops["distributed_lookup_table_grad"].attr("sum_repeated_rows") == summed
    # Summing, the grad op takes the ids its lookup found once (it does not find them again).
    for slot in ("UniqueIds", "UniqueIndex"):
        found = ops["distributed_lookup_table"].output(slot)
        assert ops["distributed_lookup_table_grad"].input(slot) == found and len(found) == summed


@pytest.mark.parametrize("pservers", [1, 2])
@pytest.mark.parametrize("rule", sorted(OPTIMIZERS))
def test_run_batches_asks_for_the_next_batchs_rows_with_the_step_and_trains_exactly_like_local(
    rule, pservers
):
    """exe.run_batches tells each step the next batch: its rows are asked for behind the
    step's barrier and the next step's prefetch sends nothing; training is unchanged."""
    main, startup, loss = ctr_model(OPTIMIZERS[rule])
    job = Job(main, startup, pservers)
    try:
        local = job.local_twin(main, startup)
        feeds = list(batches(8))
        expected = [local.run(main, feed=feed, fetch_list=[loss])[0] for feed in feeds]
        counts = job.exe.runtime.trainer.prefetches
        got, sent_by_step = [], []
        for (value,) in job.exe.run_batches(job.program, feeds, [loss]):
            got.append(value)
            sent_by_step.append(counts["sent"])
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(job.table(), local.scope[TABLE])
        # Only the first step's prefetch went as messages (one per pserver owning rows of it).
        assert 1 <= sent_by_step[0] <= pservers
        assert sent_by_step == [sent_by_step[0]] * len(feeds)
        assert counts["served_ahead"] >= len(feeds) - 1
    finally:
        job.close()
    # Each PREFETCH had the rows it asked for brought up to date first (rows_first.py).
    assert sum(stats["rows_first"]["cut"] for stats in job.servers.final_stats.values()) > 0


def test_a_batch_trained_again_reads_its_rows_after_the_whole_update():
    """One batch, again and again: each PREFETCH asks for every row the held update
    touches, so the pserver applies it whole before answering; training stays exact."""
    main, startup, loss = ctr_model(OPTIMIZERS["lazy_adam"])
    job = Job(main, startup, 1)
    try:
        local = job.local_twin(main, startup)
        feeds = [next(batches(1))] * 6
        expected = [local.run(main, feed=feed, fetch_list=[loss])[0] for feed in feeds]
        got = [value for (value,) in job.exe.run_batches(job.program, feeds, [loss])]
        np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(job.table(), local.scope[TABLE])
    finally:
        job.close()
    (stats,) = job.servers.final_stats.values()
    assert stats["rows_first"]["held"] == len(feeds) and stats["rows_first"]["cut"] == 0


def test_two_tables_on_one_pserver_take_their_rows_from_one_prefetch_asked_ahead():
    """Two lookups (two tables) ask one pserver: one PREFETCH behind the barrier holds
    both tables' rows, and each lookup takes its own from it."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        embs = [
            layers.embedding_v2(ids, [ROWS, WIDTH], is_sparse=True, is_distributed=True) for _ in range(2)
        ]
        logits = layers.fc(layers.reshape(layers.concat(embs, axis=2), [-1, 2 * FIELDS * WIDTH]), 2)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        optimizer.Adagrad(0.1).minimize(loss)
    job = Job(main, startup, 1)
    try:
        local = job.local_twin(main, startup)
        feeds = list(batches(6, seed=5))
        got = [value for (value,) in job.exe.run_batches(job.program, feeds, [loss])]
        np.testing.assert_array_equal(got, [local.run(main, feed=f, fetch_list=[loss])[0] for f in feeds])
        for table in job.plan.distributed_tables():
            np.testing.assert_array_equal(job.table(table), local.scope[table])
        assert job.exe.runtime.trainer.prefetches == {"served_ahead": 2 * (len(feeds) - 1), "sent": 2}
    finally:
        job.close()


def test_a_job_training_only_a_distributed_table_asks_for_rows_behind_its_barriers():
    """No parameters to GET: each step's barrier goes in a SEND of its own, answered at
    once; the PREFETCH behind it is answered once the step is applied, and taken by the
    next step's lookups."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS], dtype="int64")
        emb = layers.embedding_v2(ids, [ROWS, WIDTH], is_sparse=True, is_distributed=True)
        loss = layers.mean(layers.square(emb))
        optimizer.Adagrad(0.1).minimize(loss)
    job = Job(main, startup, 2)
    try:
        assert "recv" not in {op.type for op in job.program.global_block().ops}
        local = job.local_twin(main, startup)
        feeds = [{"ids": f["ids"]} for f in batches(6, seed=5)]
        got = [value for (value,) in job.exe.run_batches(job.program, feeds, [loss])]
        np.testing.assert_array_equal(got, [local.run(main, feed=f, fetch_list=[loss])[0] for f in feeds])
        job.exe.runtime.trainer.settle()  # the last step's SEND went without waiting (nothing to GET)
        np.testing.assert_array_equal(job.table(), local.scope[TABLE])
        assert job.exe.runtime.trainer.prefetches == {"served_ahead": 10, "sent": 2}
    finally:
        job.close()


def test_rows_asked_for_a_next_batch_that_does_not_come_are_not_used():
    """A step told one next batch and followed by another: the rows asked for ahead do
    not match the prefetch, which asks again; bad ids in a next feed fail only the step
    that runs them, naming the id."""
    main, startup, loss = ctr_model(OPTIMIZERS["adagrad"])
    job = Job(main, startup, 2)
    try:
        local = job.local_twin(main, startup)
        first, told, second = batches(3, seed=4)
        bad = {"ids": np.full((2, FIELDS), ROWS, np.int64), "label": np.zeros((2, 1), np.int64)}
        counts = job.exe.runtime.trainer.prefetches
        for feed, next_feed in [(first, told), (second, bad)]:
            (remote,) = job.exe.run(job.program, feed=feed, fetch_list=[loss], next_feed=next_feed)
            (expected,) = local.run(main, feed=feed, fetch_list=[loss])
            np.testing.assert_array_equal(remote, expected)
        assert counts["served_ahead"] == 0
        with pytest.raises(fluidps.Error, match=f"id {ROWS} in Ids 'ids' is out of range"):
            job.exe.run(job.program, feed=bad, fetch_list=[loss])
        np.testing.assert_array_equal(job.table(), local.scope[TABLE])
    finally:
        job.close()


def test_the_trainer_program_prefetches_and_never_receives_the_table():
    main, startup, _ = ctr_model(OPTIMIZERS["lazy_adam"])
    t = fluidps.DistributeTranspiler()
    eps = "127.0.0.1:6170,127.0.0.1:6171"
    plan = t.transpile(0, main, eps, 1, startup_program=startup)
    assert plan.distributed_tables() == [TABLE]
    blocks = plan.slices_of(TABLE)
    # one block per pserver whatever min_block_size says, block k on pserver k
    assert [(s.endpoint, s.offset, s.rows) for s in blocks] == [
        ("127.0.0.1:6170", 0, 500),
        ("127.0.0.1:6171", 500, 500),
    ]
    for program in (t.get_trainer_program(), t.get_trainer_startup_program()):
        block = program.global_block()
        assert TABLE not in block.vars
        assert all(TABLE not in op.input_arg_names + op.output_arg_names for op in block.ops)
        for op in block.ops:
            if op.type == "recv":
                assert not set(op.attr("recv_varnames")) & {s.name for s in blocks}
    ops = [op.type for op in t.get_trainer_program().global_block().ops]
    assert "lookup_table_v2" not in ops and "lookup_table_v2_grad" not in ops
    prefetch = next(
        op for op in t.get_trainer_program().global_block().ops if op.type == "distributed_lookup_table"
    )
    assert prefetch.attr("table_names") == [s.name for s in blocks]
    assert prefetch.attr("height_sections") == [500, 500]
    for s in blocks:
        (serve,) = [
            op for op in t.get_pserver_program(s.endpoint).global_block().ops if op.type == "listen_and_serv"
        ]
        assert serve.attr("distributed_tables") == [s.name]
    assert "distributed table embedding_0.w_0: 1,000 rows in 2 block(s)" in plan.summary()
    assert plan.to_dict()["distributed_tables"] == [TABLE]


def test_a_large_sparse_table_becomes_distributed_by_size_alone():
    main, startup, _ = ctr_model(OPTIMIZERS["sgd"], distributed=False)
    eps = "127.0.0.1:6170,127.0.0.1:6171"
    small = fluidps.DistributeTranspilerConfig(distributed_table_min_rows=ROWS + 1)
    large = fluidps.DistributeTranspilerConfig(distributed_table_min_rows=ROWS)
    assert (
        fluidps.DistributeTranspiler(small)
        .transpile(0, main, eps, 1, startup_program=startup)
        .distributed_tables()
        == []
    )
    assert fluidps.DistributeTranspiler(large).transpile(
        0, main, eps, 1, startup_program=startup
    ).distributed_tables() == [TABLE]
    assert (
        fluidps.DistributeTranspiler()
        .transpile(0, main, eps, 1, startup_program=startup)
        .distributed_tables()
        == []
    )


def test_a_dense_gradient_table_marked_distributed_is_refused_saying_why():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [2], dtype="int64")
        emb = layers.embedding_v2(ids, [50, 4], is_sparse=False, is_distributed=True)
        loss = layers.mean(emb)
        optimizer.SGD(0.1).minimize(loss)
    with pytest.raises(UnsupportedError, match=r"embedding_0.w_0.*is_distributed.*is_sparse=True"):
        fluidps.DistributeTranspiler().transpile(0, main, "127.0.0.1:6170", 1, startup_program=startup)


def test_a_table_read_by_another_op_cannot_be_distributed():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [2], dtype="int64")
        emb = layers.embedding_v2(ids, [50, 4], is_sparse=True, is_distributed=True)
        table = main.global_block().var(TABLE)
        loss = layers.elementwise_add(
            layers.mean(emb), layers.mean(table)
        )  # weight tying: the whole table is read
        optimizer.SGD(0.1).minimize(loss)
    with pytest.raises(UnsupportedError, match=r"is_distributed, but op 'mean' \(block 0, op 2\) uses it"):
        fluidps.DistributeTranspiler().transpile(0, main, "127.0.0.1:6170", 1, startup_program=startup)


def test_padding_ids_read_zeros_and_get_no_gradient_on_a_distributed_table():
    main, startup, loss = ctr_model(OPTIMIZERS["sgd"], padding_idx=0, v2=False)
    job = Job(main, startup, 2)
    try:
        local = job.local_twin(main, startup)
        before = job.table()
        for feed in batches(4, v2=False):
            feed["ids"][::2, 0, 0] = 0  # padding in every other row
            (remote,) = job.exe.run(job.program, feed=feed, fetch_list=[loss])
            (expected,) = local.run(main, feed=feed, fetch_list=[loss])
            np.testing.assert_array_equal(remote, expected)
        np.testing.assert_array_equal(job.table()[0], before[0])  # the padding row never trains
        np.testing.assert_array_equal(job.table(), local.scope[TABLE])
    finally:
        job.close()


@pytest.mark.parametrize(
    "ids, message",
    [
        (
            np.array([[1, 2, ROWS]]),
            rf"id {ROWS} in Ids 'ids' is out of range for the distributed table '{TABLE}' of {ROWS} rows",
        ),
        (np.array([[1, -3, 2]]), rf"id -3 in Ids 'ids' is out of range for the distributed table '{TABLE}'"),
        (
            np.array([[1.0, 2.0, 3.0]], dtype=np.float32),
            r"feed 'ids' has dtype float32; the program declares int64",
        ),
    ],
)
def test_bad_ids_are_refused_on_the_trainer_naming_the_table_and_the_id(ids, message):
    main, startup, loss = ctr_model(OPTIMIZERS["sgd"])
    job = Job(main, startup, 2)
    try:
        before = job.table()
        feed = {"ids": ids, "label": np.zeros((1, 1), np.int64)}
        with pytest.raises(fluidps.Error, match=message):
            job.exe.run(job.program, feed=feed, fetch_list=[loss])
        np.testing.assert_array_equal(job.table(), before)  # nothing was applied
    finally:
        job.close()


def test_a_pserver_refuses_bad_prefetches_naming_the_table_and_the_job_goes_on():
    main, startup, loss = ctr_model(OPTIMIZERS["sgd"])
    job = Job(main, startup, 2)
    trainer = job.exe.runtime.trainer
    block0 = job.plan.slices_of(TABLE)[0]
    try:
        bad = [
            (
                "nope",
                np.array([1], np.int64),
                r"holds no distributed table 'nope' \(its tables: embedding_0.w_0.block0\)",
            ),
            (
                block0.name,
                np.array([3, 500], np.int64),
                r"row 500 asked of table block 'embedding_0.w_0.block0' is outside its 500 rows",
            ),
            (block0.name, np.array([-1], np.int64), r"row -1 asked of table block"),
            (block0.name, np.array([1.0], np.float32), r"must carry 1-D int64 row indices"),
            ("fc_0.w_0", np.array([0], np.int64), r"holds no distributed table 'fc_0.w_0'"),
        ]
        for name, rows, message in bad:
            with pytest.raises(RemoteError, match=rf"pserver {block0.endpoint}.*{message}"):
                trainer.prefetch([(block0.endpoint, name, rows)], trainer_id=0)
        (got,) = trainer.prefetch([(block0.endpoint, block0.name, np.array([4, 2], np.int64))], trainer_id=0)
        np.testing.assert_array_equal(got, job.table()[[4, 2]])
        job.exe.run(job.program, feed=next(batches(1)), fetch_list=[loss])  # the job goes on
    finally:
        job.close()


def test_a_prefetch_reply_without_the_rows_fails_naming_the_pserver_and_the_table(net):
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    def forgetful(request):  # answers a prefetch with one row too few
        if request.msg.kind == Kind.PREFETCH:
            return Message(
                Kind.VALUES,
                tensors={
                    n: np.zeros((len(r) - 1, WIDTH), np.float32) for n, r in request.msg.tensors.items()
                },
            )
        return Message(Kind.OK)

    net.serve(endpoint, SETTINGS, handler=forgetful)
    runtime = Runtime(RuntimeConfig(rpc=SETTINGS))
    try:
        with pytest.raises(
            TransportError,
            match=rf"pserver {endpoint} answered a prefetch of 3 rows of 't.block0' with ndarray \[2, 4\]",
        ):
            runtime.trainer.prefetch([(endpoint, "t.block0", np.array([1, 2, 3], np.int64))], trainer_id=0)
    finally:
        runtime.close()


def test_rows_asked_for_ahead_whose_answer_fails_are_given_up_once(net):
    """The failed answer fails the step that takes it; closing the trainer then waits
    for nothing more (a second wait would last the request timeout and say so)."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"

    def refusing(request):  # the step's GET is answered; the rows asked for ahead are refused
        msg = request.msg
        if msg.kind == Kind.PREFETCH:
            return Message(Kind.ERROR, text="no rows for you")
        if msg.kind == Kind.SEND and msg.names:
            return Message(Kind.VALUES, tensors={n: np.zeros(2, np.float32) for n in msg.names})
        return Message(Kind.OK)

    settings = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=5.0, secret=SECRET)
    net.serve(endpoint, settings, handler=refusing)
    runtime = Runtime(RuntimeConfig(rpc=settings))
    trainer = runtime.trainer
    item = (endpoint, "t.block0", np.array([1, 2], np.int64))
    try:
        trainer.begin_step(next_feed=lambda: {"ids": item[2]})
        trainer.prefetch_next(lambda feed: [item])
        trainer.send_barrier([endpoint], trainer_id=0)
        trainer.get([(endpoint, "w")], trainer_id=0)  # the SEND with the barrier and GET; the rows behind it
        trainer.begin_step()
        with pytest.raises(RemoteError, match="no rows for you"):
            trainer.prefetch([item], trainer_id=0)  # served ahead: its answer is the refusal
        assert trainer.prefetches == {"served_ahead": 1, "sent": 0}
    finally:
        problems = runtime.close()
    assert not [p for p in problems if "did not answer" in p]


def test_transpile_and_inspect_show_the_distributed_table_and_its_prefetch(tmp_path):
    main, startup, _ = ctr_model(OPTIMIZERS["sgd"], distributed=False)
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())
    (tmp_path / "startup.pb").write_bytes(startup.serialize_to_string())
    out = tmp_path / "job"
    transpiled = cli("transpile", tmp_path / "main.pb", "--startup", tmp_path / "startup.pb",
                     "--pservers", "127.0.0.1:6170,127.0.0.1:6171", "--distributed-table-min-rows", ROWS, "-o", out)  # fmt: skip
    assert f"distributed table {TABLE}: 1,000 rows in 2 block(s)" in transpiled
    assert f"{TABLE}.block1" in transpiled and "distributed table [500, 4]" in transpiled
    trainer = cli("inspect", out / "trainer.pb")
    assert "distributed_lookup_table  [forward]" in trainer and "distributed_lookup_table_grad" in trainer
    assert f"table_names=['{TABLE}.block0', '{TABLE}.block1']" in trainer
    assert "lookup_table_v2  [" not in trainer and "lookup_table_v2_grad  [" not in trainer
    assert f"distributed_tables=['{TABLE}.block1']" in cli("inspect", out / "pserver_1.pb")


def cli(*args) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "fluidps", *map(str, args)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_async_and_ssp_jobs_prefetch_rows_and_update_only_the_rows_looked_up(mode):
    main, startup, loss = ctr_model(OPTIMIZERS["lazy_adam"])
    config = fluidps.DistributeTranspilerConfig(min_block_size=8, mode=mode)
    job = Job(main, startup, 2, config)
    try:
        before = job.table()
        feeds = list(batches(30, seed=3))
        losses = [float(value) for (value,) in job.exe.run_batches(job.program, feeds, [loss])]
        for endpoint in job.endpoints:
            job.servers.drain(endpoint)
        after = job.table()
        # No barrier for the next batch's rows to ride behind: each step asks for its own.
        assert job.exe.runtime.trainer.prefetches["served_ahead"] == 0
    finally:
        job.close()
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    seen = np.unique(np.concatenate([f["ids"].ravel() for f in feeds]))
    changed = np.flatnonzero((after != before).any(axis=1))
    assert set(changed) <= set(seen) and len(changed) > len(seen) // 2
