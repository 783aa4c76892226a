"""Streams: what the segment log costs, what training from it costs, how fresh the served
model is, what a delta weighs, what serving during swaps does, and a pserver's memory
under an endless, drifting id stream; one JSON row each.

    python -m bench.streaming [--rows log,throughput,freshness,delta,swaps,memory] [--quick]
                              [--records 1000000] [--batch 4096]
                              [--train-records 1000000] [--train-batch 128] [--window-records 16384]
                              [--rounds 3] [--rate 1000] [--fresh-seconds 60] [--delta-vocab 1000000]
                              [--predictions 10000] [--memory-events 2000000] [--memory-batch 1000]
                              [--ttl-steps 100] [--shrink-every 20] [--drift 4]

A few minutes on two cores (the freshness row alone runs `--fresh-seconds`); `--quick`
runs every row small, in about 20 seconds (a smoke run: tests/unit/test_bench.py). The
model is examples/ctr_streaming.py's (4 fields of ids into a 20,000 x 8 `is_sparse`
embedding, fc 16 relu, a 2-way softmax, lazy Adam 0.01) on its drifting clicks (Zipf
ranks whose heads shift every 6,000 clicks), built here so each row can bind it to its
own reader. The rows, in this order:

- "log": CTR-like records (two int64 ids, 13 float32 features, an int64 label) appended
  to a fluidps.io.StreamLog in batches of `--batch` (fsync each, and not), then read back
  with every record's CRC checked, next to the same records read from a Parquet dataset
  (fluidps.io.Dataset, with pyarrow) and from .npz shards in tasks of the same size:
  records a second each way.
- "throughput" (goal: stream_over_parquet >= 0.8): the model trained on
  `--train-records` clicks from a StreamLog (layers.stream_reader, a local Executor,
  follow=False, windows of `--window-records`, each committed as it is done) and on the
  same clicks from a Parquet dataset (layers.dataset_reader, tasks of `--window-records`,
  shuffle=False: the same batches in the same order), batch `--train-batch`: events
  trained a second after the first 3 steps (the second compiles), the median of
  `--rounds` rounds that alternate which goes first, and stream / parquet. The same
  batches give the same last loss (same_loss).
- "freshness" (goal: p95_s <= 2): a writer process appends `--rate` clicks a second (an
  append every 10 ms, paced by its clock) for `--fresh-seconds`; the trainer (this
  process) reads them with stream_reader(window_seconds=1, follow=True) and after each
  window exports a version (fluidps.io.Exporter: a delta, a base every 10) with the
  stream's committed offset in its manifest (`export(scope, offsets={stream:
  committed})`); a Predictor in another process calls `refresh()` every 10 ms and notes
  the time each version is swapped in. A version *includes* the event at offset o when
  o < the committed offset its manifest records (fluidps.io.exports.stream_offsets): the
  group's offset is read after the window's commit, and a window is committed once the
  step that used its last batch has run, before the values are read for the export. An
  event's freshness is the time from its append (the time StreamLog stamps it with, as
  the append starts) to the swap of the first served version that includes it: p50,
  p95 and max over every event the writer appended, and the medians of its parts:
  append -> commit seen (the window's wait and its training), commit -> version written,
  written -> swapped in. The loop is a user's: `exe.run` waits for a window when none is
  ready, and a run whose batch was a window's last returns with the window committed, so
  the loop exports right after it. A first window of `--rate` clicks, before the writer starts, takes the
  compiles; it is not counted. versions_served counts the one the server started on.
- "delta" (goal: delta_over_base <= 0.03): the model with a `--delta-vocab`-row table
  exported (a base), trained on 1% of the table's ids (each once; lazy Adam changes only
  their rows), exported again (a delta): the delta's bytes over the base's (the files,
  as the manifests count them), the rows that changed, and each variable's encoding and
  bytes in the delta.
- "swaps" (goal: errors = mismatched = backwards = 0): a Predictor answering
  `--predictions` predictions (64 rows each) from 4 threads, while an exporter thread
  trains a step and exports a version (a delta, a base every 10, older chains released),
  again and again, and a thread calls `refresh()` every 5 ms: predictions that raised
  (errors), answers whose outputs are not what the exporter's own scope gave for that
  version (mismatched: half of a delta, or another version's values), and answers on an
  older version than the same thread's answer before (backwards); versions exported (and
  bases), swaps, and refreshes refused.
- "memory" (goal: rss_growth_after_warmup <= 0.1): `--memory-events` drifting clicks (4
  fields of 62-bit ids; per field, Zipf ranks counted back from a head that moves
  `--drift` values a step, so every id is hot when it appears, then cools off and is not
  seen again) trained by a RemoteExecutor job of 1 trainer and 1 pserver, each a
  `fluidps serve` process, over a hashed table (layers.sparse_embedding: min_count=2,
  `--ttl-steps`, a shrink every `--shrink-every` steps; lazy Adam), `--memory-batch`
  clicks a step: the pserver's RSS (its pserver_stats) after the warm-up (the first fifth
  of the steps, at least two TTLs), at the end and at its largest after the warm-up, the
  growth (max - warm) / warm, and the same less the row ids the pserver keeps of every
  sparse gradient for its stats (fluidps.executor.ps.gradients.RowLog, 8 bytes an id up
  to ROWS_LIMIT ids: it grows until then); its table's rows (bounded by rows_bound, the
  ids of ttl_steps + shrink_every steps), created and evicted, 20 times over the run.
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
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from bench.stream_memory import memory_row  # noqa: E402
from bench.stream_serving import delta_row, freshness_row, swaps_row  # noqa: E402
from bench.stream_workload import WARM_STEPS, clicks, ctr_program, per_second, records  # noqa: E402
from fluidps import layers  # noqa: E402
from fluidps.errors import EOFException  # noqa: E402
from fluidps.io import Dataset, StreamLog  # noqa: E402

ROWS = ("log", "throughput", "freshness", "delta", "swaps", "memory")


# -- "log" --------------------------------------------------------------------------------------


def log_row(folder: Path, data: dict[str, np.ndarray], batch: int) -> dict:
    count = len(data["label"])
    row: dict = {"bench": "streaming", "row": "log", "records": count, "batch": batch}
    for sync in (True, False):
        log = StreamLog(folder / f"log-{sync}", sync=sync)
        start = time.perf_counter()
        for first in range(0, count, batch):
            log.append({name: a[first : first + batch] for name, a in data.items()})
        row[f"append_{'fsync' if sync else 'no_fsync'}_per_s"] = per_second(
            count, time.perf_counter() - start
        )
    start, offset, seen = time.perf_counter(), 0, 0
    while offset < count:
        got = log.read(offset, batch)
        assert not got.bad
        seen, offset = seen + len(got), got.next_offset
    row["read_per_s"] = per_second(seen, time.perf_counter() - start)
    row["bytes_per_record"] = round(log.total_bytes() / count, 1)
    for fmt in ("parquet", "npz"):
        dataset = Dataset.write(folder / fmt, data, records_per_shard=max(batch * 16, 1), format=fmt)
        start, seen = time.perf_counter(), 0
        for task in dataset.tasks(batch):
            seen += len(dataset.read_task(task)["label"])
        row[f"{fmt}_read_per_s"] = per_second(seen, time.perf_counter() - start)
    row["log_read_over_parquet"] = round(row["read_per_s"] / row["parquet_read_per_s"], 3)
    return row


# -- "throughput" -------------------------------------------------------------------------------


def train_from(kind: str, source: str, batch: int, window: int, group: str) -> tuple[float, int, float]:
    """Train the model once through `source` (a log's directory or a Parquet dataset's):
    (seconds after the first WARM_STEPS steps, events after them, the last step's loss)."""

    def bind(ids, click):
        if kind == "stream":
            layers.stream_reader(
                f"log:{source}", [ids, click], batch, group=group, window_records=window, follow=False
            )
        else:
            layers.dataset_reader(source, [ids, click], batch, records_per_task=window, shuffle=False)

    main, startup, _, _, loss = ctr_program(bind)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    for _ in range(WARM_STEPS):  # (the first steps compile: untimed)
        exe.run(main, fetch_list=[loss], scope=scope)
    events, value = 0, float("nan")
    start = time.perf_counter()
    while True:
        try:
            (out,) = exe.run(main, fetch_list=[loss], scope=scope)
        except EOFException:
            break
        events += batch  # (the last batch may be short: counted below)
        value = float(np.asarray(out).reshape(-1)[0])
    seconds = time.perf_counter() - start
    exe.close()
    return seconds, events, value


def throughput_row(folder: Path, count: int, batch: int, window: int, rounds: int) -> dict:
    data = clicks(count)
    log = StreamLog(folder / "train-log", sync=False)
    for first in range(0, count, 65536):
        log.append({k: v[first : first + 65536] for k, v in data.items()})
    parquet = folder / "train-parquet"
    Dataset.write(parquet, data, records_per_shard=65536, format="parquet")
    rates: dict[str, list[float]] = {"stream": [], "parquet": []}
    losses: dict[str, float] = {}
    timed = count - WARM_STEPS * batch  # (every step after the first ones)
    for index in range(rounds):
        for kind in ("stream", "parquet") if index % 2 == 0 else ("parquet", "stream"):
            where = str(log.path) if kind == "stream" else str(parquet)
            seconds, events, losses[kind] = train_from(kind, where, batch, window, f"round{index}")
            assert timed <= events < timed + batch, (kind, events, timed)
            rates[kind].append(timed / seconds)
    stream, table = statistics.median(rates["stream"]), statistics.median(rates["parquet"])
    return {
        "bench": "streaming",
        "row": "throughput",
        "records": count,
        "batch": batch,
        "window_records": window,
        "rounds": rounds,
        "stream_events_per_s": round(stream),
        "parquet_events_per_s": round(table),
        "stream_over_parquet": round(stream / table, 3),
        "stream_rounds": [round(r) for r in rates["stream"]],
        "parquet_rounds": [round(r) for r in rates["parquet"]],
        "last_loss": {k: round(v, 6) for k, v in losses.items()},
        "same_loss": losses["stream"] == losses["parquet"],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows, of {', '.join(ROWS)}")
    parser.add_argument("--records", type=int, default=1_000_000, help="the log row's records")
    parser.add_argument("--batch", type=int, default=4096, help="the log row's appends and reads")
    parser.add_argument("--train-records", type=int, default=1_000_000)
    parser.add_argument("--train-batch", type=int, default=128)
    parser.add_argument(
        "--window-records", type=int, default=16_384, help="a window, and a task, of the throughput row"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", type=int, default=1000, help="clicks a second in the freshness row")
    parser.add_argument("--fresh-seconds", type=float, default=60.0)
    parser.add_argument("--delta-vocab", type=int, default=1_000_000)
    parser.add_argument("--predictions", type=int, default=10_000)
    parser.add_argument("--memory-events", type=int, default=2_000_000)
    parser.add_argument("--memory-batch", type=int, default=1000)
    parser.add_argument("--ttl-steps", type=int, default=100)
    parser.add_argument("--shrink-every", type=int, default=20)
    parser.add_argument(
        "--drift", type=int, default=4, help="values a field's head moves a step (memory row)"
    )
    parser.add_argument("--quick", action="store_true", help="every row small (a smoke run)")
    args = parser.parse_args(argv)
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        parser.error(f"unknown rows {unknown}; rows: {', '.join(ROWS)}")
    if args.quick:
        args.records, args.train_records, args.window_records, args.rounds = 20_000, 20_000, 4096, 1
        args.fresh_seconds, args.delta_vocab, args.predictions = 5.0, 20_000, 2000
        args.memory_events, args.memory_batch, args.ttl_steps, args.shrink_every = 60_000, 500, 20, 5
    with tempfile.TemporaryDirectory(prefix="bench-streaming-") as name:
        folder = Path(name)
        for which in wanted:
            if which == "log":
                row = log_row(folder, records(args.records), args.batch)
            elif which == "throughput":
                row = throughput_row(
                    folder, args.train_records, args.train_batch, args.window_records, args.rounds
                )
            elif which == "freshness":
                row = freshness_row(folder, args.rate, args.fresh_seconds, args.train_batch)
            elif which == "delta":
                row = delta_row(folder, args.delta_vocab, args.train_batch)
            elif which == "swaps":
                row = swaps_row(folder, args.predictions)
            else:
                row = memory_row(
                    args.memory_events, args.memory_batch, args.ttl_steps, args.shrink_every, args.drift
                )
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
