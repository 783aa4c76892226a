"""bench.streaming's workload: examples/ctr_streaming.py's drifting clicks and model, and
the helpers its rows share."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import fluidps
from fluidps import layers, optimizer
from fluidps.io.exports import read_manifest

FIELDS, VOCAB, DIM, MINUTE = 4, 20_000, 8, 6_000  # examples/ctr_streaming.py's
GROUP = "trainers"
WARM_STEPS = 3  # untimed steps before a run is timed (the second one compiles)
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
