"""Parameter-server training throughput and transport bandwidth, one JSON row each.

    python -m bench.distributed [--quick] [--scale 1.0] [--models digits_mlp,ctr_embedding,ctr_distributed,ctr_hashed]
                                [--topologies 1x1,2x1,2x2] [--modes sync,async] [--ctr-vocab N[,N...]]
                                [--hashed-ids N]

About a minute and a half on two cores; --quick (1x1 and 2x2 jobs, a few steps, a
100,000-row table) is a smoke run. The models come from examples/ (scikit-learn
for the digits).

Training (samples/s, medians of `repeats` timed windows after a warm-up that
includes the deploy and the numba compiles):
- digits_mlp:    examples/digits_mlp.py's model (64-256-256-10, Adam) on the
                 digits, global batch 128
- ctr_embedding: examples/ctr_embedding.py's model (26 sparse fields over a
                 1,000,000 x 8 embedding, is_sparse, lazy Adam, 13 dense
                 features) on its synthetic clicks, global batch 512
- ctr_distributed: the same with the table marked is_distributed: jobs keep it
                 on the pservers and trainers prefetch the rows of each batch
                 (fluidps.transpiler.tables); its local rows are ctr_embedding's
- ctr_hashed:    examples/ctr_hashed.py's model: the same fields as raw 40-bit feature
                 hashes into a hashed table (layers.sparse_embedding, Adam), global batch 512
each as a RemoteExecutor job of 1x1, 2x1 and 2x2 trainers x pservers in sync,
async and async+communicator mode (DistributeTranspilerConfig.communicator) (every `fluidps serve` process on 127.0.0.1; the global batch
is split across the trainers; exe.run_batches keeps `--prefetch-batches` steps in
flight, 8 by default, 1 for one exe.run at a time, `--batches-per-run` of them to a
RUN message, 4 by default), and the same jobs the Fluid way
(runner "fluidps launch": bench/launched.py in every process, each trainer feeding
itself its rows of each batch, no client; `--runners` picks, and `--runners
launch-bound` runs them with `fluidps launch --bind-cores`, `--runners launch-unproven` without
the job's secret: what the proof on every message costs), next to fluidps.Executor on the same programs
and batches ("local" rows) and, when PyTorch is importable, bench.local's
PyTorch models (torch rows: the digits one trains with SGD, not Adam). A job row's
vs_local is its rate over the mean of two local rates, timed just before and just after
it (`local_around`): the machine drifts by up to a third over a run, and a ratio against
one local row timed minutes earlier would measure the drift.

Ceiling (compiled digits_mlp with 1x1 and 2x1 sync jobs, ctr_distributed with 1x1): a
row with "runner": "raw pyzmq (ceiling)" (bench.ceiling): the same forward and backward,
gradients and parameters (and a distributed table's rows of the next batch) exchanged as
raw pyzmq frames with a process that runs the optimizer ops, and nothing else; what a
sync job of these kernels could reach on this machine.

Memory (with --hashed-ids N): hashed_job_memory, a 1-trainer x 2-pserver job whose
hashed table (width 16, Adam) is fed N distinct ids, 65,536 a step: each pserver's table
bytes and RSS against the ideal N x (16 + 34 state values) x 4 bytes, and the trainer's
RSS after its first step and at the end (it holds no rows, whatever N is).

Profile (with --profile): each job row gains `profile`, every process's milliseconds per
step by category (fluidps.profiling), from after the first step: the client's RUN
messages, from sending to collecting (several steps each); each trainer's compute and
communication ops, serialize and deserialize; each pserver's request handling, optimize
blocks, serialize and deserialize. Profiling adds a clock read around every op.

Bandwidth (MiB/s of a 16 MiB float32 parameter, 4M elements, median of `repeats`):
- fluidps pull: exe.scope[name] (a GET to the one pserver of a 1x1 job)
- fluidps push: exe.scope[name] = value (a SET to the pserver; the trainer, which holds
  a copy of every parameter, is only told that its copy is stale and pulls it from
  the pserver before its next step: 16 MiB leave the client once)
- pyzmq push / pull: the same 16 MiB as one raw frame between this process
  (DEALER) and a subprocess (ROUTER), copy=False both ways, acknowledged by a
  small reply: the transport's ceiling on this machine, measured in this run.

Proof (bench "proof"): a 4 KiB and a 16 MiB SEND's round trip through fluidps's
RpcClient to an RpcServer subprocess, proven with a job secret and unproven (the
server insecure), in alternating rounds: what the proof on every message costs.

Every process runs one BLAS / numba thread; rows say how many processes
shared the machine's cores. A job row also gives its setup time (servers
started, startup run, job deployed), each process's RSS at the end, and the time
of exe.pserver_stats() at the end (sync jobs check that every pserver ran one optimization per step; a
failing call is reported in `stats_error`, the timing stands).
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
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from bench.bandwidth import bench_bandwidth, bench_proof  # noqa: E402
from bench.ceiling import raw_sync_rate  # noqa: E402
from bench.local import load_torch, timed, torch_classifier, torch_ctr  # noqa: E402
from bench.workloads import (  # noqa: E402
    CTR_VOCAB,
    Workload,
    ctr_hashed_workload,
    ctr_workload,
    digits_workload,
)
from fluidps import layers, optimizer  # noqa: E402
from fluidps.executor.compiler.segments import COMPILE_AFTER  # noqa: E402
from fluidps.profiling import per_step  # noqa: E402

CORES = os.cpu_count() or 1
MIB = 1 << 20
TOPOLOGIES = ((1, 1), (2, 1), (2, 2))  # trainers x pservers
# "async+communicator": async, each trainer's gradients sent and its parameters pulled by
# its communicator thread (DistributeTranspilerConfig.communicator).
MODES = ("sync", "async", "async+communicator")


def job_config(mode: str) -> fluidps.DistributeTranspilerConfig:
    mode, _, communicator = mode.partition("+")
    return fluidps.DistributeTranspilerConfig(mode=mode, communicator=communicator == "communicator")


# The jobs bench.ceiling runs over raw pyzmq, per workload: (trainers, pservers).
CEILINGS = {"digits_mlp": ((1, 1), (2, 1)), "ctr_distributed": ((1, 1),)}


def training_row(w: Workload, mode: str, trainers: int, pservers: int, rate: float, **extra) -> dict:
    batch = len(next(iter(w.batches[0].values())))
    processes = 1 + trainers + pservers if pservers else 1
    return {
        "bench": w.name,
        "mode": mode,
        "trainers": trainers,
        "pservers": pservers,
        "global_batch": batch,
        "samples_per_s": round(rate, 1),
        **extra,
        **w.info,
        "processes": processes,
        "cores": CORES,
        "processes_per_core": round(processes / CORES, 2),
        "threads": 1,
    }


def run_local(w: Workload, repeats: int, warmup: int, compiled: bool) -> tuple[float, float]:
    """(samples/s, last loss) of fluidps.Executor on the workload."""
    local = LocalRuns(w, repeats, warmup, compiled)
    return local.rate(), local.loss


class LocalRuns:
    """fluidps.Executor on the workload, built once and timed again on demand: a job row's
    vs_local is against the mean of the local rates timed just before and just after it, so
    that the machine drifting between the two (up to a third here) does not make the ratio."""

    def __init__(self, w: Workload, repeats: int, warmup: int, compiled: bool):
        main, startup, loss = w.build()
        self._exe = fluidps.Executor(compile=compiled)
        self._exe.run(startup)
        self._w, self._main, self._loss, self._repeats = w, main, loss, repeats
        self._warmup = warmup
        self.loss = float("nan")
        self.batch = len(next(iter(w.batches[0].values())))

    def rate(self) -> float:
        """Samples/s: the median of `repeats` windows (after a warm-up, the first time a
        longer one, through the compile)."""
        w, last = self._w, []

        def step(i: int) -> None:
            last[:] = self._exe.run(self._main, feed=w.batches[i % len(w.batches)], fetch_list=[self._loss])

        rate = timed(step, w.steps, self._repeats, self._warmup)
        self._warmup = min(self._warmup, 5)
        self.loss = float(last[0])
        return rate * self.batch


@dataclass(frozen=True)
class JobOptions:
    profile: bool = False  # each process's breakdown per step in the row
    prefetch_batches: int = 8  # steps in flight (JobDesc.prefetch_batches; 1: one at a time)
    batches_per_run: int = 4  # batches a RUN message carries (JobDesc.batches_per_run)
    runners: tuple[str, ...] = ("RemoteExecutor",)  # and/or "launch": bench/launched.py under fluidps launch
    compiled: bool = False  # every process's Executor compiles (fluidps.executor.compiler)


def run_job(
    w: Workload, trainers: int, pservers: int, mode: str, repeats: int, warmup: int, options: JobOptions
) -> tuple[float, dict]:
    """(samples/s, row fields) of a RemoteExecutor job on the workload, trained with
    exe.run_batches; with `options.profile`, the fields hold each process's breakdown
    per step, from after the first step."""
    main, startup, loss = w.build()
    job = fluidps.JobDesc(
        pservers=pservers,
        trainers=trainers,
        config=job_config(mode),
        profile=options.profile,
        prefetch_batches=options.prefetch_batches,
        batches_per_run=options.batches_per_run,
        compile=options.compiled,
    )
    start = time.perf_counter()
    last = []

    def train(steps: int, first: int) -> float:
        """Steps per second of `steps` steps through run_batches (its pipeline starts empty)."""
        batches = (w.batches[(first + i) % len(w.batches)] for i in range(steps))
        began = time.perf_counter()
        for fetched in exe.run_batches(main, batches, [loss]):
            last[:] = fetched
        return steps / (time.perf_counter() - began)

    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        train(1, 0)  # deploys the job
        setup_s = time.perf_counter() - start
        profiled = exe.profile() if options.profile else None
        train(warmup, 1)
        settle = wait_for_compiles(exe) if options.compiled else 0
        if settle:  # a step with the pservers' code installed, before any timing
            train(settle, 1 + warmup)
        warmup += settle
        rate = statistics.median(train(w.steps, 1 + warmup + r * w.steps) for r in range(repeats))
        if options.profile:
            profiled = breakdown(profiled, exe.profile())
        steps_run = 1 + warmup + w.steps * repeats
        stats_start = time.perf_counter()
        try:
            stats, stats_error = exe.pserver_stats(), None
        except fluidps.Error as e:  # reported in the row; the timing above stands
            stats, stats_error = None, str(e)
        stats_ms = (time.perf_counter() - stats_start) * 1e3
        trainers_rss = [t["rss_bytes"] for t in exe.trainer_stats()]
    batch = len(next(iter(w.batches[0].values())))
    fields = {
        "prefetch_batches": options.prefetch_batches,
        "batches_per_run": options.batches_per_run,
        "steps": w.steps * repeats,
        "warmup_steps": 1 + warmup,
        "loss": round(float(last[0]), 4),
        "setup_s": round(setup_s, 2),  # servers started, startup run, job deployed
        "stats_ms": round(stats_ms, 1),  # exe.pserver_stats() at the end
        "trainer_rss_mib": [mib(b) for b in trainers_rss],
    }
    if profiled is not None:
        fields["profile"] = profiled
    if stats is not None:
        fields["pserver_rss_mib"] = [mib(s["rss_bytes"]) for s in stats.values()]
    if stats_error is not None:
        fields["stats_error"] = stats_error
    elif mode == "sync":  # every pserver ran one optimization per step
        done = {s["completed_steps"] for s in stats.values()}
        if done != {steps_run}:
            raise RuntimeError(
                f"{w.name} {trainers}x{pservers} sync: pservers completed {done} of {steps_run}"
            )
    return rate * batch, fields


def wait_for_compiles(exe: fluidps.RemoteExecutor, timeout: float = 600.0) -> int:
    """Wait until no pserver compiles its optimize blocks (they compile beside the loop,
    which runs them interpreted meanwhile); the steps still to run before timing: 1
    when one was compiling (its code is installed at its next run), else 0."""
    deadline, waited = time.monotonic() + timeout, False
    while any(s["compiling_blocks"] for s in exe.pserver_stats().values()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pservers were still compiling after {timeout:g} s")
        waited = True
        time.sleep(0.1)
    return int(waited)


LAUNCHED = Path(__file__).resolve().parent / "launched.py"


def run_launched(
    w: Workload,
    trainers: int,
    pservers: int,
    mode: str,
    repeats: int,
    warmup: int,
    compiled: bool,
    bind_cores: bool = False,
    proof: bool = True,
) -> tuple[float, dict]:
    """(samples/s, row fields) of the same training the Fluid way: bench/launched.py under
    `fluidps launch` (`--bind-cores` with `bind_cores`), each trainer feeding itself its
    rows of each global batch (no client process). The rate adds up the trainers' (their
    steps/s, median of the windows, times their rows a step)."""
    with tempfile.TemporaryDirectory() as out:
        command = [
            *(sys.executable, "-m", "fluidps", "launch", *(["--bind-cores"] if bind_cores else [])),
            *("--pservers", str(pservers), "--trainers", str(trainers), "--mode", job_config(mode).mode),
            *(str(LAUNCHED), *w.launch_args, "--out", out),
            *(["--communicator"] if job_config(mode).communicator else []),
            *([] if proof else ["--no-proof"]),
            *("--steps", str(w.steps), "--repeats", str(repeats), "--warmup", str(1 + warmup)),
        ]
        start = time.perf_counter()
        env = dict(os.environ, FLUIDPS_COMPILE="1" if compiled else "0")  # each process's Executor()
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, env=env)
        if done.returncode:
            raise RuntimeError(
                f"fluidps launch failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        results = [json.loads((Path(out) / f"trainer.{i}.json").read_text()) for i in range(trainers)]
    rate = sum(statistics.median(r["steps_per_s"]) * r["batch"] for r in results)
    fields = {
        "runner": ("fluidps launch --bind-cores" if bind_cores else "fluidps launch")
        + ("" if proof else " (no proof)"),
        "steps": w.steps * repeats,
        "warmup_steps": 1 + warmup,
        "loss": round(results[0]["loss"], 4),
        "wall_s": round(time.perf_counter() - start, 2),  # processes started, compiled, trained, stopped
    }
    return rate, fields


def breakdown(before: dict, after: dict) -> dict:
    """Each process's ms per step between two exe.profile() reports."""
    out = {"client": per_step(before["client"], after["client"])["ms_per_step"]}
    for i, (b, a) in enumerate(zip(before["trainers"], after["trainers"], strict=True)):
        out[f"trainer {i}"] = per_step(b, a)["ms_per_step"]
    for k, endpoint in enumerate(after["pservers"]):
        out[f"pserver {k}"] = per_step(before["pservers"][endpoint], after["pservers"][endpoint])[
            "ms_per_step"
        ]
    return out


def bench_training(
    w: Workload, torch, repeats: int, warmup: int, topologies, modes, options: JobOptions
) -> None:
    """The workload's rows: local (and PyTorch's, when importable), then every job, with
    the executor `options` says; each job's vs_local is against the local rates of its executor
    timed just before and just after it (`local_around`; LocalRuns)."""
    executor = "compiled" if options.compiled else "interpreted"
    local_runs = LocalRuns(w, repeats, warmup, options.compiled)
    local = before = local_runs.rate()
    local_row = training_row(
        w, "local", 1, 0, local, steps=w.steps * repeats, loss=round(local_runs.loss, 4), impl="fluidps"
    )
    print(json.dumps({**local_row, "executor": executor}), flush=True)
    if torch is not None:
        batch = len(next(iter(w.batches[0].values())))
        if w.name == "digits_mlp":
            rate = batch * torch_classifier(torch, [64, 256, 256, 10], batch, w.steps, repeats)
            info = {"optimizer": "sgd (bench.local's torch model; random data)"}
        else:
            rate = torch_ctr(torch, batch, w.steps, repeats)
            info = {"optimizer": "SparseAdam + Adam (bench.local's torch model; random data)"}
        row = training_row(w, "local", 1, 0, rate, steps=w.steps * repeats, impl="torch")
        row.update(info, torch_vs_fluidps_local=round(rate / local, 3), fluidps_executor=executor)
        if w.name == "ctr_embedding":
            row["table"] = "1000000x8"  # bench.local's size, whatever --ctr-vocab says
        print(json.dumps(row), flush=True)
    for trainers, pservers in topologies:
        for mode in modes:
            for runner in options.runners:
                if runner in ("launch", "launch-bound", "launch-unproven"):
                    rate, fields = run_launched(
                        w,
                        trainers,
                        pservers,
                        mode,
                        repeats,
                        warmup,
                        options.compiled,
                        runner == "launch-bound",
                        proof=runner != "launch-unproven",
                    )
                else:
                    rate, fields = run_job(w, trainers, pservers, mode, repeats, warmup, options)
                    fields = {"runner": "RemoteExecutor", **fields}
                row = training_row(w, mode, trainers, pservers, rate, **fields, impl="fluidps")
                before, bracket = _bracket(local_runs, before)
                row.update(
                    executor=executor,
                    vs_local=round(rate / statistics.mean(bracket), 3),
                    local_around=bracket,
                )
                print(json.dumps(row), flush=True)
            if mode == "sync" and options.compiled and (trainers, pservers) in CEILINGS.get(w.name, ()):
                # The same exchange over raw pyzmq, nothing else: what a sync job could reach
                # (bound to cores as well, next to jobs launched so).
                for bound in (False, True) if "launch-bound" in options.runners else (False,):
                    rate, loss = raw_sync_rate(w, repeats, warmup, trainers, bound)
                    processes = trainers + 1
                    row = training_row(
                        w,
                        mode,
                        trainers,
                        1,
                        rate,
                        runner="raw pyzmq (ceiling)" + (", bound to cores" if bound else ""),
                        steps=w.steps * repeats,
                        loss=round(loss, 4),
                    )
                    before, bracket = _bracket(local_runs, before)
                    row.update(
                        impl="bench.ceiling",
                        executor=executor,
                        vs_local=round(rate / statistics.mean(bracket), 3),
                        local_around=bracket,
                        processes=processes,
                    )
                    row["processes_per_core"] = round(processes / CORES, 2)
                    print(json.dumps(row), flush=True)


def _bracket(local_runs: LocalRuns, before: float) -> tuple[float, list[float]]:
    """The local rate timed now (the next row's `before`), and [before, now] rounded."""
    after = local_runs.rate()
    return after, [round(before, 1), round(after, 1)]


def mib(nbytes: int) -> float:
    return round(nbytes / MIB, 1)


# -- memory ---------------------------------------------------------------------------------


def bench_hashed_job_memory(ids_wanted: int, pservers: int = 2, dim: int = 16) -> dict:
    """Feed a job's hashed table `ids_wanted` distinct ids; where the memory went."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        loss = layers.mean(layers.sparse_embedding(ids, [-1, dim]))
        optimizer.Adam(0.001).minimize(loss)
    batch = min(65536, max(1, ids_wanted // 10))
    rng = np.random.default_rng(0)
    start, fed = time.perf_counter(), 0
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=pservers, trainers=1)) as exe:
        exe.run(startup)
        while fed < ids_wanted:
            exe.run(main, feed={"ids": rng.integers(0, 2**62, (batch, 1))}, fetch_list=[loss])
            if not fed:
                first_rss = exe.trainer_stats()[0]["rss_bytes"]
            fed += batch
        seconds = time.perf_counter() - start
        (trainer,) = exe.trainer_stats()
        shards = [
            next(iter(s["hashed_tables"].values())) | {"rss": s["rss_bytes"]}
            for s in exe.pserver_stats().values()
        ]
    rows = sum(s["rows"] for s in shards)
    ideal = rows * (dim + 2 * dim + 2) * 4  # values, Adam's two moments and two beta powers
    return {
        "bench": "hashed_job_memory",
        "trainers": 1,
        "pservers": pservers,
        "ids_fed": fed,
        "rows": rows,
        "width": dim,
        "ideal_mib": mib(ideal),
        "pserver_table_mib": [mib(s["bytes"]) for s in shards],
        "pserver_rss_mib": [mib(s["rss"]) for s in shards],
        "table_over_ideal": round(sum(s["bytes"] for s in shards) / ideal, 2),
        "pserver_rss_over_ideal": round(sum(s["rss"] for s in shards) / ideal, 2),
        "trainer_rss_first_step_mib": mib(first_rss),
        "trainer_rss_mib": mib(trainer["rss_bytes"]),
        "ids_per_s": round(fed / seconds),
    }


# -- driver ---------------------------------------------------------------------------------


def parse_topologies(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        trainers, _, pservers = item.partition("x")
        out.append((int(trainers), int(pservers)))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: 1x1 and 2x2 jobs, a few steps, a 100,000-row table"
    )
    parser.add_argument("--scale", type=float, default=1.0, help="multiply the timed steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="digits_mlp,ctr_embedding,ctr_distributed,ctr_hashed")
    parser.add_argument(
        "--topologies",
        help=f"trainers x pservers (default {','.join(f'{t}x{p}' for t, p in TOPOLOGIES)}; --quick: 1x1,2x2)",
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--digits-batch", type=int, default=128)
    parser.add_argument("--ctr-batch", type=int, default=512)
    parser.add_argument(
        "--ctr-vocab", default=str(CTR_VOCAB), help="rows of the CTR table; a comma list runs each"
    )
    parser.add_argument("--bandwidth-mib", type=int, default=16, help="0: no bandwidth rows")
    parser.add_argument(
        "--hashed-ids", type=int, default=0, help="also feed a hashed table's job this many ids"
    )
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="jobs record where each process's time goes (a `profile` field)",
    )
    parser.add_argument(
        "--prefetch-batches",
        type=int,
        default=fluidps.JobDesc().prefetch_batches,
        help="steps each job keeps in flight (JobDesc.prefetch_batches; 1: one at a time)",
    )
    parser.add_argument(
        "--batches-per-run",
        type=int,
        default=fluidps.JobDesc().batches_per_run,
        help="batches each RUN message carries to a trainer (JobDesc.batches_per_run; 1: a message a step)",
    )
    parser.add_argument(
        "--runners",
        default="RemoteExecutor,launch",
        help="how jobs run: RemoteExecutor (this process is the client), launch "
        "(bench/launched.py under fluidps launch: each trainer feeds itself) and/or launch-bound "
        "(the same with --bind-cores; a ceiling row bound to cores too) and/or launch-unproven (the "
        "same as launch with no job secret, no proof on any message: what the proof costs)",
    )
    parser.add_argument(
        "--executors",
        default="interpreted,compiled",
        help="fluidps's executor in every process: interpreted and/or compiled "
        "(fluidps.executor.compiler); each runs the local row and every job",
    )
    args = parser.parse_args(argv)
    runners = tuple(args.runners.split(","))
    if not set(runners) <= {"RemoteExecutor", "launch", "launch-bound", "launch-unproven"}:
        raise SystemExit(
            f"--runners: RemoteExecutor, launch, launch-bound and/or launch-unproven, got {args.runners!r}"
        )
    executors = args.executors.split(",")
    if not executors or not set(executors) <= {"interpreted", "compiled"}:
        raise SystemExit(f"--executors: interpreted and/or compiled, got {args.executors!r}")
    all_options = [
        JobOptions(args.profile, args.prefetch_batches, args.batches_per_run, runners, e == "compiled")
        for e in executors
    ]
    # warm-up steps: past the step where blocks compile (its first windows are not timed)
    repeats, warmup, scale = args.repeats, COMPILE_AFTER + 2, args.scale
    if args.quick:
        repeats, warmup, scale = 1, 2, 0.05
        if args.ctr_vocab == str(CTR_VOCAB):
            args.ctr_vocab = "100000"
    torch = None if args.no_torch else load_torch()
    if args.topologies is None:
        args.topologies = "1x1,2x2" if args.quick else ",".join(f"{t}x{p}" for t, p in TOPOLOGIES)
    topologies, modes = parse_topologies(args.topologies), args.modes.split(",")
    print(
        json.dumps(
            {
                "note": f"{CORES} cores; a job of T trainers and P pservers runs T + P server "
                "processes plus this client, one BLAS / numba thread each"
            }
        ),
        flush=True,
    )
    for options in all_options:
        for name in args.models.split(","):
            if name == "digits_mlp":
                w = digits_workload(args.digits_batch, max(int(150 * scale), 3))
                bench_training(w, torch, repeats, warmup, topologies, modes, options)
            elif name == "ctr_hashed":
                w = ctr_hashed_workload(args.ctr_batch, max(int(40 * scale), 3))
                bench_training(w, None, repeats, warmup, topologies, modes, options)
            elif name in ("ctr_embedding", "ctr_distributed"):
                for vocab in (int(v) for v in args.ctr_vocab.split(",")):
                    w = ctr_workload(
                        args.ctr_batch, max(int(40 * scale), 3), vocab, name == "ctr_distributed"
                    )
                    bench_training(w, torch, repeats, warmup, topologies, modes, options)
            else:
                raise SystemExit(f"unknown model {name!r}")
    if args.hashed_ids:
        print(json.dumps(bench_hashed_job_memory(args.hashed_ids)), flush=True)
    if args.bandwidth_mib > 0:
        bench_bandwidth(args.bandwidth_mib * MIB, max(int(20 * scale), 5))
        bench_proof(args.bandwidth_mib * MIB, max(int(200 * scale), 10))


if __name__ == "__main__":
    main()
