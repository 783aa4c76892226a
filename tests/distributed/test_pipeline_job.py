"""A pipeline program under RemoteExecutor: one process per stage, activations and their
gradients passed stage to stage over ZeroMQ, trained as the whole batch trains locally;
a stage that dies is reported by name, a stage that compiles keeps answering."""

from __future__ import annotations

import os
import signal
from unittest import mock

import numpy as np
import pytest

import fluidps
from helpers import shared_weight_mlp, staged_conv_net, staged_mlp

BATCH = 8


def model(pipeline: dict | None, stages: int = 2, optimizer=None):
    return staged_mlp(pipeline, stages, optimizer)


def batches(n: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "x": rng.normal(size=(BATCH, 16)).astype("float32"),
            "y": rng.integers(0, 5, (BATCH, 1)).astype("int64"),
        }
        for _ in range(n)
    ]


def params(main: fluidps.Program) -> list[str]:
    return [p.name for p in main.all_parameters()]


@pytest.mark.parametrize(
    ("stages", "m", "schedule_mode"),
    [(2, 4, "1F1B"), (2, 4, "F-then-B"), (2, 1, "1F1B"), (3, 2, "1F1B")],
    ids=["2-stages-1F1B", "2-stages-F-then-B", "one-micro-batch", "3-stages-fewer-micro-batches"],
)
def test_a_pipeline_job_trains_as_the_whole_batch_does_locally(stages, m, schedule_mode):
    pm, ps, pl, plog = model({"num_microbatches": m, "schedule_mode": schedule_mode}, stages)
    lm, ls, ll, llog = model(None, stages)
    local = fluidps.Executor()
    local.run(ls)
    feeds = batches(6)
    want = [local.run(lm, feed=b, fetch_list=[ll, llog]) for b in feeds]
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(ps)
        got = [exe.run(pm, feed=b, fetch_list=[pl, plog]) for b in feeds]
        # one more step, fetching the parameters after it, each from the stage that holds it
        trained = exe.run(pm, feed=feeds[0], fetch_list=params(pm))
        # an evaluation program runs in the client on the stages' values
        (evaluated,) = exe.run(pm.clone(for_test=True), feed=feeds[1], fetch_list=[plog])
        pids = exe.server_pids
        assert sorted(n for n in pids if n.startswith("stage.")) == [f"stage.{k}" for k in range(stages)]
        stats = [s["pipeline"] for s in exe.stage_stats()]
        plan = fluidps.PipelineTranspiler().transpile(pm)
    local.run(lm, feed=feeds[0])  # (that step, here)
    (want_evaluated,) = local.run(lm.clone(for_test=True), feed=feeds[1], fetch_list=[llog])
    np.testing.assert_allclose(evaluated, want_evaluated, rtol=1e-4, atol=1e-5)
    # each stage holds its own layers' parameters, and at most the activations its schedule allows
    assert [s["params"] for s in stats] == [list(p.params) for p in plan.stages]
    assert sorted(n for s in stats for n in s["params"]) == sorted(params(pm))  # each held once
    live = [min(stages - k, m) for k in range(stages)] if schedule_mode == "1F1B" else [m] * stages
    assert [s["peak_live_microbatches"] for s in stats] == live
    for (loss, logits), (want_loss, want_logits) in zip(got, want, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        assert logits.shape == (BATCH, 5)  # per example: the micro-batches' joined
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    for name, value in zip(params(pm), trained, strict=True):
        np.testing.assert_allclose(value, local.scope[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize(("m", "schedule_mode"), [(8, "F-then-B"), (2, "1F1B")])
def test_a_conv_net_job_with_adam_has_the_losses_of_whole_batch_training(m, schedule_mode):
    pm, ps, pl, _ = staged_conv_net(
        fluidps.optimizer.Adam(0.01), {"num_microbatches": m, "schedule_mode": schedule_mode}
    )
    lm, ls, ll, _ = staged_conv_net(fluidps.optimizer.Adam(0.01), None)
    local = fluidps.Executor()
    local.run(ls)
    rng = np.random.default_rng(1)
    feeds = [
        {
            "img": rng.normal(size=(BATCH, 1, 8, 8)).astype("float32"),
            "y": rng.integers(0, 5, (BATCH, 1)).astype("int64"),
        }
        for _ in range(20)
    ]
    want = [local.run(lm, feed=b, fetch_list=[ll])[0] for b in feeds]
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(ps)
        got = [exe.run(pm, feed=b, fetch_list=[pl])[0] for b in feeds]
    np.testing.assert_allclose(got, want, rtol=1e-4)  # (Adam: float32 sums in another order)


def test_weights_shared_by_two_stage_processes_stay_one_value():
    """The stage that updates a weight another stage reads hands it the new value each step."""

    pm, ps, pl, _ = shared_weight_mlp(fluidps.optimizer.SGD(0.1), {"num_microbatches": 2})
    lm, ls, ll, _ = shared_weight_mlp(fluidps.optimizer.SGD(0.1), None)
    local = fluidps.Executor()
    local.run(ls)
    feeds = batches(5)
    want = [local.run(lm, feed=b, fetch_list=[ll])[0] for b in feeds]
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(ps)
        got = [exe.run(pm, feed=b, fetch_list=[pl])[0] for b in feeds]
        weights = [exe.scope["shared_w"]]
    np.testing.assert_allclose(got, want, rtol=1e-5)  # (stage 1 read the updated weights every step)
    np.testing.assert_allclose(weights[0], local.scope["shared_w"], rtol=1e-5, atol=1e-6)


def test_two_replicas_of_a_pipeline_train_as_local_training_on_their_joined_batches():
    """JobDesc(trainers=2): two replicas of the two stages, each stage's parameters on a
    pserver of its own, averaging the replicas' gradients; fed the joined batch, split."""
    adam = fluidps.optimizer.Adam(0.01)
    pm, ps, pl, plog = model({"num_microbatches": 2}, optimizer=adam)
    lm, ls, ll, llog = model(None, optimizer=fluidps.optimizer.Adam(0.01))
    local = fluidps.Executor()
    local.run(ls)
    feeds = batches(5)  # (each batch of 8: 4 rows a replica, 2 a micro-batch)
    want = [local.run(lm, feed=b, fetch_list=[ll, llog]) for b in feeds]
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=2)) as exe:
        exe.run(ps)
        got = [exe.run(pm, feed=b, fetch_list=[pl, plog]) for b in feeds]
        trained = {name: exe.scope[name] for name in params(pm)}
        pids = exe.server_pids
        with pytest.raises(fluidps.UnsupportedError, match="live on their stages' pservers"):
            exe.scope["fc_0.w_0"] = trained["fc_0.w_0"]
    assert sorted(n for n in pids if n.startswith("stage.")) == [f"stage.{i}" for i in range(4)]
    for (loss, logits), (want_loss, want_logits) in zip(got, want, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-4)  # (Adam: float32 sums in another order)
        assert logits.shape == (BATCH, 5)  # the replicas' rows joined
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    for name, value in trained.items():
        np.testing.assert_allclose(value, local.scope[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_replicas_of_a_pipeline_need_a_pserver_per_stage():
    pm, ps, pl, _ = model({"num_microbatches": 2})
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=2)) as exe:
        exe.run(ps)
        with pytest.raises(fluidps.ExecutionError, match=r"JobDesc\(pservers=1\) .* ask for at least 2"):
            exe.run(pm, feed=batches(1)[0], fetch_list=[pl])


def test_a_stage_that_dies_fails_the_step_naming_it_within_the_peer_timeout():
    pm, ps, pl, _ = model({"num_microbatches": 2})
    feeds = batches(3)
    with fluidps.RemoteExecutor(fluidps.JobDesc(peer_timeout=3.0)) as exe:
        exe.run(ps)
        exe.run(pm, feed=feeds[0], fetch_list=[pl])
        os.kill(exe.server_pids["stage.1"], signal.SIGKILL)
        with pytest.raises(fluidps.ExecutionError, match=r"the pipeline failed at step 2: .*stage 1"):
            exe.run(pm, feed=feeds[1], fetch_list=[pl])


def test_stages_compiling_from_a_cold_cache_keep_answering_each_other(tmp_path):
    """Each stage compiles its phases (numba, empty caches) on its worker thread while its
    serving loop answers: a peer waiting for it sees it alive, with a short peer timeout (5 s)."""
    pm, ps, pl, _ = model({"num_microbatches": 4}, optimizer=fluidps.optimizer.Adam(0.01))
    lm, ls, ll, _ = model(None, optimizer=fluidps.optimizer.Adam(0.01))
    local = fluidps.Executor(compile=False)
    local.run(ls)
    feeds = batches(12)
    want = [local.run(lm, feed=b, fetch_list=[ll])[0] for b in feeds]
    env = {"FLUIDPS_CACHE_DIR": str(tmp_path / "fluidps"), "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    with (
        mock.patch.dict(os.environ, env),
        fluidps.RemoteExecutor(fluidps.JobDesc(peer_timeout=5.0, compile=True)) as exe,
    ):
        exe.run(ps)
        got = [exe.run(pm, feed=b, fetch_list=[pl])[0] for b in feeds]
        compiled = [t.get("compiled_ops", 0) for t in exe.stage_stats()]
    assert all(c > 0 for c in compiled)  # every stage ran compiled code by the end
    np.testing.assert_allclose(got, want, rtol=1e-4)
