"""A small click-through model with an embedding table: what the export and serving tests
train, export and serve."""

from __future__ import annotations

import numpy as np

import fluidps
from fluidps import layers

ROWS, DIM = 1000, 8


def ctr_model():
    """An embedding table, then a small MLP: (main, startup, test program, ids, click, prob, loss)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [2], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [ROWS, DIM], is_sparse=True)
        h = layers.fc(layers.reshape(emb, [-1, 2 * DIM]), 16, act="relu")
        prob = layers.softmax(layers.fc(h, 2))
        loss = layers.mean(layers.cross_entropy(prob, click))
        test = main.clone(for_test=True)
        fluidps.optimizer.SGD(0.5).minimize(loss)
    return main, startup, test, prob, loss


def batch(seed: int, n: int = 64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50, size=(n, 2)).astype(np.int64)  # 50 of the 1,000 rows: sparse updates
    return {"ids": ids, "click": (ids.sum(1, keepdims=True) % 2).astype(np.int64)}
