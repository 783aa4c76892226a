"""Pipeline training throughput: a compute-heavy MLP cut into two stages, each stage a
process with one thread, against local training with one thread, in the same run.

    python -m bench.pipeline [--layers 8] [--width 1024] [--batch 256] [--steps 20]
                             [--repeats 3] [--microbatches 4,8,16] [--schedules 1F1B,F-then-B]
                             [--quick]

Rows (JSON, one per line):
- "local": the plain program (no PipelineOptimizer), fluidps.Executor with one thread;
  measured before and after the pipeline rows ("local_around" holds both);
- "local (default threads)": the same in a process left to its default threading;
- "pipeline": per schedule and m, the PipelineOptimizer program under RemoteExecutor, one
  process per stage with one thread each: samples/s, its ratio to the one-thread local
  rate (vs_local), the ideal p*m / (m + p - 1) for p stages and m micro-batches, and the
  ratio to local at default threading; micro_batching_cost, the plain program's rate over
  the pipeline program's in one process (smaller GEMMs, m runs of each phase, the gradient
  sums), and reachable = ideal / micro_batching_cost; gemm_limit, the ideal scaled by what
  the model's matrix products alone lose when cut into micro-batches (the executor's own
  GEMM, timed in the same run at the full batch and at batch/m rows): what the stages
  could reach if a micro-batch cost nothing but its products; stages_memory, each stage's
  parameter bytes and the most micro-batches' activations it held at once.
The model is balanced: half the hidden layers on each stage, the classifier on the last.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from fluidps import layers  # noqa: E402

STAGES = 2
CORES = os.cpu_count() or 1
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")


def build(hidden_layers: int, width: int, pipeline: dict | None):
    """An MLP of `hidden_layers` relu layers of `width`, 10 classes, SGD; with
    `pipeline`, the first half of the layers on stage 0, the rest on stage 1."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [width])
        y = layers.data("y", [1], dtype="int64")
        h = x
        for i in range(hidden_layers):
            stage = i * STAGES // hidden_layers
            with fluidps.device_guard(f"stage:{stage}" if pipeline else None):
                h = layers.fc(h, width, act="relu")
        with fluidps.device_guard(f"stage:{STAGES - 1}" if pipeline else None):
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 10), y))
        inner = fluidps.optimizer.SGD(0.001)
        if pipeline:
            fluidps.optimizer.PipelineOptimizer(inner, **pipeline).minimize(loss)
        else:
            inner.minimize(loss)
    return main, startup, loss


def batches(width: int, batch: int, count: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(batch, width)).astype("float32"),
            "y": rng.integers(0, 10, (batch, 1)).astype("int64"),
        }
        for _ in range(count)
    ]


def rate(run, feeds, steps: int, repeats: int, warmup: int) -> float:
    """Median steps per second over `repeats` runs of `steps` steps, after `warmup` steps."""
    for i in range(warmup):
        run(feeds[i % len(feeds)])
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(steps):
            run(feeds[i % len(feeds)])
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def gemm_seconds(width: int, layers: int, rows: int, repeats: int = 3) -> float:
    """Seconds of one pass of the model's matrix products at `rows` rows: per layer the
    forward product, the input gradient and the weight gradient, through the compiled
    executor's GEMM (the numba np.dot its mul lowering calls). Best of `repeats`."""
    from fluidps.ops.matmul import _gemm

    rng = np.random.default_rng(0)
    shapes = [(width, width)] * layers + [(width, 10)]
    weights = [rng.normal(size=s).astype("float32") for s in shapes]
    inputs = [rng.normal(size=(rows, s[0])).astype("float32") for s in shapes]
    grads = [rng.normal(size=(rows, s[1])).astype("float32") for s in shapes]

    def one_pass() -> None:
        for w, x, d in zip(weights, inputs, grads, strict=True):
            _gemm(x, w)
            _gemm(d, w.T)
            _gemm(x.T, d)

    one_pass()  # (the compile)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - start)
    return best


def gemm_cost(args, m: int) -> float:
    """What cutting the batch into m micro-batches costs the model's products alone:
    m passes at batch/m rows over one pass at the full batch."""
    full = gemm_seconds(args.width, args.layers, args.batch)
    return m * gemm_seconds(args.width, args.layers, args.batch // m) / full


def local_rate(args) -> float:
    main, startup, loss = build(args.layers, args.width, None)
    exe = fluidps.Executor()
    exe.run(startup)
    feeds = batches(args.width, args.batch)
    return rate(
        lambda f: exe.run(main, feed=f, fetch_list=[loss]), feeds, args.steps, args.repeats, args.warmup
    )


def local_pipeline_rate(args, m: int, schedule_mode: str) -> float:
    """Steps/s of the pipeline program in this process (fluidps.Executor runs its stages
    one after another): what cutting the batch into m micro-batches costs the compute."""
    main, startup, loss = build(
        args.layers, args.width, {"num_microbatches": m, "schedule_mode": schedule_mode}
    )
    exe = fluidps.Executor()
    exe.run(startup)
    feeds = batches(args.width, args.batch)
    return rate(
        lambda f: exe.run(main, feed=f, fetch_list=[loss]), feeds, args.steps, args.repeats, args.warmup
    )


def pipeline_rate(args, m: int, schedule_mode: str) -> tuple[float, float, list[dict]]:
    """(steps/s, final loss, each stage's memory: its parameters' bytes and the most
    micro-batches' activations it held at once) of the pipeline job."""
    main, startup, loss = build(
        args.layers, args.width, {"num_microbatches": m, "schedule_mode": schedule_mode}
    )
    feeds = batches(args.width, args.batch)
    last = []
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(startup)

        def step(feed):
            last[:] = exe.run(main, feed=feed, fetch_list=[loss])

        steps_per_s = rate(step, feeds, args.steps, args.repeats, args.warmup)
        memory = [
            {k: s["pipeline"][k] for k in ("stage", "param_bytes", "peak_live_microbatches")}
            for s in exe.stage_stats()
        ]
    return steps_per_s, float(last[0]), memory


def default_threads_rate(args) -> float:
    """The one-thread local workload in a process left to its default threading."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    command = [sys.executable, "-m", "bench.pipeline", "--local-default-threads", *_workload_args(args)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["steps_per_s"])


def _workload_args(args) -> list[str]:
    return [
        *("--layers", str(args.layers), "--width", str(args.width), "--batch", str(args.batch)),
        *("--steps", str(args.steps), "--repeats", str(args.repeats), "--warmup", str(args.warmup)),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=12, help="steps before timing (past the compile)")
    parser.add_argument("--microbatches", default="4,8,16")
    parser.add_argument("--schedules", default="1F1B,F-then-B")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a small model, a few steps")
    parser.add_argument("--local-default-threads", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.batch, args.steps, args.repeats, args.warmup = 2, 64, 16, 3, 1, 2
        args.microbatches = "2"
    if args.local_default_threads:  # (run by default_threads_rate, in a process of its own)
        print(json.dumps({"steps_per_s": local_rate(args)}))
        return
    model = f"{args.width}x{args.layers}+10"
    common = {"model": model, "batch": args.batch, "cores": CORES}
    print(json.dumps({"note": f"{CORES} cores; each stage a process with one thread; local with one thread"}))
    before = local_rate(args)
    rows = []
    gemm_costs = {m: gemm_cost(args, m) for m in (int(v) for v in args.microbatches.split(","))}
    for schedule_mode in args.schedules.split(","):
        for m in (int(v) for v in args.microbatches.split(",")):
            steps_per_s, loss, memory = pipeline_rate(args, m, schedule_mode)
            one_process = local_pipeline_rate(args, m, schedule_mode)
            ideal = STAGES * m / (m + STAGES - 1)
            rows.append(
                {
                    "bench": "pipeline", "schedule": schedule_mode, "microbatches": m, "stages": STAGES,
                    "samples_per_s": round(steps_per_s * args.batch, 1), "ideal": round(ideal, 3),
                    "loss": round(loss, 4), "threads_per_stage": 1, **common,
                    "one_process_samples_per_s": round(one_process * args.batch, 1),
                    "gemm_cost": round(gemm_costs[m], 3),
                    "stages_memory": memory,
                }
            )  # fmt: skip
    after = local_rate(args)
    local = (before + after) / 2
    default = default_threads_rate(args)
    print(json.dumps({"bench": "local", "samples_per_s": round(local * args.batch, 1), "threads": 1,
                      "local_around": [round(before * args.batch, 1), round(after * args.batch, 1)], **common}))  # fmt: skip
    print(
        json.dumps(
            {"bench": "local (default threads)", "samples_per_s": round(default * args.batch, 1), **common}
        )
    )
    for row in rows:
        row["vs_local"] = round(row["samples_per_s"] / (local * args.batch), 3)
        # what m micro-batches cost the compute (the pipeline program in one process, against
        # the plain program): the ideal scaled by it is what the stages could reach
        row["micro_batching_cost"] = round(local * args.batch / row["one_process_samples_per_s"], 3)
        row["reachable"] = round(row["ideal"] / row["micro_batching_cost"], 3)
        row["gemm_limit"] = round(row["ideal"] / row["gemm_cost"], 3)
        row["vs_local_default_threads"] = round(row["samples_per_s"] / (default * args.batch), 3)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
