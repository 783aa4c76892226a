"""`fluidps calibrate`'s measures of this machine, stored for the cost model
(fluidps.transpiler.cost_model.MachineModel).

- rates, in a child process with one thread (whatever the caller's threading): a
  float32 matrix product's FLOP/s, a large copy's bytes/s, and what running one op
  through the interpreter costs;
- what an executor's run of a program costs besides its ops (a one-op program);
- a message's time over the transport (fluidps.executor.transport.link).

    python -m fluidps.executor.measure.calibrate --rates   # (the child's side: one JSON line)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

from fluidps.errors import Error
from fluidps.executor.executor import Executor, PreparedProgram
from fluidps.executor.transport.link import measure_link
from fluidps.ir.program import Program
from fluidps.ir.types import VarType
from fluidps.ops import REGISTRY
from fluidps.transpiler.cost_model import ANALYTIC, MachineModel, machine_id

_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def _best(run: Callable[[], None], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def measure_rates() -> dict[str, float]:
    """FLOP/s of a 256 x 1024 x 1024 float32 product, bytes/s of a 64 MiB copy, and one
    interpreted op's cost (a chain of small scale ops), in this process as it is threaded."""
    rng = np.random.default_rng(0)
    a = rng.random((256, 1024), dtype=np.float32)
    b = rng.random((1024, 1024), dtype=np.float32)
    gemm = _best(lambda: a @ b, 10)
    source = np.ones(16 << 20, np.float32)
    target = np.empty_like(source)
    copy = _best(lambda: np.copyto(target, source), 5)

    main = Program()
    block = main.global_block()
    block.create_var("x0", shape=[1, 1], dtype=VarType.FP32)
    for i in range(64):  # a chain of small ops: what each costs besides its arithmetic
        block.create_var(f"x{i + 1}", shape=[1, 1], dtype=VarType.FP32)
        REGISTRY.append_op(block, "scale", {"X": [f"x{i}"]}, {"Out": [f"x{i + 1}"]}, {"scale": 1.0})
    runs = []
    exe = Executor()
    one = {"x0": np.ones((1, 1), np.float32)}
    single = Program()  # one op: what an executor's run costs besides its ops
    single.global_block().create_var("x0", shape=[1, 1], dtype=VarType.FP32)
    single.global_block().create_var("x1", shape=[1, 1], dtype=VarType.FP32)
    REGISTRY.append_op(single.global_block(), "scale", {"X": ["x0"]}, {"Out": ["x1"]}, {"scale": 1.0})
    for _ in range(200):
        start = time.perf_counter()
        exe.run(single, feed=one, fetch_list=["x1"])
        runs.append(time.perf_counter() - start)
    prepared = PreparedProgram(main, [])
    feed = {"x0": np.ones((1, 1), np.float32)}
    per_op = []
    for _ in range(20):
        env = prepared.check_feeds(feed)
        per_op.extend(prepared.runner.run_timed(env))
    return {
        "gemm_flops": 2 * 256 * 1024 * 1024 / gemm,
        "bandwidth": 2 * source.nbytes / copy,
        "op_overhead_s": statistics.median(per_op),
        "run_overhead_s": max(statistics.median(runs[50:]) - statistics.median(per_op), 0.0),
    }


def _rates_in_child() -> dict[str, float]:
    env = {**os.environ, **dict.fromkeys(_ONE_THREAD, "1")}
    done = subprocess.run(
        [sys.executable, "-m", "fluidps.executor.measure.calibrate", "--rates"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise Error(f"measuring this machine's rates failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def calibrate(calls: int = 40) -> tuple[MachineModel, dict]:
    """This machine's MachineModel (calibrated), and the transport's measure it was fitted
    from (fluidps.executor.transport.link.measure_link's); its stage_overhead_s is the
    analytic one until a pipeline job measures it (fluidps.cli.calibrate_cmd: this room
    starts no jobs)."""
    rates = _rates_in_child()
    link = measure_link(calls=calls)
    model = MachineModel(
        gemm_flops=rates["gemm_flops"],
        bandwidth=rates["bandwidth"],
        op_overhead_s=rates["op_overhead_s"],
        run_overhead_s=rates["run_overhead_s"],
        stage_overhead_s=ANALYTIC.stage_overhead_s,  # (a job's measure: fluidps.cli.calibrate_cmd)
        alpha_s=link["alpha_s"],
        beta_s=link["beta_s"],
        send_cpu_s=link["send_cpu_s"],
        machine=machine_id(),
        calibrated=True,
    )
    return model, link


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rates", action="store_true", required=True, help="print the rates as JSON")
    parser.parse_args(argv)
    print(json.dumps(measure_rates()))


if __name__ == "__main__":
    main()
