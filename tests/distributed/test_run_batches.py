"""RemoteExecutor.run_batches: fed batches sent ahead, several to a RUN message, over a
real job of `fluidps serve` processes on 127.0.0.1; trained as one step at a time would be,
checked against local training."""

from __future__ import annotations

import numpy as np
import pytest
from remote_models import SLICED, mlp, mlp_batches, persistables, sparse_batches, sparse_model

import fluidps


def test_prefetched_batches_train_as_one_step_at_a_time():
    """run_batches keeps steps in flight (each trainer holds the next RUNs and goes from one
    to the next without waiting for the client); a 2x2 sync job still trains exactly like
    local training, with each gradient sent as backward computes it."""
    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(8)
    local = fluidps.Executor()
    local.run(startup)
    expected = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]

    job = fluidps.JobDesc(pservers=2, trainers=2, config=SLICED, prefetch_batches=3)
    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        got = [float(fetched[0]) for fetched in exe.run_batches(main, iter(batches), [loss])]
        for name in persistables(main):
            np.testing.assert_allclose(exe.scope[name], local.scope[name], rtol=2e-5, atol=1e-6, err_msg=name)
        held = [t["most_runs_held"] for t in exe.trainer_stats()]
        stats = exe.pserver_stats()
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # The first batch deploys the job; the others go up to 3 at a time. How many a trainer
    # held at once depends on how fast it ran them as they came: never more than 3.
    assert all(1 <= h <= 3 for h in held), held
    assert [s["completed_steps"] for s in stats.values()] == [len(batches)] * 2
    sends = [op for op in exe.plan.trainer_program.global_block().ops if op.type == "send"]
    assert len(sends) == 6  # one per parameter, in backward order


def test_batches_go_several_to_a_run_and_train_as_one_step_at_a_time():
    """By default run_batches sends 4 batches to a RUN (8 in flight): each trainer runs them as
    four steps and answers once. A 2x2 sync job trains exactly like local training, each
    step's fetches (a mean, and per-example rows of a batch smaller than the others) come
    back as run() gives them, and the batches left over go in a smaller message."""
    main, startup, loss, _, logits = mlp()
    batches = mlp_batches(10)
    batches[-2] = mlp_batches(1, rows=6, seed=5)[0]  # a smaller batch inside the last full RUN
    local = fluidps.Executor()
    local.run(startup)
    expected = [local.run(main, feed=b, fetch_list=[loss, logits]) for b in batches]

    job = fluidps.JobDesc(pservers=2, trainers=2, config=SLICED)
    assert (job.prefetch_batches, job.batches_per_run) == (8, 4)
    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        got = list(exe.run_batches(main, iter(batches), [loss, logits]))
        for name in persistables(main):
            np.testing.assert_allclose(exe.scope[name], local.scope[name], rtol=2e-5, atol=1e-6, err_msg=name)
        trainers = exe.trainer_stats()
        (completed,) = {s["completed_steps"] for s in exe.pserver_stats().values()}
    assert len(got) == len(batches) and completed == len(batches)
    for (loss_got, logits_got), (loss_want, logits_want) in zip(got, expected, strict=True):
        np.testing.assert_allclose(loss_got, loss_want, rtol=1e-5)
        np.testing.assert_allclose(logits_got, logits_want, rtol=1e-4, atol=1e-5)
    # The first batch deploys the job and runs alone; the other 9 go 4, 4 and 1 to a RUN.
    assert [t["ran"]["trainer"] for t in trainers] == [{"runs": 4, "batches": 10}] * 2
    assert all(1 <= t["most_runs_held"] <= 2 for t in trainers), trainers


@pytest.mark.parametrize("per_run", [1, 4])
def test_run_batches_of_a_distributed_table_job_asks_for_each_next_batchs_rows_with_the_step(per_run):
    """A trainer knowing the next batch (the next of its RUN's batches, or the RUN it holds
    next) asks its pservers for that batch's table rows behind the step's barrier, and the
    next step's prefetch sends nothing: the job still trains as local training on the
    whole batches."""
    main, startup, loss = sparse_model(distributed=True)
    batches = sparse_batches(8)
    local = fluidps.Executor()
    local.run(startup)
    expected = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in batches]
    config = fluidps.DistributeTranspilerConfig(min_block_size=64)
    with fluidps.RemoteExecutor(
        fluidps.JobDesc(
            pservers=2, trainers=2, config=config, prefetch_batches=3 * per_run, batches_per_run=per_run
        )
    ) as exe:
        exe.run(startup)
        got = [float(fetched[0]) for fetched in exe.run_batches(main, iter(batches), [loss])]
        table = np.array(exe.scope["embedding_0.w_0"], copy=True)
        prefetches = [t["prefetches"] for t in exe.trainer_stats()]
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    np.testing.assert_allclose(table, local.scope["embedding_0.w_0"], rtol=2e-5, atol=1e-6)
    # The first step deploys the job and runs alone; each later step but the last knows its
    # next batch when it is the same RUN's next (7 batches, 4 to a RUN: at least 3 + 2 steps),
    # or when the next RUN is held already (up to 3 are in flight).
    assert all(p["served_ahead"] >= (5 if per_run == 4 else 1) for p in prefetches), prefetches


def test_leaving_run_batches_early_finishes_the_steps_sent():
    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(6)
    with fluidps.RemoteExecutor(fluidps.JobDesc(prefetch_batches=2)) as exe:
        exe.run(startup)
        exe.run(main, feed=batches[0], fetch_list=[loss])  # deployed
        steps = exe.run_batches(main, iter(batches[1:]), [loss])
        next(steps)  # batches 1 and 2 were sent; 1 is answered
        steps.close()  # 2 was sent: it runs, and is waited for
        (stats,) = exe.pserver_stats().values()
        assert stats["completed_steps"] == 3
        # A failing step fails the job; the step queued behind it is not run.
        bad = dict(batches[3], y=np.full((16, 1), 99))  # labels outside the 10 classes
        with pytest.raises(fluidps.ExecutionError, match="the job failed at step 4"):
            list(exe.run_batches(main, iter([bad, batches[4]]), [loss]))
        with pytest.raises(fluidps.ExecutionError, match="failed earlier"):
            exe.run(main, feed=batches[5], fetch_list=[loss])


def test_leaving_run_batches_early_finishes_the_runs_sent_and_a_failing_batch_is_named():
    """Batches go 4 to a RUN, 8 in flight: leaving after the first step's fetches waits for
    the two RUNs sent, and sends nothing more. A batch failing inside a RUN fails the job,
    naming the RUN's steps and which of its batches failed: the batches before it ran,
    those after it did not."""
    main, startup, loss, _, _ = mlp()
    batches = mlp_batches(20)
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(startup)
        exe.run(main, feed=batches[0], fetch_list=[loss])  # deployed
        steps = exe.run_batches(main, iter(batches[1:17]), [loss])
        next(steps)  # two RUNs of 4 were sent (8 in flight), and the first one answered
        steps.close()  # the second one runs, and is waited for
        (stats,) = exe.pserver_stats().values()
        assert stats["completed_steps"] == 1 + 8
        bad = dict(batches[17], y=np.full((16, 1), 99))  # labels outside the 10 classes
        with pytest.raises(
            fluidps.ExecutionError, match=r"failed at steps 10-13: .*batch 2 of the 4 this RUN carried"
        ):
            list(exe.run_batches(main, iter([batches[18], bad, batches[19], batches[1]]), [loss]))
        (stats,) = exe.pserver_stats().values()
        assert stats["completed_steps"] == 10
        with pytest.raises(fluidps.ExecutionError, match="failed earlier"):
            exe.run(main, feed=batches[5], fetch_list=[loss])
