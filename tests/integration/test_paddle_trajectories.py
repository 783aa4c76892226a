"""Programs written by PaddlePaddle run here and give Paddle's numbers.

The fixtures hold Paddle 3.3.1's training programs, the parameters its
startup program produced, five batches, and the losses and parameters its
executor computed (see tests/fixtures/paddle/make_fixtures.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import fluidps
from fluidps.executor.compiler import Compiler, ModuleCache
from helpers import paddle_fixture


@pytest.mark.parametrize("compiled", [False, True], ids=["interpreted", "compiled"])
@pytest.mark.parametrize("fixture", ["adam_sparse", "sgd_tanh"])
def test_paddle_training_program_follows_paddles_trajectory(fixture, compiled, tmp_path):
    path = paddle_fixture(fixture)
    program = fluidps.Program.parse_from_string((path / "main.pb").read_bytes())
    loss_name = json.loads((path / "summary.json").read_text())["loss"]
    initial, batches, final = (np.load(path / f"{n}.npz") for n in ("initial", "batches", "final"))
    scope = fluidps.Scope()
    for name in initial.files:
        scope[name] = initial[name].copy()
    # (compiled: from the second step on, as a program with its code on disk would be)
    exe = fluidps.Executor(compile=Compiler(ModuleCache(tmp_path), compile_after=2) if compiled else False)
    feed_names = sorted({key.split(":", 1)[1] for key in batches.files})
    losses = []
    for step in range(len(final["losses"])):
        feed = {name: batches[f"{step}:{name}"] for name in feed_names}
        (loss,) = exe.run(program, feed=feed, fetch_list=[loss_name], scope=scope)
        losses.append(float(loss))
    np.testing.assert_allclose(losses, final["losses"], rtol=1e-5, atol=1e-6)
    compared = 0
    for name in final.files:
        if name == "losses":
            continue
        np.testing.assert_allclose(scope[name], final[name], rtol=2e-5, atol=1e-6, err_msg=name)
        compared += 1
    assert compared == len(initial.files)
    if compiled:  # the second and later steps ran compiled segments
        (prepared,) = exe._cache[program].values()
        assert prepared.runner.segments


@pytest.mark.parametrize("fixture", ["adam_sparse", "sgd_tanh"])
def test_paddle_startup_program_runs(fixture):
    path = paddle_fixture(fixture)
    startup = fluidps.Program.parse_from_string((path / "startup.pb").read_bytes())
    initial = np.load(path / "initial.npz")
    exe = fluidps.Executor()
    exe.run(startup)
    for name in initial.files:
        ours, theirs = exe.scope[name], initial[name]
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, name
        # Same initializer: same range (uniform) or the same constant.
        if np.all(theirs == theirs.flat[0]):
            np.testing.assert_array_equal(ours, theirs)
        else:
            assert np.abs(ours).max() <= np.abs(theirs).max() * 1.05 + 1e-6
