"""Sparse (SelectedRows) optimizer updates against their numpy equivalents, one JSON row each.

    python -m bench.sparse_update [--table-rows 1000000] [--rows 10000] [--width 16] [--repeats 15]

Workloads, on a float32 [table_rows, width] table and a gradient of `rows`
random rows (repeats included, as an embedding batch gives them):
- sgd_sparse_rows:  sgd with a SelectedRows gradient; numpy: np.add.at(param, rows, -lr * value)
- adam_lazy_sparse_rows: lazy-mode adam; numpy: np.unique + np.add.at to merge the rows,
  then the Adam update on the fancy-indexed rows
- hashed_adam_lookup_update: what a pserver shard of a hashed table does per step: look
  up the batch's unique ids, then apply their Adam gradient (rows kept per id, each with
  its own state); next to adam_lazy_sparse_rows on a fixed table, as rows/s
- hashed_checkpoint_delta: a checkpoint of that shard after 5 steps, whole (base) and
  as a delta of the previous one (only the rows the steps updated): bytes and ms each
- hashed_table_memory (with --hashed-ids N): a hashed table (dim --width, Adam) fed N
  distinct ids: its bytes and this process's RSS growth against N x (dim + state) x 4
fluidps_ms runs the op through fluidps.Executor (the parameter and its state
updated in place in a scope, the gradient fed), so it includes the executor's
per-run overhead; kernel_ms calls the op's kernel runner alone. Medians of
`repeats` timed runs after a warm-up.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from fluidps.executor.resources import resident_bytes  # noqa: E402
from fluidps.io import checkpoints as ckpt  # noqa: E402
from fluidps.ir.types import VarType  # noqa: E402
from fluidps.ops import REGISTRY  # noqa: E402
from fluidps.ops.hashed_table import state_width  # noqa: E402
from fluidps.ops.selected_rows import SelectedRows  # noqa: E402
from fluidps.ops.sparse_table import Rule, SparseTable, TableSettings  # noqa: E402

BETA1, BETA2, EPSILON, LR = 0.9, 0.999, 1e-8, 0.01


def median_ms(run: Callable[[], None], repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class SparseStep:
    """One optimizer op over persistable state in a scope, the gradient fed, as a
    Fluid program holds it (ParamOut names Param, so the update is in place)."""

    def __init__(self, op_type: str, state: dict[str, np.ndarray], slots: dict[str, str], attrs: dict):
        self.program = fluidps.Program()
        block = self.program.global_block()
        self.scope = fluidps.Scope()
        for name, value in state.items():
            block.create_var(name, shape=value.shape, dtype=value.dtype, persistable=True)
            self.scope[name] = value
        param = state["param"]
        block.create_var("grad", shape=param.shape, dtype=param.dtype, type=VarType.SELECTED_ROWS)
        inputs = {slot: [name] for slot, name in slots.items()}
        inputs["Grad"] = ["grad"]
        outputs = {slot + "Out": [name] for slot, name in slots.items() if slot != "LearningRate"}
        self.op = REGISTRY.append_op(block, op_type, inputs, outputs, attrs)
        self.exe = fluidps.Executor(scope=self.scope)
        self.runner = REGISTRY.build_kernel(self.op)

    def run(self, grad: SelectedRows) -> None:
        self.exe.run(self.program, feed={"grad": grad})

    def run_kernel(self, grad: SelectedRows) -> None:
        env = {name: self.scope[name] for name in self.scope}
        env["grad"] = grad
        self.runner(env)


def numpy_sgd(param: np.ndarray, grad: SelectedRows, lr: np.float32) -> None:
    np.add.at(param, grad.rows, -lr * grad.value)


def numpy_lazy_adam(state: dict[str, np.ndarray], grad: SelectedRows) -> None:
    rows, inverse = np.unique(grad.rows, return_inverse=True)
    g = np.zeros((rows.shape[0], grad.value.shape[1]), dtype=grad.value.dtype)
    np.add.at(g, inverse, grad.value)
    t = np.float32
    b1, b2, one = t(BETA1), t(BETA2), t(1)
    # As the fluidps (and Fluid) sparse kernel: powers advanced first, then used.
    state["beta1_pow"] *= b1
    state["beta2_pow"] *= b2
    b1p, b2p = state["beta1_pow"][0], state["beta2_pow"][0]
    lr_t = t(LR) * (np.sqrt(one - b2p) / (one - b1p))
    m1 = b1 * state["moment1"][rows] + (one - b1) * g
    m2 = b2 * state["moment2"][rows] + (one - b2) * g * g
    state["moment1"][rows] = m1
    state["moment2"][rows] = m2
    state["param"][rows] -= lr_t * (m1 / (np.sqrt(m2) + t(EPSILON) * np.sqrt(one - b2p)))


def bench_sgd(args: argparse.Namespace, grads: list[SelectedRows]) -> dict:
    rng = np.random.default_rng(0)
    param = rng.normal(size=(args.table_rows, args.width)).astype(np.float32)
    lr = np.array([LR], dtype=np.float32)
    step = SparseStep("sgd", {"param": param.copy(), "lr": lr}, {"Param": "param", "LearningRate": "lr"}, {})
    it = iter(range(1 << 30))
    fluidps_ms = median_ms(lambda: step.run(grads[next(it) % len(grads)]), args.repeats)
    kernel_ms = median_ms(lambda: step.run_kernel(grads[next(it) % len(grads)]), args.repeats)
    numpy_ms = median_ms(lambda: numpy_sgd(param, grads[next(it) % len(grads)], lr[0]), args.repeats)
    return row("sgd_sparse_rows", args, fluidps_ms, kernel_ms, numpy_ms)


def bench_lazy_adam(args: argparse.Namespace, grads: list[SelectedRows]) -> dict:
    rng = np.random.default_rng(1)
    shape = (args.table_rows, args.width)
    state = {
        "param": rng.normal(size=shape).astype(np.float32),
        "moment1": np.zeros(shape, np.float32),
        "moment2": np.zeros(shape, np.float32),
        "beta1_pow": np.array([BETA1], np.float32),
        "beta2_pow": np.array([BETA2], np.float32),
        "lr": np.array([LR], np.float32),
    }
    slots = {
        "Param": "param",
        "Moment1": "moment1",
        "Moment2": "moment2",
        "Beta1Pow": "beta1_pow",
        "Beta2Pow": "beta2_pow",
        "LearningRate": "lr",
    }
    attrs = {"beta1": BETA1, "beta2": BETA2, "epsilon": EPSILON, "lazy_mode": True}
    step = SparseStep("adam", {k: v.copy() for k, v in state.items()}, slots, attrs)
    it = iter(range(1 << 30))
    fluidps_ms = median_ms(lambda: step.run(grads[next(it) % len(grads)]), args.repeats)
    kernel_ms = median_ms(lambda: step.run_kernel(grads[next(it) % len(grads)]), args.repeats)
    numpy_ms = median_ms(lambda: numpy_lazy_adam(state, grads[next(it) % len(grads)]), args.repeats)
    return row("adam_lazy_sparse_rows", args, fluidps_ms, kernel_ms, numpy_ms)


def bench_hashed_adam(args: argparse.Namespace, grads: list[SelectedRows]) -> dict:
    """A shard holding `table_rows` ids (raw 40-bit hashes) takes the same batches."""
    rng = np.random.default_rng(3)
    held = rng.integers(0, 2**40, args.table_rows)
    table = SparseTable("bench", TableSettings(dim=args.width))
    table.use_rule(Rule("adam", epsilon=EPSILON, beta1=BETA1, beta2=BETA2))
    for chunk in np.array_split(held, max(1, args.table_rows // 100_000)):
        table.update(chunk, np.zeros((len(chunk), args.width), np.float32), 0.0)
    batches = [(held[g.rows], g.value) for g in grads]  # the fixed table's batches, as hashes
    it = iter(range(1 << 30))

    def step() -> None:
        ids, value = batches[next(it) % len(batches)]
        table.lookup(np.unique(ids))
        table.update(ids, value, LR)

    ms = median_ms(step, args.repeats)
    trained = {
        "workload": "hashed_adam_lookup_update",
        "table_rows": len(table),
        "rows": args.rows,
        "width": args.width,
        "fluidps_ms": round(ms, 4),
        "rows_per_s": round(args.rows / ms * 1e3),
    }
    return trained, bench_hashed_checkpoint(args, table, step)


def bench_hashed_checkpoint(args: argparse.Namespace, table: SparseTable, step: Callable[[], None]) -> dict:
    """Save `table` whole, train 5 steps, then save it whole again and as a delta."""

    def save(
        store: ckpt.CheckpointStore, since: int | None, base: int | None
    ) -> tuple[ckpt.Checkpoint, float]:
        start = time.perf_counter()
        snapshot = table.snapshot(since)
        arrays = {f"bench.{key}": array for key, array in snapshot.arrays.items()}
        places = {name: ckpt.Placement(ckpt.hashed_piece("bench", 0, name[6:])) for name in arrays}
        saved = store.save(arrays, places, table.clock, "bench", base=base)
        return saved, (time.perf_counter() - start) * 1e3

    with tempfile.TemporaryDirectory() as directory:
        store = ckpt.CheckpointStore(directory, 0, keep=10)
        first, _ = save(store, None, None)
        since = table.clock
        for _ in range(5):
            step()
        whole, whole_ms = save(store, None, None)
        delta, delta_ms = save(store, since, first.count)
    return {
        "workload": "hashed_checkpoint_delta",
        "table_rows": len(table),
        "rows_updated": int((table.rows.updated[: len(table)] > since).sum()),
        "width": args.width,
        "base_bytes": whole.data_bytes,
        "delta_bytes": delta.data_bytes,
        "base_ms": round(whole_ms, 1),
        "delta_ms": round(delta_ms, 1),
        "delta_over_base": round(delta.data_bytes / whole.data_bytes, 4),
    }


def bench_hashed_memory(args: argparse.Namespace) -> dict:
    before = resident_bytes()
    table = SparseTable("bench", TableSettings(dim=args.width))
    table.use_rule(Rule("adam"))
    chunk = 200_000
    rng = np.random.default_rng(4)
    grad = np.zeros((chunk, args.width), np.float32)
    fed = 0
    start = time.perf_counter()
    while fed < args.hashed_ids:
        ids = np.unique(rng.integers(0, 2**62, chunk))  # distinct in practice: 2^62 values
        table.update(ids, grad[: len(ids)], 0.0)
        fed += len(ids)
    seconds = time.perf_counter() - start
    ideal = len(table) * (args.width + state_width("adam", args.width)) * 4
    grown = resident_bytes() - before
    return {
        "workload": "hashed_table_memory",
        "ids": len(table),
        "width": args.width,
        "rule": "adam",
        "ideal_bytes": ideal,
        "table_bytes": table.nbytes,
        "rss_growth_bytes": grown,
        "table_over_ideal": round(table.nbytes / ideal, 2),
        "rss_over_ideal": round(grown / ideal, 2),
        "ids_per_s": round(len(table) / seconds),
    }


def row(
    workload: str, args: argparse.Namespace, fluidps_ms: float, kernel_ms: float, numpy_ms: float
) -> dict:
    return {
        "workload": workload,
        "table_rows": args.table_rows,
        "rows": args.rows,
        "width": args.width,
        "fluidps_ms": round(fluidps_ms, 4),
        "kernel_ms": round(kernel_ms, 4),
        "numpy_add_at_ms": round(numpy_ms, 4),
        "speedup": round(numpy_ms / fluidps_ms, 2),
        "rows_per_s": round(args.rows / fluidps_ms * 1e3),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-rows", type=int, default=1_000_000)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--hashed-ids", type=int, default=0, help="also feed a hashed table this many ids")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(2)
    grads = [
        SelectedRows(
            rng.integers(0, args.table_rows, size=args.rows),
            rng.normal(size=(args.rows, args.width)).astype(np.float32),
            args.table_rows,
        )
        for _ in range(4)
    ]
    for bench in (bench_sgd, bench_lazy_adam):
        print(json.dumps(bench(args, grads)), flush=True)
    for result in bench_hashed_adam(args, grads):
        print(json.dumps(result), flush=True)
    if args.hashed_ids:
        print(json.dumps(bench_hashed_memory(args)), flush=True)


if __name__ == "__main__":
    main()
