"""RemoteExecutor: the same API as Executor, the training running as a real job of
`fluidps serve` processes on 127.0.0.1; checked against local training."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from remote_models import SLICED, mlp, mlp_batches, persistables, sparse_batches, sparse_model

import fluidps
from fluidps import layers, optimizer


def _assert_gone(pids: dict[str, int]) -> None:
    for name, pid in pids.items():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"{name} (pid {pid}) outlived its RemoteExecutor")


def _wait_for_pservers_to_compile(exe: fluidps.RemoteExecutor, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout  # a bound for a hang, not a claim on speed
    while any(s["compiling_blocks"] for s in exe.pserver_stats().values()):
        assert time.monotonic() < deadline, "the pservers' optimize blocks never finished compiling"
        time.sleep(0.1)


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreted", "compiled"])
def test_sync_job_of_two_trainers_and_two_pservers_matches_local_training(compiled, tmp_path):
    """Compiled: the trainers run their programs' compute as compiled segments and the
    pservers their optimize blocks, and train as local (interpreted) training does."""
    main, startup, loss, test_program, logits = mlp()
    batches = mlp_batches(14)  # (a block compiles at its 10th run: COMPILE_AFTER)
    local = fluidps.Executor(compile=False)
    local.run(startup)
    expected = [local.run(main, feed=b, fetch_list=[loss, logits]) for b in batches]

    job = fluidps.JobDesc(pservers=2, trainers=2, config=SLICED, compile=compiled)
    env = {"FLUIDPS_CACHE_DIR": str(tmp_path / "compiled")}  # the servers inherit it: a cold cache
    with mock.patch.dict(os.environ, env), fluidps.RemoteExecutor(job) as exe:
        pids = exe.server_pids
        assert sorted(pids) == ["pserver.0", "pserver.1", "trainer.0", "trainer.1"]
        exe.run(startup)
        got = [exe.run(main, feed=b, fetch_list=[loss, logits]) for b in batches[:12]]
        # A pserver compiles beside its loop, which answers meanwhile (a compile longer than
        # the trainers' peer timeout failed the job when it did not); its code runs once ready.
        _wait_for_pservers_to_compile(exe)
        got += [exe.run(main, feed=b, fetch_list=[loss, logits]) for b in batches[12:]]
        # Every parameter was cut across both pservers, and the job holds local training's values.
        assert {s.endpoint for s in exe.plan.slices} == set(exe.plan.endpoints)
        for name in persistables(main):
            np.testing.assert_allclose(exe.scope[name], local.scope[name], rtol=2e-5, atol=1e-6, err_msg=name)
        # A program without optimizer ops runs in the client on the job's parameters.
        feed = batches[0]
        (remote_eval,) = exe.run(test_program, feed=feed, fetch_list=[logits])
        (local_eval,) = local.run(test_program, feed=feed, fetch_list=[logits])
        np.testing.assert_allclose(remote_eval, local_eval, rtol=1e-5, atol=1e-6)
        stats = exe.pserver_stats()
        assert [s["completed_steps"] for s in stats.values()] == [len(batches)] * 2
        # Compiled from the 10th step on: a trainer's forward, backward and (the job's
        # loss being averaged) scale ops; each pserver's Adam updates and beta powers.
        trainers_compiled = [t["compiled_ops"] for t in exe.trainer_stats()]
        pservers_compiled = [s["compiled_ops"] for s in stats.values()]
        # A trainer's last message brings the gradients of several slices: their optimize
        # blocks ran joined, as one block.
        assert all(any(len(blocks) > 1 for blocks in s["joined_blocks"]) for s in stats.values())
        if compiled:
            assert min(trainers_compiled) > 10 and min(pservers_compiled) > 0
        else:
            assert trainers_compiled == [0, 0] and pservers_compiled == [0, 0]
    for (loss_got, logits_got), (loss_want, logits_want) in zip(got, expected, strict=True):
        # The loss is averaged over trainers; per-example logits come back concatenated.
        np.testing.assert_allclose(loss_got, loss_want, rtol=1e-5)
        assert logits_got.shape == logits_want.shape == (16, 10)
        np.testing.assert_allclose(logits_got, logits_want, rtol=1e-4, atol=1e-5)
    _assert_gone(pids)


def test_sparse_job_resumes_from_loaded_values_and_saves_whole_variables(tmp_path):
    main, startup, loss = sparse_model()
    batches = sparse_batches(6)
    local = fluidps.Executor()
    local.run(startup)
    for b in batches[:3]:
        local.run(main, feed=b, fetch_list=[loss])
    fluidps.io.save_persistables(local, tmp_path / "step3", main)
    expected = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[3:]]

    job = fluidps.JobDesc(pservers=2, trainers=1, config=SLICED)
    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        # Loaded before the first step: the pservers start from these values, not the startup's.
        fluidps.io.load_persistables(exe, tmp_path / "step3", main)
        got = [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[3:]]
        fluidps.io.save_persistables(exe, tmp_path / "remote", main)
        # Loading again mid-job pushes the values to the pservers; the trainer pulls its copies
        # before its next step.
        fluidps.io.load_persistables(exe, tmp_path / "step3", main)
        again = [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[3:]]
        received = {ep: s["received_rows"] for ep, s in exe.pserver_stats().items()}
        slices = exe.plan.slices_of("embedding_0.w_0")
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(again, expected, rtol=1e-5)
    check = fluidps.Executor()
    check.run(startup)
    fluidps.io.load_persistables(check, tmp_path / "remote", main)
    for name in persistables(main):
        np.testing.assert_allclose(check.scope[name], local.scope[name], rtol=2e-5, atol=1e-7, err_msg=name)
    # Each pserver received only rows of its own range that the batches touched.
    touched = {int(i) for b in batches[3:] for i in b["ids"].ravel()}
    for s in slices:
        rows = received[s.endpoint][s.grad]
        assert rows, f"{s.grad} received nothing"
        assert all(0 <= r < s.rows for r in rows)  # local row ids within the slice
        assert {r + s.offset for r in rows} <= touched


def test_mistakes_are_reported_and_the_job_goes_on():
    main, startup, loss, _, _ = mlp()
    other, _, other_loss, _, _ = mlp()
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=2)) as exe:
        with pytest.raises(fluidps.ExecutionError, match="startup program"):
            exe.run(main, feed=mlp_batches(1)[0], fetch_list=[loss])
        exe.run(startup)
        with pytest.raises(fluidps.UnsupportedError, match=r"exe\.scope"):
            exe.run(main, feed=mlp_batches(1)[0], scope=fluidps.Scope())
        with pytest.raises(fluidps.ExecutionError, match="at least one per trainer"):
            exe.run(main, feed=mlp_batches(1, rows=1)[0], fetch_list=[loss])
        with pytest.raises(fluidps.FeedError, match="dtype"):
            bad = dict(mlp_batches(1)[0], x=np.zeros((4, 64)))
            exe.run(main, feed=bad, fetch_list=[loss])
        (first,) = exe.run(main, feed=mlp_batches(1)[0], fetch_list=[loss])
        with pytest.raises(fluidps.UnsupportedError, match="another program"):
            exe.run(other, feed=mlp_batches(1)[0], fetch_list=[other_loss])
        with pytest.raises(fluidps.ExecutionError, match="not a persistable variable"):
            exe.scope["no_such_variable"] = np.zeros(3)
        (second,) = exe.run(main, feed=mlp_batches(1)[0], fetch_list=[loss])
        assert float(second) < float(first)  # the same batch again, after one Adam step
    with pytest.raises(fluidps.BuilderError, match="trainer_servers"):
        fluidps.JobDesc(trainers=2, trainer_servers=["tcp://127.0.0.1:1"])
    with pytest.raises(fluidps.BuilderError, match="mode"):
        fluidps.JobDesc(mode="bulk")
    with pytest.raises(fluidps.BuilderError, match="prefetch_batches must be >= 1"):
        fluidps.JobDesc(prefetch_batches=0)
    with pytest.raises(fluidps.BuilderError, match="batches_per_run must be >= 1"):
        fluidps.JobDesc(batches_per_run=0)


def test_a_killed_trainer_fails_the_step_within_seconds_and_close_cleans_up():
    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(3)
    exe = fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=2, peer_timeout=2.0))
    pids = exe.server_pids
    try:
        exe.run(startup)
        exe.run(main, feed=batches[0], fetch_list=[loss])
        os.kill(pids["trainer.1"], signal.SIGKILL)
        # the process's death or the 2 s peer timeout ended it, not the 600 s request timeout
        # ("did not answer ... within"); the module's pytest timeout is the hang guard
        with pytest.raises(fluidps.ExecutionError, match=r"trainer 1.*(exited|not answered for)") as failure:
            exe.run(main, feed=batches[1], fetch_list=[loss])
        assert "status -9" in str(failure.value)  # the dead process and how it died
        with pytest.raises(fluidps.ExecutionError, match="failed earlier"):
            exe.run(main, feed=batches[2], fetch_list=[loss])
    finally:
        problems = exe.close()
    assert problems  # the job did not end cleanly, and says so
    _assert_gone(pids)


# -- jobs that read a dataset through a coordinator -----------------------------------------


def _records(n: int = 300, seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, 64)).astype("float32"), "y": rng.integers(0, 10, (n, 1)).astype("int64")}


def _reading_mlp(dataset, passes: int):
    main, startup, loss, _, _ = mlp()
    block = main.global_block()
    with fluidps.program_guard(main, startup):
        layers.dataset_reader(dataset, [block.var("x"), block.var("y")], batch_size=16, passes=passes)
    return main, startup, loss


def _train_until_eof(exe, main, loss) -> list[float]:
    losses = []
    while True:
        try:
            (value,) = exe.run(main, fetch_list=[loss])
        except fluidps.EOFException:
            return losses
        losses.append(float(value))


def test_a_job_reading_a_dataset_trains_as_local_training_on_the_same_tasks(tmp_path):
    """One trainer: the coordinator hands out the tasks in the order the local reader
    reads them, so a sync job's losses and parameters are local training's."""
    fluidps.io.Dataset.write(tmp_path / "data", _records(), records_per_shard=100)
    main, startup, loss = _reading_mlp(tmp_path / "data", passes=2)
    local = fluidps.Executor()
    local.run(startup)
    local_losses = _train_until_eof(local, main, loss)
    assert len(local_losses) == 2 * 3 * 7  # 2 passes x 3 shards x ceil(100 / 16) batches
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=1, config=SLICED)) as exe:
        exe.run(startup)
        losses = _train_until_eof(exe, main, loss)
        with pytest.raises(fluidps.EOFException):
            exe.run(main, fetch_list=[loss])  # done stays done
        for p in main.all_parameters():
            np.testing.assert_allclose(exe.scope[p.name], local.scope[p.name], rtol=1e-4, atol=1e-5)
        books = json.loads((exe.log_dir / "coordinator.json").read_text())["queue"]
    np.testing.assert_allclose(losses, local_losses, rtol=1e-4, atol=1e-5)
    assert [sorted(h["done"]) for h in books["history"]] == [list(range(len(books["tasks"])))] * 2


@pytest.mark.parametrize("mode", ["sync", "async", "async+communicator", "ssp"])
def test_two_trainers_share_a_dataset_s_tasks_and_every_pass_is_counted_once(tmp_path, mode):
    fluidps.io.Dataset.write(tmp_path / "data", _records(n=500), records_per_shard=70)
    main, startup, loss = _reading_mlp(tmp_path / "data", passes=3)
    # The communicator's trainers pause between tasks and skip steps with their gradients queued.
    mode, _, communicator = mode.partition("+")
    config = dataclasses.replace(SLICED, mode=mode, communicator=bool(communicator))
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=2, mode=mode, config=config)) as exe:
        exe.run(startup)
        losses = _train_until_eof(exe, main, loss)
        books = json.loads((exe.log_dir / "coordinator.json").read_text())["queue"]
        stats = exe.pserver_stats()
    tasks = list(range(len(books["tasks"])))
    assert len(books["history"]) == 3 and all(sorted(h["done"]) == tasks for h in books["history"])
    assert all(h["samples"] == 500 for h in books["history"])  # every record, once a pass
    # The trainers shared the work: a step holds one or two trainers' batches of 16.
    assert 500 * 3 / 32 <= len(losses) <= 500 * 3 / 16 + 3 * len(tasks)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    if mode == "sync":
        assert all(s["completed_steps"] >= len(losses) for s in stats.values())


def test_servers_outlive_no_client_that_was_killed(tmp_path):
    """A client killed outright (no chance to close its job) takes its servers with it."""
    script = tmp_path / "client.py"
    script.write_text(
        "import sys, time, fluidps\n"
        "exe = fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=1))\n"
        "print(' '.join(f'{n}={p}' for n, p in exe.server_pids.items()), flush=True)\n"
        "time.sleep(120)\n"
    )
    client = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        line = client.stdout.readline()
        pids = {name: int(pid) for name, pid in (item.split("=") for item in line.split())}
        assert sorted(pids) == ["pserver.0", "trainer.0"]
    finally:
        client.kill()
        client.wait(timeout=10)
        client.stdout.close()
    _assert_gone(pids)


def test_checkpoints_on_demand_resume_a_job_with_another_number_of_pservers(tmp_path):
    """exe.checkpoint() saves every pserver's slices; a new job on three pservers restores
    them (cut differently) and carries on exactly where the first one stopped."""
    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(6)
    config = fluidps.DistributeTranspilerConfig(min_block_size=64, checkpoint_dir=str(tmp_path / "ckpt"))
    local = fluidps.Executor()
    local.run(startup)
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=1, config=config)) as exe:
        exe.run(startup)
        for p in main.all_parameters():  # the job starts from the client's startup values
            local.scope[p.name] = np.array(exe.scope[p.name], copy=True)
        for b in batches[:3]:
            exe.run(main, feed=b, fetch_list=[loss])
        saved = exe.checkpoint()
        assert sorted(Path(path).name for path in saved.values()) == [
            "pserver-0-000001.json",
            "pserver-1-000001.json",
        ]
    local_losses = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=3, trainers=1, config=config)) as exe:
        exe.run(startup)  # overwritten by what the pservers restore
        losses = [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[3:]]
        for p in main.all_parameters():
            np.testing.assert_allclose(exe.scope[p.name], local.scope[p.name], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses, local_losses[3:], rtol=1e-4, atol=1e-5)


def test_a_distributed_table_job_matches_local_training_and_resumes_on_other_pservers(tmp_path):
    """Two trainers prefetch the rows of their halves of each batch from two pservers, in
    sync mode: local training on the whole batches. A checkpoint of the job restores on
    three pservers, the table cut differently, and training carries on as locally."""
    main, startup, loss = sparse_model(distributed=True)
    batches = sparse_batches(6)
    table = "embedding_0.w_0"
    config = fluidps.DistributeTranspilerConfig(min_block_size=64, checkpoint_dir=str(tmp_path / "ckpt"))
    local = fluidps.Executor()
    local.run(startup)
    expected = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=2, config=config)) as exe:
        exe.run(startup)  # the same values as local's: the client's startup goes to the pservers
        got = [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[:3]]
        assert exe.plan.distributed_tables() == [table]
        assert [(s.endpoint, s.rows) for s in exe.plan.slices_of(table)] == [
            (ep, 250) for ep in exe.plan.endpoints
        ]
        exe.checkpoint()
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=3, trainers=2, config=config)) as exe:
        exe.run(startup)  # overwritten by what the pservers restore
        got += [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[3:]]
        assert len(exe.plan.slices_of(table)) == 3
        final = np.array(exe.scope[table], copy=True)
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(final, local.scope[table], rtol=2e-5, atol=1e-6)


def test_on_demand_base_and_delta_checkpoints_of_a_hashed_table_resume_the_job(tmp_path):
    """exe.checkpoint("base"), more steps, exe.checkpoint("delta"): the delta holds only the
    rows those steps touched, and a new job on two pservers resumes from base + delta
    exactly where local training is."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [3, 1], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.reshape(layers.sparse_embedding(ids, [-1, 4]), [-1, 12])
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(emb, 2), label))
        optimizer.Adagrad(0.1).minimize(loss)
    rng = np.random.default_rng(3)
    vocabulary = rng.integers(0, 2**40, 400)
    batches = [
        {
            "ids": vocabulary[rng.integers(0, 400 if i < 4 else 20, (16, 3, 1))],
            "label": rng.integers(0, 2, (16, 1)),
        }
        for i in range(8)
    ]  # the last steps touch 20 of the 400 ids
    config = fluidps.DistributeTranspilerConfig(checkpoint_dir=str(tmp_path / "ckpt"))
    local = fluidps.Executor()
    local.run(startup)
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=1, config=config)) as exe:
        exe.run(startup)
        for p in main.all_parameters():  # the table: rows start from values of (seed, id)
            if p.name != "sparse_embedding_0.w_0":
                local.scope[p.name] = np.array(exe.scope[p.name], copy=True)
        for b in batches[:4]:
            exe.run(main, feed=b, fetch_list=[loss])
        (base,) = exe.checkpoint("base").values()
        for b in batches[4:6]:
            exe.run(main, feed=b, fetch_list=[loss])
        (delta,) = exe.checkpoint("delta").values()
        with pytest.raises(fluidps.ExecutionError, match="'base', 'delta' or None"):
            exe.checkpoint("full")
    base_manifest, delta_manifest = json.loads(Path(base).read_text()), json.loads(Path(delta).read_text())
    assert (base_manifest["base"], delta_manifest["base"]) == (None, base_manifest["count"])
    held = {
        v["origin"].rsplit(".", 1)[1]: v["shape"] for v in delta_manifest["vars"] if "@hashed" in v["origin"]
    }
    assert held["ids"][0] <= 20 < held["live_ids"][0]  # only the rows of the last two steps, whole
    expected = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=1, config=config)) as exe:
        exe.run(startup)  # overwritten by what the pservers restore
        got = [float(exe.run(main, feed=b, fetch_list=[loss])[0]) for b in batches[6:]]
    assert got == expected[6:]


def test_a_step_is_on_the_pservers_when_run_returns():
    """A model whose only parameter is a hashed table has no recv to wait on: run() still
    returns only once the pservers have the step, so what the client reads next has it."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        loss = layers.mean(layers.sparse_embedding(ids, [-1, 4]))
        optimizer.SGD(0.1).minimize(loss)
    rng = np.random.default_rng(0)
    seen: set[int] = set()
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=1)) as exe:
        exe.run(startup)
        for _ in range(12):
            batch = rng.integers(0, 2**62, (64, 1))
            exe.run(main, feed={"ids": batch}, fetch_list=[loss])
            seen.update(batch.ravel().tolist())
            rows = [next(iter(s["hashed_tables"].values()))["rows"] for s in exe.pserver_stats().values()]
            assert sum(rows) == len(seen) and min(rows) > 0


def test_a_profiled_job_reports_where_each_process_spent_each_step():
    """JobDesc(profile=True): exe.profile() holds the client's, each trainer's and each
    pserver's time by category, over the steps each counted."""
    from fluidps.profiling import per_step

    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(4)
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=2, profile=True)) as exe:
        exe.run(startup)
        exe.run(main, feed=batches[0], fetch_list=[loss])
        before = exe.profile()
        for b in batches[1:]:
            exe.run(main, feed=b, fetch_list=[loss])
        after = exe.profile()
    assert (before["client"]["steps"], after["client"]["steps"]) == (1, 4)
    assert [t["steps"] for t in after["trainers"]] == [4, 4]
    assert [p["steps"] for p in after["pservers"].values()] == [4, 4]  # sync: one optimization a step
    for trainer_before, trainer_after in zip(before["trainers"], after["trainers"], strict=True):
        steps = per_step(trainer_before, trainer_after)
        assert steps["steps"] == 3
        assert steps["calls_per_step"]["send_barrier"] == 1 and steps["calls_per_step"]["recv"] == 1
        assert steps["ms_per_step"]["compute"] > 0
    for endpoint, pserver in after["pservers"].items():
        steps = per_step(before["pservers"][endpoint], pserver)
        calls = steps["calls_per_step"]
        # Each trainer's barrier and GET ride on its last SEND of the step: no message of their own.
        assert (
            calls["handle SEND"] >= 2 and not calls.get("handle SEND_BARRIER") and not calls.get("handle GET")
        )
        assert steps["ms_per_step"]["optimize"] > 0


def test_profile_needs_a_profiled_job():
    exe = fluidps.RemoteExecutor(fluidps.JobDesc())
    try:
        with pytest.raises(fluidps.ExecutionError, match="JobDesc\\(profile=True\\)"):
            exe.profile()
    finally:
        exe.close()
