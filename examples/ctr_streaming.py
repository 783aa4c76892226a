"""Online click-through-rate training: a click log that never ends, a model that follows
it, and a server's view of each version as it is exported.

    python examples/ctr_streaming.py                 # 8 minutes of clicks, in seconds
    python examples/ctr_streaming.py --minutes 20

A producer thread appends a "minute" of clicks at a time to a segment log
(fluidps.io.StreamLog). Which ids are popular drifts from minute to minute, as it does
in a real click log, so a model frozen at some minute falls behind. The program reads
the log in windows (layers.stream_reader, follow=True), trains an `is_sparse`
embedding and a small MLP with lazy Adam, and after every minute of clicks exports a
version (fluidps.io.Exporter: a base, then deltas holding the rows that changed). A
fluidps.serving.Predictor picks each version up and is scored on the next minute's
clicks before it is trained on, which is what serving sees: AUC on unseen clicks, per
version. Once the producer is done and the reader has caught up, a watching thread
calls `exe.stop_streams()`: the waiting reader ends, and so does the loop.

The same program runs as a job with `fluidps launch --stream log:DIR --pservers 2
--trainers 2 --mode async` (docs/guides/streaming.md).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import fluidps
from fluidps import layers, optimizer

FIELDS = 4
VOCAB = 20_000
PER_FIELD = VOCAB // FIELDS
DIM = 8
MINUTE = 6_000  # clicks a minute


class ClickWorld:
    """Hidden per-id weights; each minute's popular ids shift (a drifting distribution)."""

    def __init__(self, seed: int = 7):
        rng = np.random.default_rng(seed)
        self.weight = rng.normal(0.0, 1.2, VOCAB).astype(np.float32)

    def minute(self, index: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(1000 + index)
        ranks = (rng.zipf(1.25, size=(MINUTE, FIELDS)) - 1 + 97 * index) % PER_FIELD  # drifting heads
        ids = (ranks + np.arange(FIELDS) * PER_FIELD).astype(np.int64)
        p = 1.0 / (1.0 + np.exp(-self.weight[ids].sum(axis=1)))
        return {"ids": ids, "click": (rng.random(MINUTE) < p).astype(np.int64).reshape(-1, 1)}


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positive = labels.reshape(-1) == 1
    n_pos, n_neg = positive.sum(), (~positive).sum()
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1))


def build(stream: str, batch_size: int):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [VOCAB, DIM], is_sparse=True)
        h = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 16, act="relu")
        prob = layers.softmax(layers.fc(h, 2))
        loss = layers.mean(layers.cross_entropy(prob, click))
        optimizer.Adam(0.01, lazy_mode=True).minimize(loss)
        layers.stream_reader(stream, [ids, click], batch_size, window_records=2048, window_seconds=0.5)
    return main, startup, prob, loss


def run(minutes: int = 8, batch_size: int = 128, workdir: str | None = None, verbose: bool = True) -> dict:
    """Train online on `minutes` minutes of clicks; per exported version, the served
    model's AUC on the next minute's clicks. Returns the rows printed."""
    root = Path(workdir or tempfile.mkdtemp(prefix="ctr-streaming-"))
    log = fluidps.io.StreamLog(root / "clicks")
    world = ClickWorld()
    main, startup, prob, loss = build(f"log:{log.path}", batch_size)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = fluidps.io.Exporter(root / "exports", ["ids"], [prob], main, base_every=5)
    produced = threading.Event()

    def produce() -> None:
        for index in range(minutes):
            log.append(world.minute(index))
            time.sleep(0.05)
        produced.set()

    rows: list[dict] = []
    predictor = None
    exporter.export(scope)  # version 1: the untrained model

    def stop_when_caught_up() -> None:
        """Once every click produced is trained on, drain the reader: its next read ends the loop."""
        produced.wait()
        while log.committed("trainers") < log.end_offset():
            time.sleep(0.05)
        exe.stop_streams()

    producer = threading.Thread(target=produce, daemon=True)
    watcher = threading.Thread(target=stop_when_caught_up, daemon=True)
    producer.start()
    watcher.start()
    trained, steps = 0, 0
    while True:
        try:
            exe.run(main, fetch_list=[loss], scope=scope)
        except fluidps.EOFException:
            break
        steps += 1
        trained = log.committed("trainers")  # (records whose windows are done)
        if trained >= (len(rows) + 1) * MINUTE:  # a minute trained on: export, and serve it
            version = exporter.export(scope)
            predictor = predictor or fluidps.serving.Predictor(root / "exports")
            predictor.refresh()
            upcoming = world.minute(len(rows) + 1)  # the clicks after the ones it trained on
            scores = predictor.predict({"ids": upcoming["ids"]})[prob.name][:, 1]
            manifest = fluidps.io.exports.read_manifest(root / "exports", version)
            size = sum(v["bytes"] for v in manifest["vars"].values())
            row = {"version": version, "kind": manifest["kind"], "bytes": size, "records": trained}
            rows.append({**row, "next_minute_auc": round(auc(scores, upcoming["click"]), 4)})
            if verbose:
                r = rows[-1]
                print(f"version {r['version']} ({r['kind']}, {r['bytes'] / 1024:,.0f} KiB) after "
                      f"{r['records']:,} clicks: AUC on the next minute's clicks {r['next_minute_auc']:.3f}")  # fmt: skip
    exporter.export(scope)
    producer.join(timeout=60)
    watcher.join(timeout=60)
    return {"rows": rows, "steps": steps, "records": log.committed("trainers"), "dir": str(root)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--dir", help="where the log and the exports go (default: a temporary directory)")
    args = parser.parse_args()
    result = run(args.minutes, args.batch_size, args.dir)
    print(f"trained on {result['records']:,} clicks in {result['steps']:,} steps; exports in {result['dir']}")


if __name__ == "__main__":
    main()
