"""`fluidps calibrate`: this machine's rates and its transport's message time, measured
once and stored for the cost model (fluidps.transpiler.cost_model.MachineModel).

- rates, in a child process with one thread (whatever the caller's threading): a
  float32 matrix product's FLOP/s, a large copy's bytes/s, and what running one op
  through the interpreter costs;
- what an executor's run of a program costs besides its ops (a one-op program);
- a message of b bytes, alpha + beta * b: round trips of STAGE_SEND messages (what
  pipeline stages send each other) carrying one float32 tensor, through fluidps's
  RpcClient to an RpcServer in another process, with the job's proof, as a job's
  processes talk; least squares over the sizes, alpha half the fitted round trip of an
  empty message (the answer is one of those); and what sending an empty one costs
  the sender (send_cpu_s: encoding, proving, handing it to ZeroMQ).

    python -m fluidps.executor.calibrate --rates   # (the child's side: one JSON line)
    python -m fluidps.executor.calibrate --echo    # (the peer's side: prints its address)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np
import zmq

from fluidps.errors import Error
from fluidps.executor.executor import Executor, PreparedProgram
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient, RpcServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ir.program import Program
from fluidps.ir.types import VarType
from fluidps.ops import REGISTRY
from fluidps.transpiler.cost_model import ANALYTIC, MachineModel, machine_id

SIZES = (0, 16 << 10, 256 << 10, 1 << 20, 4 << 20)
_ONE_THREAD = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
_SECRET_ENV = "FLUIDPS_JOB_SECRET"
_IDLE_EXIT_S = 120.0  # an echo peer nobody talks to this long ends itself


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
        [sys.executable, "-m", "fluidps.executor.calibrate", "--rates"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        raise Error(f"measuring this machine's rates failed: {done.stderr.strip()[-500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def serve_echo() -> None:
    """An RpcServer that answers each request OK (and exits on SHUTDOWN, or when idle)."""
    secret = JobSecret.from_hex(os.environ[_SECRET_ENV], _SECRET_ENV)
    server = RpcServer(zmq.Context(), "tcp://127.0.0.1:0", "calibration peer", RpcSettings(secret=secret))
    print(server.address, flush=True)
    last = time.monotonic()
    running = True
    while running and time.monotonic() - last < _IDLE_EXIT_S:
        for request in server.receive(1.0):
            server.reply(request)
            running = request.msg.kind != Kind.SHUTDOWN
            last = time.monotonic()
    server.close()


def measure_link(sizes: Sequence[int] = SIZES, calls: int = 40) -> dict[str, float | list]:
    """alpha_s and beta_s of a message over fluidps's transport to another process, and
    the median round trip of each size."""
    secret = JobSecret.generate()
    env = {**os.environ, _SECRET_ENV: secret.hex()}
    peer = subprocess.Popen(
        [sys.executable, "-m", "fluidps.executor.calibrate", "--echo"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    context = zmq.Context()
    client = None
    try:
        address = peer.stdout.readline().strip()
        if not address:
            raise Error("the calibration peer process did not start; see its error above")
        client = RpcClient(context, address, "the calibration peer", RpcSettings(secret=secret))
        client.call(Message(Kind.HELLO), timeout=60)
        messages = [
            Message(Kind.STAGE_SEND, tensors={"v": np.ones(size // 4, np.float32)}, text="0")
            for size in sizes
        ]
        for msg in messages:  # (warm: buffers, the peer's first decode)
            client.call(msg, timeout=60)
        samples: list[list[float]] = [[] for _ in sizes]
        for _ in range(calls):  # the sizes in turn: the machine's drift touches each alike
            for msg, taken in zip(messages, samples, strict=True):
                start = time.perf_counter()
                client.call(msg, timeout=60)
                taken.append(time.perf_counter() - start)
        trips = [statistics.median(taken) for taken in samples]
        sends = []  # one end's own work on an empty message: encoding it, proving it, handing it on
        empty = Message(Kind.STAGE_SEND, tensors={"v": np.ones(0, np.float32)}, text="0")
        for _ in range(calls):
            start = time.perf_counter()
            rid = client.request(empty)
            sends.append(time.perf_counter() - start)
            client.wait(rid, 60)
        client.call(Message(Kind.SHUTDOWN), timeout=60)
    finally:
        if client is not None:
            client.close()
        context.destroy(linger=0)
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
        peer.stdout.close()
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(trips), 1)
    return {
        "alpha_s": max(float(intercept) / 2, 0.0),
        "beta_s": max(float(slope), 0.0),
        "send_cpu_s": statistics.median(sends),
        "round_trips": [[int(s), round(t, 7)] for s, t in zip(sizes, trips, strict=True)],
    }


def calibrate(calls: int = 40) -> tuple[MachineModel, dict]:
    """This machine's MachineModel (calibrated), and what it was fitted from; its
    stage_overhead_s is the analytic one until a pipeline job measures it
    (fluidps.cli.calibrate_cmd.measure_stage_overhead: this room starts no jobs)."""
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
    return model, {"round_trips": link["round_trips"]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    side = parser.add_mutually_exclusive_group(required=True)
    side.add_argument("--rates", action="store_true")
    side.add_argument("--echo", action="store_true")
    args = parser.parse_args(argv)
    if args.rates:
        print(json.dumps(measure_rates()))
    else:
        serve_echo()


if __name__ == "__main__":
    main()
