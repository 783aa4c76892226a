"""Pserver checkpoints and trainers coming and going, with whole jobs in one process.

Pservers run on threads with their own Executors (as listen_and_serv runs in a
pserver process); trainers are Executors in the test. Checks are numeric: a job
stopped, checkpointed and resumed on a different number of pservers continues
exactly as uninterrupted local training would; a paused trainer's absence is
exactly training on the other trainer's batches.
"""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np
import pytest
from job_harness import PserverThreads
from rpc_harness import SECRET

import fluidps
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.io.checkpoints import merge_checkpoints, scan
from helpers import build_mlp

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)


def adam_mlp():
    main, startup, loss = build_mlp(hidden=16, classes=3)
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.Adam(0.01).minimize(loss)
    return main, startup, loss


def batches(n: int, size: int = 8, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(size, 64)).astype("float32"),
            "y": rng.integers(0, 3, (size, 1)).astype("int64"),
        }
        for _ in range(n)
    ]


class Job(PserverThreads):
    """One trainer program's pservers on threads, over inproc endpoints, and its trainers."""

    def __init__(
        self, main, startup, pservers: int, trainers: int = 1, settings: RpcSettings = SETTINGS, **config
    ):
        tag = uuid.uuid4().hex[:8]
        endpoints = [f"inproc://ps{i}-{tag}" for i in range(pservers)]
        self.transpilers = []
        for trainer_id in range(trainers):
            t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(min_block_size=8, **config))
            t.transpile(trainer_id, main, ",".join(endpoints), trainers=trainers, startup_program=startup)
            self.transpilers.append(t)
        super().__init__(self.transpilers[0], endpoints, settings, wait=60.0)

    def trainer(
        self, trainer_id: int = 0, settings: RpcSettings = SETTINGS
    ) -> tuple[fluidps.Executor, fluidps.Program]:
        exe = self.trainer_executor(settings)
        exe.run(self.transpilers[trainer_id].get_trainer_startup_program())
        return exe, self.transpilers[trainer_id].get_trainer_program()

    def observe(self, kind: int, endpoint: str) -> Message:
        client = RpcClient(self.context, endpoint, f"pserver {endpoint}", SETTINGS)
        try:
            return client.call(Message(kind))
        finally:
            client.close()

    def wait_until_trainer(self, trainer: int, state: str, timeout: float = 30.0) -> None:
        """Until every pserver sees `trainer` in `state` (live, paused, done, lost)."""
        deadline = time.monotonic() + timeout
        for endpoint in self.endpoints:
            while json.loads(self.observe(Kind.STATS, endpoint).text)["trainers"][str(trainer)] != state:
                assert time.monotonic() < deadline, f"trainer {trainer} is not {state} on {endpoint}"
                time.sleep(0.01)


def persistables(main) -> list[str]:
    return sorted(
        n for n, v in main.global_block().vars.items() if v.persistable and n not in ("feed", "fetch")
    )


def local_from(startup, trainer: fluidps.Executor, params: list[str]) -> fluidps.Executor:
    """A local Executor whose parameters start as those `trainer` pulled."""
    local = fluidps.Executor()
    local.run(startup)
    for name in params:
        local.scope[name] = np.array(trainer.scope[name], copy=True)
    return local


def test_a_job_resumed_on_more_pservers_continues_exactly_as_local_training(tmp_path):
    main, startup, loss = adam_mlp()
    params = [p.name for p in main.all_parameters()]
    data = batches(10)
    ckpt = str(tmp_path / "ckpt")

    # Five steps on two pservers, which checkpoint every two steps and when they stop.
    first = Job(main, startup, pservers=2, checkpoint_dir=ckpt, checkpoint_every_steps=2)
    exe, trainer = first.trainer()
    local = local_from(startup, exe, params)  # local training from the values the trainer pulled
    local_losses = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in data]
    losses = [float(exe.run(trainer, feed=b, fetch_list=[loss])[0]) for b in data[:5]]
    assert exe.close() == []
    first.join()
    saved = scan(ckpt)
    assert {c.pserver_id for c in saved} == {0, 1}
    # Periodic checkpoints at steps 2 and 4, then one at the end (step 5); the last 3 are kept.
    assert [(c.count, c.step, c.reason) for c in saved if c.pserver_id == 0] == [
        (1, 2, "periodic"),
        (2, 4, "periodic"),
        (3, 5, "end"),
    ]
    model = merge_checkpoints(ckpt)
    assert set(model) >= set(params) and any("moment1" in n for n in model)

    # Five more steps on three pservers, restored from the two pservers' checkpoints.
    second = Job(main, startup, pservers=3, checkpoint_dir=ckpt)
    exe, trainer = second.trainer()
    for name in model:
        if name in exe.scope:
            np.testing.assert_array_equal(exe.scope[name], model[name], err_msg=name)
    losses += [float(exe.run(trainer, feed=b, fetch_list=[loss])[0]) for b in data[5:]]
    reply = second.observe(Kind.CHECKPOINT, second.endpoints[2])  # on demand
    assert json.loads(reply.text)["pserver_id"] == 2
    final = {n: np.array(exe.scope[n], copy=True) for n in [p.name for p in main.all_parameters()]}
    assert exe.close() == []
    second.join()
    np.testing.assert_allclose(losses, local_losses, rtol=1e-5, atol=1e-6)
    for name, value in final.items():
        np.testing.assert_allclose(value, local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name)
    # The optimizer state went through the resharding too: every persistable matches.
    resumed = merge_checkpoints(ckpt)
    for name in resumed:
        np.testing.assert_allclose(resumed[name], local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert all(any("restored" in line for line in stats["log"]) for stats in second.final_stats.values())


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path):
    main, startup, loss = adam_mlp()
    ckpt = tmp_path / "ckpt"
    job = Job(main, startup, pservers=1, checkpoint_dir=str(ckpt), checkpoint_every_steps=1)
    exe, trainer = job.trainer()
    for b in batches(3):
        exe.run(trainer, feed=b, fetch_list=[loss])
    exe.close()
    job.join()
    newest = max(scan(ckpt), key=lambda c: c.count)
    data = bytearray(newest.data_path.read_bytes())
    data[len(data) // 2] ^= 0x55
    newest.data_path.write_bytes(bytes(data))
    again = Job(main, startup, pservers=1, checkpoint_dir=str(ckpt))
    exe, _ = again.trainer()
    exe.close()
    again.join()
    (stats,) = again.final_stats.values()
    log = stats["log"]
    assert any("is corrupt" in line and newest.data_path.name in line for line in log), log
    assert any("restored" in line and "step 2" in line for line in log), log  # the previous one


def test_checkpoint_on_request_without_a_directory_is_a_clear_error():
    main, startup, _ = adam_mlp()
    job = Job(main, startup, pservers=1)
    exe, _ = job.trainer()
    try:
        with pytest.raises(
            fluidps.Error, match="has no checkpoint directory: set DistributeTranspilerConfig"
        ):
            job.observe(Kind.CHECKPOINT, job.endpoints[0])
    finally:
        exe.close()
        job.join()


def two_trainers():
    """A sync job of adam_mlp on two pservers with trainers 0 and 1, and a local Executor
    starting from the parameters trainer 0 pulled: (main, loss, params, job, trainers, local)."""
    main, startup, loss = adam_mlp()
    params = [p.name for p in main.all_parameters()]
    job = Job(main, startup, pservers=2, trainers=2)
    trainers = job.trainer(0), job.trainer(1)
    return main, loss, params, job, trainers, local_from(startup, trainers[0][0], params)


def test_a_paused_trainer_is_not_waited_for_and_resumes_by_sending():
    """Sync mode: while trainer 1 is paused, a step is trainer 0's batch alone; once it
    sends again, steps average both trainers' gradients again."""
    main, loss, params, job, ((exe0, prog0), (exe1, prog1)), local = two_trainers()
    mine, theirs = batches(6, size=4, seed=1), batches(3, size=4, seed=2)
    try:
        exe1.runtime.trainer.pause()
        job.wait_until_trainer(1, "paused")
        for b in mine[:3]:  # trainer 0 alone: exactly local training on its batches
            exe0.run(prog0, feed=b, fetch_list=[loss])
            local.run(main, feed=b)
        for name in params:
            np.testing.assert_allclose(
                exe0.scope[name], local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name
            )
        # Trainer 1 pulls the current parameters (it last did at its startup), then sends again.
        exe1.run(job.transpilers[1].get_trainer_startup_program())
        for i, (b0, b1) in enumerate(zip(mine[3:], theirs, strict=True)):  # both trainers at once
            other = threading.Thread(target=exe1.run, args=(prog1,), kwargs={"feed": b1})
            other.start()
            if i == 0:  # trainer 1 resumes when its gradients arrive: let them, before trainer 0's barrier
                job.wait_until_trainer(1, "live")
            exe0.run(prog0, feed=b0)
            other.join(timeout=60)
            assert not other.is_alive()
            local.run(main, feed={k: np.concatenate([b0[k], b1[k]]) for k in b0})  # the mean gradient
        for name in params:
            np.testing.assert_allclose(
                exe0.scope[name], local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name
            )
            np.testing.assert_array_equal(exe0.scope[name], exe1.scope[name])
        stats = job.server(job.endpoints[0]).stats()
        assert stats["completed_steps"] == 6 and stats["trainers"] == {"0": "live", "1": "live"}
    finally:
        exe0.close()
        exe1.close()
        job.join()


def test_a_trainer_skipping_a_sync_step_leaves_it_to_the_others():
    """Driven step by step (a RemoteExecutor), a trainer with no batch sends its barrier
    without gradients: the step is the other trainer's batch alone, and nobody waits."""
    main, _loss, params, job, ((exe0, prog0), (exe1, prog1)), local = two_trainers()
    mine, theirs = batches(4, size=4, seed=3), batches(4, size=4, seed=4)
    try:
        for step, (b0, b1) in enumerate(zip(mine, theirs, strict=True)):
            if (
                step % 2
            ):  # trainer 1 has no batch on odd steps: it skips, then pulls (as an executor server does)

                def skip() -> None:
                    exe1.runtime.trainer.skip_step()
                    exe1.run(job.transpilers[1].get_trainer_startup_program())

                other = threading.Thread(target=skip)
                local_feed = b0
            else:
                other = threading.Thread(target=exe1.run, args=(prog1,), kwargs={"feed": b1})
                local_feed = {k: np.concatenate([b0[k], b1[k]]) for k in b0}
            other.start()
            exe0.run(prog0, feed=b0)
            other.join(timeout=60)
            assert not other.is_alive()
            local.run(main, feed=local_feed)
        for name in params:
            np.testing.assert_allclose(
                exe0.scope[name], local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name
            )
    finally:
        exe0.close()
        exe1.close()
        job.join()
    assert {s["completed_steps"] for s in job.final_stats.values()} == {4}


def test_a_sync_trainer_waiting_for_a_task_keeps_in_step_with_empty_rounds():
    """Sync mode, a reader with no task: the trainer takes part in every round with a
    barrier and no gradients (it never pauses, so every pserver pairs the same barriers).
    The other trainer's step waits for that barrier; a round it trained in is its batch
    alone; a round nobody trained in is not a step, and says nothing moved. Trainer 1 has
    no task from the start: its program's kernels are built (as they are before a reader
    of its first step asks for a task), and that is enough to know it is a sync job."""
    main, _loss, params, job, ((exe0, prog0), (exe1, prog1)), local = two_trainers()
    mine = batches(4, size=4, seed=5)
    exe1.prepare(prog1, ["x", "y"], [])
    idle = exe1.runtime.readers.idle_trainer  # what a reader calls when the coordinator says "wait"
    try:
        for b in mine:
            step = threading.Thread(target=exe0.run, args=(prog0,), kwargs={"feed": b})
            step.start()
            wait_for(lambda: _deferred(job, job.endpoints[0]) + _deferred(job, job.endpoints[1]) == 2)
            assert step.is_alive()  # trainer 1 is live: its barrier is waited for, on both pservers
            assert idle() is True  # the round was trainer 0's step
            step.join(timeout=60)
            assert not step.is_alive()
            local.run(main, feed=b)
        empty = threading.Thread(target=exe0.runtime.readers.idle_trainer)  # both wait for tasks
        empty.start()
        assert idle() is False
        empty.join(timeout=60)
        assert not empty.is_alive()
        for name in params:
            np.testing.assert_allclose(
                exe0.scope[name], local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name
            )
        for endpoint in job.endpoints:
            stats = job.server(endpoint).stats()
            assert (stats["completed_steps"], stats["rounds"]) == (4, 5)
            assert stats["trainers"] == {"0": "live", "1": "live"}  # nobody paused
    finally:
        exe0.close()
        exe1.close()
        job.join()


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _deferred(job: Job, endpoint: str) -> int:
    return json.loads(job.observe(Kind.STATS, endpoint).text)["deferred_gets"]


@pytest.mark.parametrize("staleness", [0, 10**9])
def test_ssp_staleness_bounds_how_far_a_trainer_runs_ahead(staleness):
    """Staleness 0: a trainer one step ahead waits for the slowest (as in sync mode);
    an unbounded staleness never waits (as in async mode)."""
    main, startup, _loss = adam_mlp()
    job = Job(main, startup, pservers=1, trainers=2, mode="ssp", staleness=staleness)
    (exe0, prog0), (exe1, prog1) = job.trainer(0), job.trainer(1)
    data = batches(3, size=4)
    try:
        ahead = threading.Thread(target=lambda: [exe0.run(prog0, feed=b) for b in data])
        ahead.start()
        if staleness == 0:
            deadline = time.monotonic() + 30
            while _deferred(job, job.endpoints[0]) == 0:  # its first step's GET waits for trainer 1
                assert time.monotonic() < deadline and ahead.is_alive()
                time.sleep(0.01)
            for b in data:  # trainer 1 steps: trainer 0 may go on, one step at a time
                exe1.run(prog1, feed=b)
        ahead.join(timeout=60)
        assert not ahead.is_alive()
        assert _deferred(job, job.endpoints[0]) == 0
    finally:
        exe0.close()
        exe1.close()
        job.join()
    (stats,) = job.final_stats.values()
    grants = [e for e in stats["clock_log"] if e["event"] == "grant" and e["trainer"] == 0]
    assert max(e["step"] - e["slowest"] for e in grants) == (0 if staleness == 0 else 3)


def test_stats_over_the_wire_stay_compact_however_many_rows_arrive(monkeypatch):
    """STATS answers with counts always, and with the set of rows that arrived only while
    it is small: a long job's row log must not outgrow a message (or the pserver's memory)."""
    from fluidps.executor.ps import pserver_stats

    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 2
    with fluidps.program_guard(main, startup):
        ids = fluidps.layers.data("ids", [4], dtype="int64")
        y = fluidps.layers.data("y", [1], dtype="int64")
        emb = fluidps.layers.reshape(fluidps.layers.embedding_v2(ids, [1000, 4], is_sparse=True), [-1, 16])
        loss = fluidps.layers.mean(fluidps.layers.softmax_with_cross_entropy(fluidps.layers.fc(emb, 2), y))
        fluidps.optimizer.SGD(0.1).minimize(loss)
    monkeypatch.setattr(pserver_stats, "WIRE_UNIQUE_ROWS", 40)
    job = Job(main, startup, pservers=1)
    exe, trainer = job.trainer()
    rng = np.random.default_rng(0)
    sent: list[int] = []
    try:
        for _ in range(4):
            feed = {"ids": rng.integers(0, 1000, (6, 4)), "y": rng.integers(0, 2, (6, 1))}
            exe.run(trainer, feed=feed)
            sent += feed["ids"].ravel().tolist()
            stats = json.loads(job.observe(Kind.STATS, job.endpoints[0]).text)
            (grad,) = stats["received_row_counts"]
            assert stats["received_row_counts"][grad] == len(sent)  # every row, repeats counted
            if len(set(sent)) <= 40:
                assert stats["received_rows"][grad] == sorted(set(sent))
            else:
                assert "received_rows" not in stats
        assert len(set(sent)) > 40  # both answers were seen
    finally:
        exe.close()
        job.join()
    (final,) = job.final_stats.values()
    assert final["received_rows"][grad] == sent  # in the process: every row, in arrival order


def test_checkpoints_every_few_seconds(tmp_path):
    main, startup, loss = adam_mlp()
    job = Job(main, startup, pservers=1, checkpoint_dir=str(tmp_path), checkpoint_every_seconds=0.2)
    exe, trainer = job.trainer()
    try:
        for b in batches(3):
            exe.run(trainer, feed=b, fetch_list=[loss])
            time.sleep(0.5)  # longer than the interval: a checkpoint after each step
        deadline = time.monotonic() + 30
        while len(scan(tmp_path)) < 3:
            assert time.monotonic() < deadline, [(c.step, c.reason) for c in scan(tmp_path)]
            time.sleep(0.05)
    finally:
        exe.close()
        job.join()
    assert [(c.step, c.reason) for c in scan(tmp_path)] == [(1, "periodic"), (2, "periodic"), (3, "periodic")]


def test_a_pserver_told_to_stop_checkpoints_first(tmp_path):
    """What a `fluidps serve` told to shut down, or a pserver process sent SIGTERM, does."""
    main, startup, loss = adam_mlp()
    job = Job(main, startup, pservers=1, checkpoint_dir=str(tmp_path))
    exe, trainer = job.trainer(settings=SETTINGS.with_(peer_timeout=1.0))  # it closes after the pserver
    try:
        for b in batches(2):
            exe.run(trainer, feed=b, fetch_list=[loss])
        job.server(job.endpoints[0]).stop("shutdown")
        job.join()
    finally:
        problems = exe.close()
    assert [(c.step, c.reason) for c in scan(tmp_path)] == [(2, "shutdown")]
    # The pserver it would tell is gone. Depending on timing, close() finds it gone settling
    # earlier requests ("has not answered", then "stopped answering earlier") or telling it
    # this trainer is done ("did not answer"): either way, every problem names it.
    assert problems, "close() did not report the stopped pserver"
    gone = ("did not answer", "has not answered", "stopped answering")
    for problem in problems:
        assert job.endpoints[0] in problem and any(g in problem for g in gone), problems


def _vanish(job: Job, trainer: int) -> None:
    """A trainer's incarnation that sends one empty SEND and goes silent, as a process
    that was killed: every pserver evicts it."""
    for endpoint in job.endpoints:
        client = RpcClient(
            job.context, endpoint, endpoint, SETTINGS, trainer_id=trainer, sender=uuid.uuid4().int >> 65
        )
        try:
            client.call(Message(Kind.SEND, trainer_id=trainer, step=1))
        finally:
            client.close()
    job.wait_until_trainer(trainer, "lost")


def test_a_pserver_whose_trainers_were_all_evicted_waits_and_one_rejoins_where_it_left_off():
    """Eviction is not completion: a trainer that trained and then hung (its heartbeats
    stop) is evicted, and the pserver, left with no trainer, keeps serving and its state;
    a new incarnation trains on from there exactly as local training does on all the
    batches, and its COMPLETE ends the job."""
    main, startup, _ = adam_mlp()
    params = [p.name for p in main.all_parameters()]
    job = Job(main, startup, pservers=2, settings=SETTINGS.with_(elastic=True, peer_timeout=2.0))
    hung, program = job.trainer(0)
    local = local_from(startup, hung, params)
    data = batches(5)
    for b in data:
        local.run(main, feed=b)
    for b in data[:2]:
        hung.run(program, feed=b)
    hung.runtime.trainer._keepalive.close()  # hangs: it sends nothing from now on
    job.wait_until_trainer(0, "lost")
    for endpoint in job.endpoints:  # still serving, and says what it waits for
        stats = json.loads(job.observe(Kind.STATS, endpoint).text)
        assert stats["completed_steps"] == 2
        assert any("waiting up to 600 s for one to rejoin" in line for line in stats["log"])
        assert stats["peers"]["clocks"] == 0  # the evicted incarnation's clock went with it
    assert any("was evicted after going silent" in p for p in hung.close())
    exe, program = job.trainer(0)
    for b in data[2:]:
        exe.run(program, feed=b)
    for name in params:
        np.testing.assert_allclose(exe.scope[name], local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert exe.close() == []
    job.join()
    for endpoint in job.endpoints:
        log = job.final_stats[endpoint]["log"]
        assert any("rejoins" in line for line in log) and any("are back" in line for line in log)
        assert job.final_stats[endpoint]["completed_steps"] == 5


def test_a_pserver_left_without_trainers_gives_up_after_the_rejoin_timeout_with_a_checkpoint(tmp_path):
    main, startup, _ = adam_mlp()
    settings = SETTINGS.with_(elastic=True, peer_timeout=1.0, rejoin_timeout=0.5)
    job = Job(main, startup, pservers=1, settings=settings, checkpoint_dir=str(tmp_path))
    job.wait_serving()
    _vanish(job, 0)
    for thread in job.threads:
        thread.join(timeout=60.0)
    assert not any(t.is_alive() for t in job.threads)
    (error,) = job.errors
    assert isinstance(error, fluidps.ExecutionError)  # listen_and_serv failed, saying why
    assert "no evicted trainer (0) came back within 0.5 s (RpcSettings.rejoin_timeout)" in str(error)
    (endpoint,) = job.endpoints
    assert [c["reason"] for c in job.final_stats[endpoint]["checkpoints"]] == ["abandoned"]


def test_an_async_pserver_keeps_the_stream_batches_in_its_checkpoints_and_says_which_it_acknowledged(
    tmp_path,
):
    """The books a streaming job's exactly-once rests on (fluidps.executor.ps.applied_batches,
    fluidps.executor.tasks.checkpoint_watch): each checkpoint holds the batches its values
    hold, and each acknowledgement says the newest checkpoint and the books' incarnation."""
    from fluidps.executor.ps.applied_batches import CheckpointBooks, batch_tag, stream_id

    main, startup, loss = adam_mlp()
    job = Job(main, startup, pservers=1, mode="async", checkpoint_dir=str(tmp_path))
    exe, trainer = job.trainer()
    clicks = stream_id("log:clicks", "trainers")
    tags = iter([batch_tag(clicks, 0, first, 2, 0) for first in (0, 8)])
    current: list[str | None] = [None]
    exe.runtime.trainer._batch_tag = lambda: current[0]  # (a stream reader's, as the runtime wires it)
    try:
        for b in batches(2):
            current[0] = next(tags)
            exe.run(trainer, feed=b, fetch_list=[loss])
        current[0] = None
        assert exe.runtime.trainer.deliver_all().acked == {}  # (no checkpoint yet: nothing to say)
        saved = json.loads(job.observe(Kind.CHECKPOINT, job.endpoints[0]).text)
        current[0] = batch_tag(clicks, 16, 16, 1, 16)
        exe.run(trainer, feed=batches(1, seed=1)[0], fetch_list=[loss])
        delivered = exe.runtime.trainer.deliver_all()
    finally:
        exe.close()
        job.join()
    (newest,) = [c for c in scan(tmp_path) if c.count == saved["count"]]
    books = CheckpointBooks.read(newest.applied_batches)
    assert books.held(clicks) == {0}  # both batches of window 0, for every gradient
    assert delivered.acked == {0: [saved["count"], books.incarnation]} and not delivered.untagged
