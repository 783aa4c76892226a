"""A block compiled on a thread of its own (Compiler.background) runs interpreted until
its code is ready, then compiled, with the same results; a pserver's loop keeps
serving trainers while its optimize blocks compile."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
from job_harness import PserverThreads
from rpc_harness import SECRET

import fluidps
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.compiler import Compiler, ModuleCache, ahead
from fluidps.executor.transport.settings import RpcSettings
from helpers import build_mlp

HANG = 120.0  # seconds: a bound for a hang, not a claim on speed


class Gate:
    """Stands in the way of ahead.compile_segments: a compile waits until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.entered, self.released = threading.Event(), threading.Event()
        real = ahead.compile_segments

        def compile_segments(*args):
            self.entered.set()
            assert self.released.wait(HANG), "the test never released the compile"
            return real(*args)

        monkeypatch.setattr(ahead, "compile_segments", compile_segments)


def adam_mlp(seed: int = 5):
    main, startup, loss = build_mlp(hidden=16, classes=3, seed=seed)
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.Adam(0.01).minimize(loss)
    return main, startup, loss


def feed(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {"x": rng.normal(size=(4, 64)).astype("float32"), "y": rng.integers(0, 3, (4, 1)).astype("int64")}


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + HANG
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {HANG} s"
        time.sleep(0.02)


def test_a_block_runs_interpreted_while_it_compiles_then_compiled_with_the_same_results(
    monkeypatch, tmp_path
):
    main, startup, _ = adam_mlp()
    block = main.global_block()
    env: dict = {}
    BlockRunner(startup.global_block()).run(env)
    reference = {name: np.array(value) for name, value in env.items()}
    gate = Gate(monkeypatch)
    runner = BlockRunner(block, compiler=Compiler(ModuleCache(tmp_path), compile_after=2, background=True))
    interpreted = BlockRunner(block)
    rng = np.random.default_rng(0)

    def step() -> None:
        batch = feed(rng)
        env.update(batch)
        reference.update(batch)
        runner.run(env)
        interpreted.run(reference)

    step()
    assert not runner.compiling and not gate.entered.is_set()
    step()  # its compile_after-th run: the compile starts once the run is done
    assert gate.entered.wait(HANG) and runner.compiling
    for _ in range(3):  # the compile is held: the block goes on, interpreted
        step()
        assert runner.compiling and runner.compiled_ops == 0
    gate.released.set()
    wait_until(lambda: not runner.compiling, "the compile ended")
    step()
    assert runner.compiled_ops > 0
    # Each segment's code was made ahead for the types its first call had: that call
    # compiled nothing more.
    assert all(len(s.fn.signatures) == 1 for s in runner.segments.values())
    step()
    for param in main.all_parameters():  # (compiled code calls the kernels' helpers: the same bits)
        np.testing.assert_array_equal(env[param.name], reference[param.name], err_msg=param.name)


def test_a_block_whose_compile_fails_warns_and_runs_interpreted(monkeypatch, tmp_path):
    main, startup, _ = adam_mlp()
    env: dict = {}
    BlockRunner(startup.global_block()).run(env)

    def fail(*args):
        raise RuntimeError("no code today")

    monkeypatch.setattr(ahead, "compile_segments", fail)
    compiler = Compiler(ModuleCache(tmp_path), compile_after=1, background=True)
    runner = BlockRunner(main.global_block(), compiler=compiler)
    rng = np.random.default_rng(1)
    env.update(feed(rng))
    runner.run(env)
    wait_until(lambda: not runner.compiling, "the failing compile ended")
    env.update(feed(rng))
    with pytest.warns(
        RuntimeWarning, match=r"runs interpreted: it could not be compiled \(RuntimeError: no code"
    ):
        runner.run(env)
    env.update(feed(rng))
    runner.run(env)  # and is not tried again
    assert runner.compiled_ops == 0 and not runner.compiling


def test_a_pserver_serves_its_trainer_while_its_optimize_blocks_compile(monkeypatch, tmp_path):
    """A compile on the pserver's loop thread held the loop: the trainers, their
    heartbeats unanswered, took the pserver for dead (a compile longer than the peer
    timeout on a loaded machine failed a job). Now the loop answers, and trains, while
    the compile is held."""
    main, startup, loss = adam_mlp(seed=3)
    eps = [f"inproc://ps0-{uuid.uuid4().hex[:8]}"]
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(slice_var_up=False))
    t.transpile(0, main, eps[0], trainers=1, startup_program=startup)
    gate = Gate(monkeypatch)
    settings = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
    compiler = Compiler(ModuleCache(tmp_path), compile_after=2)  # (the pserver compiles in the background)
    servers = PserverThreads(t, eps, settings, compile=compiler)
    exe = servers.trainer_executor()
    local = fluidps.Executor(compile=False)
    rng = np.random.default_rng(2)
    try:
        exe.run(t.get_trainer_startup_program())
        local.run(startup)
        for p in main.all_parameters():
            local.scope[p.name] = np.array(exe.scope[p.name])
        trainer = t.get_trainer_program()

        def step() -> None:
            batch = feed(rng)
            (got,) = exe.run(trainer, feed=batch, fetch_list=[loss])
            (want,) = local.run(main, feed=batch, fetch_list=[loss])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

        def stats() -> dict:
            return servers.server(eps[0]).stats()

        for _ in range(2):
            step()
        assert gate.entered.wait(HANG)
        for _ in range(3):
            step()  # answered, and applied, while the compile is held
            assert stats()["compiling_blocks"] >= 1 and stats()["compiled_ops"] == 0
        gate.released.set()
        wait_until(lambda: stats()["compiling_blocks"] == 0, "the pserver's compile ended")
        for _ in range(2):
            step()
        assert stats()["compiled_ops"] > 0
        for p in main.all_parameters():
            np.testing.assert_allclose(
                exe.scope[p.name], local.scope[p.name], rtol=1e-5, atol=1e-7, err_msg=p.name
            )
    finally:
        gate.released.set()
        problems = exe.close()
        servers.join()
    assert problems == []
