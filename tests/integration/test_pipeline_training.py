"""A pipeline program trains as the plain program does on the whole batch: an MLP and a
conv net on 2 stages, 3 stages, shared weights, m in {1, 2, 4, 8}, SGD and Adam, both
schedules; each stage holds at most the activations its schedule allows."""

from __future__ import annotations

import numpy as np
import pytest

import fluidps
from fluidps.executor.compiler import Compiler, ModuleCache
from helpers import shared_weight_mlp as shared_weights
from helpers import staged_conv_net as conv_net
from helpers import staged_mlp

STEPS = 20
BATCH = 8


def mlp(optimizer, pipeline: dict | None, stages: int = 2):
    """Four hidden layers of 32 spread over `stages`, then the classifier on the last."""
    return staged_mlp(pipeline, stages, optimizer)


def batches(kind: str, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = (BATCH, 1, 8, 8) if kind == "img" else (BATCH, 16)
    return [
        {kind: rng.normal(size=shape).astype("float32"), "y": rng.integers(0, 5, (BATCH, 1)).astype("int64")}
        for _ in range(STEPS)
    ]


def train_both(build, feed_kind: str, optimizer, pipeline: dict, exe=None):
    """(pipeline executor, its program, per-step losses and logits), the same for the plain program."""
    pm, ps, pl, plog = build(optimizer(), pipeline)
    lm, ls, ll, llog = build(optimizer(), None)
    pipe_exe, local = exe or fluidps.Executor(), fluidps.Executor()
    pipe_exe.run(ps)
    local.run(ls)
    got, want = [], []
    for feed in batches(feed_kind):
        got.append(pipe_exe.run(pm, feed=feed, fetch_list=[pl, plog]))
        want.append(local.run(lm, feed=feed, fetch_list=[ll, llog]))
    return pipe_exe, pm, got, want, local, lm


def sgd():
    return fluidps.optimizer.SGD(0.1)


def adam():
    return fluidps.optimizer.Adam(0.01)


@pytest.mark.parametrize("schedule_mode", ["1F1B", "F-then-B"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_two_stages_with_sgd_train_the_parameters_of_whole_batch_training(m, schedule_mode):
    exe, pm, got, want, local, lm = train_both(
        mlp, "x", sgd, {"num_microbatches": m, "schedule_mode": schedule_mode}
    )
    for p in lm.all_parameters():
        np.testing.assert_allclose(
            exe.scope[p.name], local.scope[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name
        )
    for (loss, logits), (want_loss, want_logits) in zip(got, want, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
        assert logits.shape == want_logits.shape == (BATCH, 5)  # per example: the micro-batches' joined
        np.testing.assert_allclose(logits, want_logits, rtol=1e-4, atol=1e-5)
    if m == 1:  # one micro-batch is the whole batch: the same bits
        for p in lm.all_parameters():
            np.testing.assert_array_equal(exe.scope[p.name], local.scope[p.name])
    # Live activations: 1F1B keeps at most (stages - stage) micro-batches, F-then-B all m.
    peaks = [s["peak_live_microbatches"] for s in exe.pipeline_stats(pm)]
    assert peaks == ([min(2, m), min(1, m)] if schedule_mode == "1F1B" else [m, m])


@pytest.mark.parametrize("schedule_mode", ["1F1B", "F-then-B"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_two_stages_with_adam_have_the_losses_of_whole_batch_training(m, schedule_mode):
    _, _, got, want, _, _ = train_both(
        mlp, "x", adam, {"num_microbatches": m, "schedule_mode": schedule_mode}
    )
    # (Adam divides by the gradient's root mean square: float32 summation order shows more
    # where a gradient is near zero, so the losses are compared, step by step.)
    for (loss, _), (want_loss, _) in zip(got, want, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 2, 4])
def test_three_stages_train_as_one_even_with_fewer_micro_batches_than_stages(m):
    def three(optimizer, pipeline):
        return mlp(optimizer, pipeline, stages=3)

    exe, pm, _got, _want, local, lm = train_both(three, "x", sgd, {"num_microbatches": m})
    for p in lm.all_parameters():
        np.testing.assert_allclose(
            exe.scope[p.name], local.scope[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name
        )
    stats = exe.pipeline_stats(pm)
    assert [s["peak_live_microbatches"] for s in stats] == [min(3 - s, m) for s in range(3)]
    # each stage holds its own layers' parameters
    assert [len(s["params"]) for s in stats] == [4, 2, 4]


@pytest.mark.parametrize("schedule_mode", ["1F1B", "F-then-B"])
def test_a_conv_net_on_two_stages_trains_as_whole_batch_training(schedule_mode):
    _, _, got, want, _, _ = train_both(
        conv_net, "img", adam, {"num_microbatches": 4, "schedule_mode": schedule_mode}
    )
    for (loss, _), (want_loss, _) in zip(got, want, strict=True):
        np.testing.assert_allclose(loss, want_loss, rtol=1e-4)


def test_weights_shared_by_two_stages_are_updated_once_with_both_gradients():
    exe, pm, _got, _want, local, _lm = train_both(shared_weights, "x", sgd, {"num_microbatches": 2})
    np.testing.assert_allclose(exe.scope["shared_w"], local.scope["shared_w"], rtol=1e-5, atol=1e-6)
    plan = fluidps.PipelineTranspiler().transpile(pm)
    assert "shared_w" in plan.stages[0].params and "shared_w" not in plan.stages[1].params
    # stage 1's part of the gradient goes back to the stage that updates the weights
    assert any(c.var.startswith("shared_w@GRAD") and (c.src, c.dst) == (1, 0) for c in plan.crossings)
    # and, once updated, the weights go to the other stage that reads them
    assert [(c.src, c.dst, c.phase) for c in plan.crossings if c.var == "shared_w"] == [(0, 1, "optimize")]


def test_compiled_stages_train_as_interpreted_ones(tmp_path):
    exe = fluidps.Executor(compile=Compiler(ModuleCache(tmp_path), compile_after=2))
    exe, _pm, _got, _want, local, lm = train_both(mlp, "x", sgd, {"num_microbatches": 2}, exe=exe)
    assert exe.compiled_ops() > 0
    for p in lm.all_parameters():
        np.testing.assert_allclose(
            exe.scope[p.name], local.scope[p.name], rtol=1e-5, atol=1e-6, err_msg=p.name
        )


def test_an_evaluation_clone_runs_the_whole_batch_at_once():
    exe, pm, _, _, local, lm = train_both(mlp, "x", sgd, {"num_microbatches": 4})
    test_program = pm.clone(for_test=True)
    assert test_program.pipeline is None
    feed = batches("x", seed=9)[0]
    logits = next(v for v in test_program.global_block().vars if v.startswith("fc_4.tmp"))
    (got,) = exe.run(test_program, feed=feed, fetch_list=[logits])
    (want,) = local.run(lm.clone(for_test=True), feed=feed, fetch_list=[logits])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
