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
import itertools  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from fluidps import layers, optimizer  # noqa: E402
from fluidps.errors import EOFException  # noqa: E402
from fluidps.io import Dataset, Exporter, StreamLog  # noqa: E402
from fluidps.io.exports import latest_version, read_manifest, stream_offsets  # noqa: E402

ROWS = ("log", "throughput", "freshness", "delta", "swaps", "memory")
FIELDS, VOCAB, DIM, MINUTE = 4, 20_000, 8, 6_000  # examples/ctr_streaming.py's
GROUP = "trainers"
WARM_STEPS = 3  # untimed steps before a throughput run is timed (the second one compiles)
MIB = 1 << 20


def per_second(count: int, seconds: float) -> int:
    return round(count / seconds) if seconds > 0 else 0


# -- the records and the model -----------------------------------------------------------------


def records(count: int) -> dict[str, np.ndarray]:
    """The "log" row's CTR-like records."""
    rng = np.random.default_rng(0)
    return {
        "ids": rng.integers(0, 1 << 40, (count, 2), dtype=np.int64),
        "dense": rng.random((count, 13), dtype=np.float32),
        "label": rng.integers(0, 2, count, dtype=np.int64),
    }


def clicks(count: int, first: int = 0, vocab: int = VOCAB, seed: int = 7) -> dict[str, np.ndarray]:
    """Clicks `first` .. `first + count - 1` of examples/ctr_streaming.py's drifting world
    (the heads of the Zipf ranks shift by 97 every MINUTE clicks; clicks from hidden
    per-id weights): the same clicks whatever the chunks they are asked for in."""
    weight = np.random.default_rng(seed).normal(0.0, 1.2, vocab).astype(np.float32)
    per_field = vocab // FIELDS
    out_ids, out_click = [], []
    position = first
    while position < first + count:
        minute, into = divmod(position, MINUTE)
        take = min(MINUTE - into, first + count - position)
        rng = np.random.default_rng(1000 + minute)
        ranks = (rng.zipf(1.25, size=(MINUTE, FIELDS)) - 1 + 97 * minute) % per_field
        ids = (ranks + np.arange(FIELDS) * per_field).astype(np.int64)
        p = 1.0 / (1.0 + np.exp(-weight[ids].sum(axis=1)))
        click = (rng.random(MINUTE) < p).astype(np.int64).reshape(-1, 1)
        out_ids.append(ids[into : into + take])
        out_click.append(click[into : into + take])
        position += take
    return {"ids": np.concatenate(out_ids), "click": np.concatenate(out_click)}


def ctr_program(bind=None, vocab: int = VOCAB):
    """examples/ctr_streaming.py's model: (main, startup, test program, prob, loss).
    `bind(ids, click)` adds a reader (the test program is cloned before it)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [vocab, DIM], is_sparse=True)
        h = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 16, act="relu")
        prob = layers.softmax(layers.fc(h, 2))
        loss = layers.mean(layers.cross_entropy(prob, click))
        test = main.clone(for_test=True)
        optimizer.Adam(0.01, lazy_mode=True).minimize(loss)
        if bind is not None:
            bind(ids, click)
    return main, startup, test, prob, loss


def manifest_bytes(directory: Path, version: int) -> int:
    return sum(v["bytes"] for v in read_manifest(directory, version)["vars"].values())


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


# -- "freshness" --------------------------------------------------------------------------------


def _write_clicks(path: str, rate: int, seconds: float, first: int, started) -> None:
    """The writer process: `rate` clicks a second into the log at `path` for `seconds`,
    an append every 10 ms (as many as are due by then: it catches up after a pause)."""
    log = StreamLog(path)
    data = clicks(int(rate * seconds) + rate, first)
    total, written = int(rate * seconds), 0
    started.set()
    start = time.monotonic()
    while written < total:
        due = min(total, int((time.monotonic() - start) * rate))
        if due > written:
            log.append({k: v[written:due] for k, v in data.items()})
            written = due
        time.sleep(max(0.0, start + (written + rate / 100) / rate - time.monotonic()))


def _serve_versions(directory: str, poll_s: float, ready, stop, out) -> None:
    """The serving process: a Predictor polling `directory`; (version, time swapped in)
    for each version it served, to `out` once `stop` is set."""
    from fluidps.serving import Predictor

    predictor = Predictor(directory)
    probe = {"ids": clicks(64, 10**9)["ids"]}
    predictor.predict(probe)  # (compiles the inference program)
    served = [(predictor.version, time.time())]
    ready.set()
    while not stop.is_set():
        if predictor.refresh():
            served.append((predictor.version, time.time()))
        else:
            time.sleep(poll_s)
    out.put({"served": served, "last_error": predictor.last_error})


def freshness_row(folder: Path, rate: int, seconds: float, batch: int) -> dict:
    log = StreamLog(folder / "fresh-log")
    spec = f"log:{log.path}"
    exports = folder / "fresh-exports"

    def bind(ids, click):
        layers.stream_reader(spec, [ids, click], batch, window_records=1 << 30, window_seconds=1.0)

    log.append(clicks(rate))  # the warm-up window (the compiles): not counted
    main, startup, _, prob, loss = ctr_program(bind)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(exports, ["ids"], [prob], main, base_every=10)
    exported: dict[int, tuple[int, float, float]] = {}  # version -> (offset, committed seen, exported)

    def export(committed: int, seen: float) -> None:
        version = exporter.export(scope, offsets={spec: committed})
        exported[version] = (committed, seen, time.time())

    def train_until(offset: int, deadline: float) -> int:
        """Train until the committed offset reaches `offset`, exporting after each window."""
        steps, last = 0, log.committed(GROUP)
        while last < offset and time.monotonic() < deadline:
            exe.run(main, fetch_list=[loss], scope=scope)  # (waits for a window when none is ready)
            steps += 1
            committed = log.committed(GROUP)
            if committed > last:  # (a run whose batch was a window's last returns with it committed)
                export(committed, time.time())
                last = committed
        return steps

    export(0, time.time())  # version 1: the untrained model
    train_until(rate, time.monotonic() + 120)
    counted_from = log.committed(GROUP)

    context = multiprocessing.get_context("spawn")
    ready, stop, started, out = context.Event(), context.Event(), context.Event(), context.Queue()
    server = context.Process(target=_serve_versions, args=(str(exports), 0.01, ready, stop, out), daemon=True)
    server.start()
    if not ready.wait(120):
        raise RuntimeError("the serving process did not start")
    writer = context.Process(
        target=_write_clicks, args=(str(log.path), rate, seconds, counted_from, started), daemon=True
    )
    writer.start()
    started.wait(120)
    total = counted_from + int(rate * seconds)
    steps = train_until(total, time.monotonic() + seconds + 120)
    writer.join(60)
    last_version = max(exported)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # (until the server has the last version, or gives up)
        if latest_version(exports) == last_version:
            break
        time.sleep(0.01)
    time.sleep(0.5)  # (a few of its polls: it swaps the last version in)
    stop.set()
    result = out.get(timeout=60)
    server.join(60)
    exe.close()

    # Every event's stamp, and the first served version whose committed offset passed it.
    offsets, stamps = [], []
    at = counted_from
    while at < total:
        got = log.read(at, 65536)
        offsets.append(got.offsets)
        stamps.append(got.timestamps)
        at = got.next_offset
    offsets_all, stamps_all = np.concatenate(offsets), np.concatenate(stamps)
    served = sorted(result["served"])
    for version, (offset, _, _) in exported.items():  # (what the manifests kept: the versions not released)
        assert not _exists(exports, version) or stream_offsets(exports, version) == {spec: offset}
    covered = np.array([exported[v][0] for v, _ in served])
    swapped = np.array([t for _, t in served])
    first = np.searchsorted(covered, offsets_all, side="right")  # the first served version with offset > o
    reached = first < len(served)
    swap_at = swapped[first[reached]]
    latency = swap_at - stamps_all[reached]
    versions = np.array([v for v, _ in served])[first[reached]]
    seen = np.array([exported[v][1] for v in versions])  # the commit seen
    written = np.array([exported[v][2] for v in versions])  # the version written
    parts = {
        "append_to_committed_s": seen - stamps_all[reached],
        "committed_to_exported_s": written - seen,
        "exported_to_served_s": swap_at - written,
    }
    p50, p95 = np.percentile(latency, [50, 95]) if len(latency) else (float("nan"), float("nan"))
    kept = [read_manifest(exports, v) for v in sorted(exported) if _exists(exports, v)]
    sizes = {kind: [sum(e["bytes"] for e in m["vars"].values()) for m in kept if m["kind"] == kind]
             for kind in ("base", "delta")}  # fmt: skip
    return {
        "bench": "streaming",
        "row": "freshness",
        "rate_per_s": rate,
        "seconds": seconds,
        "window_seconds": 1.0,
        "batch": batch,
        "events": len(offsets_all),
        "events_written_per_s": round(len(offsets_all) / max(stamps_all[-1] - stamps_all[0], 1e-9)),
        "events_served": int(reached.sum()),
        "p50_s": round(float(p50), 3),
        "p95_s": round(float(p95), 3),
        "max_s": round(float(latency.max()), 3) if len(latency) else None,
        **{f"median_{k}": round(float(np.median(v)), 3) for k, v in parts.items() if len(v)},
        "versions_exported": len(exported),
        "versions_served": len(served),
        "train_steps": steps,
        "base_bytes": sizes["base"][-1] if sizes["base"] else None,
        "median_delta_bytes": round(statistics.median(sizes["delta"])) if sizes["delta"] else None,
        "server_last_error": result["last_error"],
    }


def _exists(directory: Path, version: int) -> bool:
    return (directory / "versions" / f"{version:08d}").is_dir()


# -- "delta" ------------------------------------------------------------------------------------


def delta_row(folder: Path, vocab: int, batch: int) -> dict:
    main, startup, _, prob, loss = ctr_program(vocab=vocab)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(folder / "delta-exports", ["ids"], [prob], main)
    base = exporter.export(scope)
    (table,) = [n for n in exporter.names if n.startswith("embedding")]
    before = np.array(scope.find(table))
    rng = np.random.default_rng(5)
    touched = rng.choice(vocab, size=max(FIELDS, vocab // 100 // FIELDS * FIELDS), replace=False)
    ids = rng.permutation(touched).astype(np.int64).reshape(-1, FIELDS)  # each id once
    for first in range(0, len(ids), batch):
        part = ids[first : first + batch]
        exe.run(main, feed={"ids": part, "click": (part[:, :1] % 2)}, fetch_list=[loss], scope=scope)
    delta = exporter.export(scope)
    after = np.asarray(scope.find(table))
    changed = int(np.any(after != before, axis=1).sum())
    manifest = read_manifest(folder / "delta-exports", delta)
    base_bytes, delta_bytes = (
        manifest_bytes(folder / "delta-exports", base),
        manifest_bytes(folder / "delta-exports", delta),
    )
    return {
        "bench": "streaming",
        "row": "delta",
        "table": f"{vocab}x{DIM}",
        "ids_trained": len(touched),
        "ids_trained_fraction": round(len(touched) / vocab, 4),
        "rows_changed": changed,
        "kind": manifest["kind"],
        "base_bytes": base_bytes,
        "delta_bytes": delta_bytes,
        "delta_over_base": round(delta_bytes / base_bytes, 4),
        "vars": {n: [e["encoding"], e["bytes"]] for n, e in sorted(manifest["vars"].items())},
    }


# -- "swaps" ------------------------------------------------------------------------------------


def swaps_row(folder: Path, predictions: int, threads: int = 4, rows: int = 64) -> dict:
    from fluidps.serving import Predictor

    main, startup, test, prob, loss = ctr_program()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    directory = folder / "swap-exports"
    exporter = Exporter(directory, ["ids"], [prob], main, base_every=10)
    probe = {"ids": clicks(rows, 10**9)["ids"]}
    scored = {**probe, "click": np.zeros((rows, 1), np.int64)}  # (the test program computes the loss too)
    want: dict[int, np.ndarray] = {}
    want[exporter.export(scope)] = exe.run(test, feed=scored, fetch_list=[prob], scope=scope)[0]
    predictor = Predictor(directory)
    predictor.predict(probe)  # (its first run compiles)
    done = threading.Event()
    lock = threading.Lock()
    asked = [0]
    answers: list[list[tuple[int, np.ndarray]]] = [[] for _ in range(threads)]
    errors: list[str] = []
    refused: list[str] = []
    swapped = [0]

    step, kinds = [0], ["base"]

    def train_and_export() -> None:
        exe.run(main, feed=clicks(128, step[0] * 128), fetch_list=[loss], scope=scope)
        version = exporter.export(scope)
        want[version] = exe.run(test, feed=scored, fetch_list=[prob], scope=scope)[0]
        kinds.append(read_manifest(directory, version)["kind"])
        step[0] += 1

    def export_until_done() -> None:
        while not done.is_set():
            train_and_export()

    for _ in range(WARM_STEPS):  # (the first steps compile: before the predictions start)
        train_and_export()

    def refresh() -> None:
        while not done.is_set():
            if predictor.refresh():
                swapped[0] += 1
            elif predictor.last_error and (not refused or refused[-1] != predictor.last_error):
                refused.append(predictor.last_error)
            time.sleep(0.005)

    def ask(mine: list) -> None:
        while True:
            with lock:
                if asked[0] >= predictions:
                    return
                asked[0] += 1
            try:
                version, outputs = predictor.predict_version(probe)
                mine.append((version, outputs[prob.name]))
            except Exception as e:  # (counted: the row's errors)
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")

    failed: list[str] = []  # (the exporter's or the refresher's thread ended by an error)

    def helper(work) -> None:
        try:
            work()
        except Exception as e:
            failed.append(f"{work.__name__}: {type(e).__name__}: {e}")

    helpers = [threading.Thread(target=helper, args=(work,)) for work in (export_until_done, refresh)]
    askers = [threading.Thread(target=ask, args=(answers[i],)) for i in range(threads)]
    for t in helpers + askers:
        t.start()
    for t in askers:
        t.join()
    done.set()
    for t in helpers:
        t.join()
    exe.close()
    flat = [a for mine in answers for a in mine]
    mismatched = sum(1 for v, out in flat if v not in want or not np.array_equal(out, want[v]))
    backwards = sum(1 for mine in answers for (a, _), (b, _) in itertools.pairwise(mine) if b < a)
    return {
        "bench": "streaming",
        "row": "swaps",
        "predictions": len(flat) + len(errors),
        "threads": threads,
        "rows_per_prediction": rows,
        "errors": len(errors),
        "first_errors": errors[:3],
        "mismatched": mismatched,
        "backwards": backwards,
        "versions_exported": len(want),
        "bases_exported": kinds.count("base"),
        "swaps": swapped[0],
        "helper_errors": failed,
        "versions_answered": len({v for v, _ in flat}),
        "refreshes_refused": len(refused),
        "first_refusals": refused[:3],
    }


# -- "memory" -----------------------------------------------------------------------------------


def drifting_ids(step: int, batch: int, drift: int, seed: int = 11) -> np.ndarray:
    """One step's ids, [batch, FIELDS, 1]: per field, Zipf ranks counted back from a head
    that moves `drift` values a step (a value is hot when it appears, then cools off and
    is not seen again), mixed into 62-bit ids."""
    rng = np.random.default_rng((seed, step))
    ranks = np.minimum(rng.zipf(1.2, size=(batch, FIELDS)), 1 << 20) - 1
    values = (step * drift - ranks).astype(np.uint64) * np.uint64(FIELDS) + np.arange(FIELDS, dtype=np.uint64)
    x = values * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(2)).astype(np.int64).reshape(batch, FIELDS, 1)


def hashed_ctr_program(ttl_steps: int, shrink_every: int):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS, 1], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.sparse_embedding(
            ids, [-1, DIM], min_count=2, ttl_steps=ttl_steps, shrink_every=shrink_every
        )
        h = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 16, act="relu")
        prob = layers.softmax(layers.fc(h, 2))
        loss = layers.mean(layers.cross_entropy(prob, click))
        optimizer.Adam(0.01, lazy_mode=True).minimize(loss)
    return main, startup, loss


def memory_row(
    events: int, batch: int, ttl_steps: int, shrink_every: int, drift: int, samples: int = 20
) -> dict:
    from fluidps.executor.ps.gradients import ROWS_LIMIT

    main, startup, loss = hashed_ctr_program(ttl_steps, shrink_every)
    steps = max(1, events // batch)
    warm_steps = max(steps // 5, 2 * (ttl_steps + shrink_every))
    every = max(1, steps // samples)
    rng = np.random.default_rng(12)
    timeline: list[dict] = []

    def feeds(first: int, last: int):
        for step in range(first, last):
            ids = drifting_ids(step, batch, drift)
            click = (rng.random((batch, 1)) < 0.2).astype(np.int64)
            yield {"ids": ids, "click": click}

    began = time.perf_counter()
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=1)) as exe:
        exe.run(startup)
        setup_s = time.perf_counter() - began
        done, training_s = 0, 0.0
        while done < steps:
            upto = min(steps, done + every)
            start = time.perf_counter()
            for _ in exe.run_batches(main, feeds(done, upto), [loss]):
                pass
            training_s += time.perf_counter() - start
            done = upto
            (stats,) = exe.pserver_stats().values()
            (table,) = stats["hashed_tables"].values()
            # The row ids the pserver keeps of each sparse gradient for its stats (up to
            # ROWS_LIMIT each: fluidps.executor.ps.gradients.RowLog), 8 bytes an id.
            row_log = sum(min(n, ROWS_LIMIT) for n in stats["received_row_counts"].values()) * 8
            timeline.append(
                {
                    "events": done * batch,
                    "rows": table["rows"],
                    "created": table["created"],
                    "evicted": table["evicted"],
                    "pending_ids": table["pending_ids"],
                    "table_mib": round(table["bytes"] / MIB, 2),
                    "row_log_mib": round(row_log / MIB, 2),
                    "rss_mib": round(stats["rss_bytes"] / MIB, 1),
                }
            )
    after = [t for t in timeline if t["events"] >= warm_steps * batch] or timeline[-1:]
    warm, end = after[0], timeline[-1]
    peak = max(after, key=lambda t: t["rss_mib"])
    less_log = max(t["rss_mib"] - t["row_log_mib"] for t in after)
    return {
        "bench": "streaming",
        "row": "memory",
        "pserver": "a fluidps serve process (RemoteExecutor: 1 trainer x 1 pserver, sync)",
        "events": steps * batch,
        "batch": batch,
        "table": {"dim": DIM, "min_count": 2, "ttl_steps": ttl_steps, "shrink_every": shrink_every},
        "drift_per_step": drift,
        "warmup_events": warm_steps * batch,
        "rss_warm_mib": warm["rss_mib"],
        "rss_end_mib": end["rss_mib"],
        "rss_max_mib": peak["rss_mib"],
        "rss_growth_after_warmup": round((peak["rss_mib"] - warm["rss_mib"]) / warm["rss_mib"], 4),
        "row_log_growth_mib": round(end["row_log_mib"] - warm["row_log_mib"], 2),
        "rss_growth_less_row_log": round(
            (less_log - (warm["rss_mib"] - warm["row_log_mib"])) / warm["rss_mib"], 4
        ),
        "rows_warm": warm["rows"],
        "rows_end": end["rows"],
        "rows_max_after_warmup": max(t["rows"] for t in after),
        "rows_bound": (ttl_steps + shrink_every) * batch * FIELDS,
        "created": end["created"],
        "evicted": end["evicted"],
        "setup_s": round(setup_s, 2),
        "events_per_s": round(steps * batch / training_s),
        "timeline": timeline,
    }


# -- driver -------------------------------------------------------------------------------------


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
