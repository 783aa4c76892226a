"""Local training throughput, one JSON row per workload.

    python -m bench.local [--steps 300] [--repeats 3] [--ctr-batch 512] [--ctr-steps N]
                          [--ctr-vocab 1000000] [--no-torch] [--no-paddle]
                          [--sparse-table-rows N] [--sparse-rows N] [--sparse-repeats N]
                          [--executor both|interpreted|compiled|unfused|all]

Workloads (one thread everywhere: BLAS, numba, and PyTorch):
- mlp:   the digits MLP 64-256-256-10, SGD, batch 64 and 128 -> steps/s
- tiny:  64-10 softmax regression, SGD, batch 64 -> steps/s (per-op overhead)
- ctr:   26 sparse fields over a 1,000,000 x 8 embedding (is_sparse, lazy Adam)
         plus 13 dense features -> samples/s
- sparse row updates (bench.sparse_update): 10^4 random rows of a 10^6-row
  table, SelectedRows sgd and lazy adam against numpy's np.add.at
When PyTorch (or PaddlePaddle) is importable the same workloads run on it in
this process and each row carries their numbers and the ratio. fluidps's rows come
once per executor ("executor": "interpreted", "compiled", or "unfused": compiled without
fusing elementwise runs, to measure fusion in the same run); a compiled row also says
how long its first compile took (first_compile_s, in a fresh cache) and the same
start with the code already on disk (cached_compile_s).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from bench import paddle_peer, sparse_update  # noqa: E402
from fluidps import layers, optimizer  # noqa: E402
from fluidps.executor.compiler import Compiler, ModuleCache  # noqa: E402

CTR_FIELDS, CTR_DENSE, CTR_VOCAB, CTR_DIM = 26, 13, 1_000_000, 8


def timed(step: Callable[[int], None], steps: int, repeats: int, warmup: int = 20) -> float:
    """Median steps per second over `repeats` runs of `steps` steps, after a warm-up."""
    for i in range(warmup):
        step(i)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(steps):
            step(i)
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


# -- fluidps --------------------------------------------------------------------------------


class Executors:
    """Executors of one kind: interpreted, or compiled with their code kept in one
    fresh cache directory (so the first compile is a real one). For a compiled one,
    `compile_times` holds how long the run that compiled took, in a cold cache and
    then with the code already on disk (a second process's start)."""

    def __init__(self, compiled: bool, fuse: bool = True):
        self.compiled, self.fuse = compiled, fuse
        self.cache_dir = tempfile.mkdtemp(prefix="fluidps-bench-") if compiled else None
        self.compile_times: dict[str, float] = {}

    @property
    def name(self) -> str:
        return ("compiled" if self.fuse else "unfused") if self.compiled else "interpreted"

    def make(self) -> fluidps.Executor:
        if not self.compiled:
            return fluidps.Executor(compile=False)
        # compile_after=2: compiled at the second run, which the compile times time
        return fluidps.Executor(
            compile=Compiler(ModuleCache(self.cache_dir), fuse=self.fuse, compile_after=2)
        )

    def warm(self, exe: fluidps.Executor, run: Callable[[fluidps.Executor], None], make_again=None) -> None:
        """Run twice (a block is compiled at its second run), timing that run."""
        run(exe)
        start = time.perf_counter()
        run(exe)
        if self.compiled:
            self.compile_times["first_compile_s"] = round(time.perf_counter() - start, 2)
            if make_again is not None:  # a new executor on the same cache: code from disk
                again = make_again()
                run(again)
                start = time.perf_counter()
                run(again)
                self.compile_times["cached_compile_s"] = round(time.perf_counter() - start, 2)

    def close(self) -> None:
        if self.cache_dir is not None:
            shutil.rmtree(self.cache_dir, ignore_errors=True)


def classifier_program(
    sizes: list[int], batch: int
) -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable, list[dict[str, np.ndarray]]]:
    """An MLP of `sizes` (relu between, softmax cross entropy, SGD): (main, startup, loss,
    eight random batches of `batch` rows)."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [sizes[0]])
        y = layers.data("y", [1], dtype="int64")
        h = x
        for width in sizes[1:-1]:
            h = layers.fc(h, width, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, sizes[-1]), y))
        optimizer.SGD(0.01).minimize(loss)
    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.random((batch, sizes[0]), dtype=np.float32), "y": rng.integers(0, sizes[-1], (batch, 1))}
        for _ in range(8)
    ]
    return main, startup, loss, batches


def fluidps_classifier(
    sizes: list[int], batch: int, steps: int, repeats: int, executors: Executors | None = None
) -> float:
    executors = executors or Executors(compiled=False)
    main, startup, loss, batches = classifier_program(sizes, batch)

    def started() -> fluidps.Executor:
        exe = executors.make()
        exe.run(startup)
        return exe

    exe = started()
    executors.warm(exe, lambda e: e.run(main, feed=batches[0], fetch_list=[loss]), started)
    return timed(lambda i: exe.run(main, feed=batches[i % 8], fetch_list=[loss]), steps, repeats)


def ctr_batches(batch: int, count: int = 8, vocab: int = CTR_VOCAB) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    per_field = vocab // CTR_FIELDS
    out = []
    for _ in range(count):
        ranks = (rng.zipf(1.3, size=(batch, CTR_FIELDS)) - 1) % per_field
        out.append(
            {
                "ids": (ranks + np.arange(CTR_FIELDS) * per_field).astype(np.int64),
                "dense": rng.normal(size=(batch, CTR_DENSE)).astype(np.float32),
                "label": rng.integers(0, 2, (batch, 1)),
            }
        )
    return out


def fluidps_ctr(
    batch: int, steps: int, repeats: int, vocab: int = CTR_VOCAB, executors: Executors | None = None
) -> float:
    executors = executors or Executors(compiled=False)
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [CTR_FIELDS], dtype="int64")
        dense = layers.data("dense", [CTR_DENSE])
        label = layers.data("label", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [vocab, CTR_DIM], is_sparse=True)
        h = layers.concat([layers.reshape(emb, [-1, CTR_FIELDS * CTR_DIM]), dense], axis=1)
        h = layers.fc(layers.fc(h, 64, act="relu"), 32, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 2), label))
        optimizer.Adam(0.001, lazy_mode=True).minimize(loss)
    exe = executors.make()
    exe.run(startup)
    batches = ctr_batches(batch, vocab=vocab)
    executors.warm(exe, lambda e: e.run(main, feed=batches[0], fetch_list=[loss]))
    return batch * timed(
        lambda i: exe.run(main, feed=batches[i % 8], fetch_list=[loss]), steps, repeats, warmup=5
    )


# -- PyTorch ------------------------------------------------------------------------------


def torch_classifier(torch, sizes: list[int], batch: int, steps: int, repeats: int) -> float:
    nn = torch.nn
    layers_ = []
    for a, b in itertools.pairwise(sizes[:-1]):
        layers_ += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers_, nn.Linear(sizes[-2], sizes[-1]))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    rng = np.random.default_rng(0)
    batches = [
        (
            torch.from_numpy(rng.random((batch, sizes[0]), dtype=np.float32)),
            torch.from_numpy(rng.integers(0, sizes[-1], batch)),
        )
        for _ in range(8)
    ]

    def step(i: int) -> None:
        x, y = batches[i % 8]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()

    return timed(step, steps, repeats)


def torch_ctr(torch, batch: int, steps: int, repeats: int, vocab: int = CTR_VOCAB) -> float:
    nn = torch.nn
    emb = nn.Embedding(vocab, CTR_DIM, sparse=True)
    mlp = nn.Sequential(
        nn.Linear(CTR_FIELDS * CTR_DIM + CTR_DENSE, 64),
        nn.ReLU(),
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 2),
    )
    sparse_opt = torch.optim.SparseAdam(list(emb.parameters()), lr=0.001)
    dense_opt = torch.optim.Adam(mlp.parameters(), lr=0.001)
    batches = [
        {k: torch.from_numpy(v.reshape(-1) if k == "label" else v) for k, v in b.items()}
        for b in ctr_batches(batch, vocab=vocab)
    ]

    def step(i: int) -> None:
        b = batches[i % 8]
        sparse_opt.zero_grad()
        dense_opt.zero_grad()
        h = torch.cat([emb(b["ids"]).reshape(batch, -1), b["dense"]], dim=1)
        loss = torch.nn.functional.cross_entropy(mlp(h), b["label"])
        loss.backward()
        sparse_opt.step()
        dense_opt.step()
        loss.item()

    return batch * timed(step, steps, repeats, warmup=5)


def load_torch():
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(1)
    return torch


# -- driver -------------------------------------------------------------------------------


def row(workload: str, unit: str, ours: float, peers: dict[str, float], **extra) -> dict:
    out = {"workload": workload, **extra, "unit": unit, "fluidps": round(ours, 1)}
    for name, value in peers.items():
        out[name] = round(value, 1)
        out[f"fluidps_vs_{name}"] = round(ours / value, 3)
    out["threads"] = 1
    return out


# --executor: (compiled, fused) per row
_EXECUTORS = {
    "both": [(False, True), (True, True)],
    "interpreted": [(False, True)],
    "compiled": [(True, True)],
    "unfused": [(True, False)],
    "all": [(False, True), (True, False), (True, True)],
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ctr-batch", type=int, default=512)
    parser.add_argument("--ctr-steps", type=int, help="timed ctr steps (default: max(steps // 3, 30))")
    parser.add_argument("--ctr-vocab", type=int, default=CTR_VOCAB, help="rows of the ctr embedding")
    parser.add_argument("--no-torch", action="store_true", help="skip PyTorch even when importable")
    parser.add_argument("--no-paddle", action="store_true", help="skip PaddlePaddle even when importable")
    parser.add_argument("--sparse-table-rows", type=int, help="bench.sparse_update's --table-rows")
    parser.add_argument("--sparse-rows", type=int, help="bench.sparse_update's --rows")
    parser.add_argument("--sparse-repeats", type=int, help="bench.sparse_update's --repeats")
    parser.add_argument(
        "--executor",
        choices=list(_EXECUTORS),
        default="both",
        help="fluidps's executor: the interpreter, the compiler (fluidps.executor.compiler), the compiler "
        "without fusion (unfused), a row of the first two (both) or of each (all)",
    )
    args = parser.parse_args(argv)
    kinds = _EXECUTORS[args.executor]
    torch = None if args.no_torch else load_torch()
    paddle = None if args.no_paddle else paddle_peer.load_paddle()

    for name, sizes, batch in (
        ("digits_mlp", [64, 256, 256, 10], 64),
        ("digits_mlp", [64, 256, 256, 10], 128),
        ("tiny", [64, 10], 64),
    ):
        peers = {"torch": torch_classifier(torch, sizes, batch, args.steps, args.repeats)} if torch else {}
        if paddle:
            peers["paddle"] = timed(
                paddle_peer.classifier_step(paddle, sizes, batch), args.steps, args.repeats
            )
        for compiled, fuse in kinds:
            executors = Executors(compiled, fuse)
            try:
                ours = fluidps_classifier(sizes, batch, args.steps, args.repeats, executors)
            finally:
                executors.close()
            extra = {"model": "-".join(map(str, sizes)), "batch": batch, "optimizer": "sgd"}
            print(
                json.dumps(
                    row(
                        name,
                        "steps/s",
                        ours,
                        peers,
                        executor=executors.name,
                        **extra,
                        **executors.compile_times,
                    )
                )
            )

    ctr_steps = max(args.steps // 3, 30) if args.ctr_steps is None else args.ctr_steps
    peers = (
        {"torch": torch_ctr(torch, args.ctr_batch, ctr_steps, args.repeats, args.ctr_vocab)} if torch else {}
    )
    if paddle:
        batches = ctr_batches(args.ctr_batch, vocab=args.ctr_vocab)
        step = paddle_peer.ctr_step(paddle, batches, args.ctr_vocab, CTR_FIELDS, CTR_DIM, CTR_DENSE)
        peers["paddle"] = args.ctr_batch * timed(step, ctr_steps, args.repeats, warmup=5)
    for compiled, fuse in kinds:
        executors = Executors(compiled, fuse)
        try:
            ours = fluidps_ctr(args.ctr_batch, ctr_steps, args.repeats, args.ctr_vocab, executors)
        finally:
            executors.close()
        extra = {
            "table": f"{args.ctr_vocab}x{CTR_DIM}",
            "fields": CTR_FIELDS,
            "batch": args.ctr_batch,
            "optimizer": "lazy adam (torch: SparseAdam + Adam)",
        }
        row_ = row("ctr_embedding", "samples/s", ours, peers, executor=executors.name, **extra)
        print(json.dumps(row_ | executors.compile_times))
    sparse_argv = []
    for flag, value in (
        ("--table-rows", args.sparse_table_rows),
        ("--rows", args.sparse_rows),
        ("--repeats", args.sparse_repeats),
    ):
        if value is not None:
            sparse_argv += [flag, str(value)]
    sparse_update.main(sparse_argv)


if __name__ == "__main__":
    main()
