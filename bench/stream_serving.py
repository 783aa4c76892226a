"""bench.streaming's rows about serving: "freshness", "delta" and "swaps" (their
measurements are described in bench/streaming.py's docstring)."""

from __future__ import annotations

import itertools
import multiprocessing
import statistics
import threading
import time
from pathlib import Path

import numpy as np

import fluidps
from bench.stream_workload import DIM, FIELDS, GROUP, WARM_STEPS, clicks, ctr_program, manifest_bytes
from fluidps import layers
from fluidps.io import Exporter, StreamLog
from fluidps.io.exports import latest_version, read_manifest, stream_offsets

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
