"""The models, batches and helpers the RemoteExecutor job tests share (test_remote_executor.py,
test_run_batches.py): a seeded MLP and a sparse model, each with its batches."""

from __future__ import annotations

import numpy as np

import fluidps
from fluidps import layers, optimizer

# Small slices, so that even these small models are cut across both pservers.
SLICED = fluidps.DistributeTranspilerConfig(min_block_size=64)


def mlp() -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable, fluidps.Program, fluidps.Variable]:
    """(main, startup, loss, test program, logits) of a seeded MLP trained with Adam."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 7  # before any initializer is added: each takes its seed from it
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [64])
        y = layers.data("y", [1], dtype="int64")
        h = layers.fc(layers.fc(x, 32, act="relu"), 32, act="relu")
        logits = layers.fc(h, 10)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))
        test_program = main.clone(for_test=True)
        optimizer.Adam(0.01).minimize(loss)
    return main, startup, loss, test_program, logits


def sparse_model(distributed: bool = False) -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable]:
    """`distributed`: the table is marked is_distributed (it stays on the pservers)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 11
    with fluidps.program_guard(main, startup):
        dense = layers.data("dense", [4])
        ids = layers.data("ids", [3], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        table = layers.embedding_v2(ids, [500, 4], is_sparse=True, is_distributed=distributed)
        emb = layers.reshape(table, [-1, 12])
        h = layers.fc(layers.concat([dense, emb], axis=1), 16, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 2), label))
        optimizer.Adam(0.05, lazy_mode=True).minimize(loss)
    return main, startup, loss


def mlp_batches(n: int, rows: int = 16, seed: int = 0) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(rows, 64)).astype("float32"), "y": rng.integers(0, 10, (rows, 1))}
        for _ in range(n)
    ]


def sparse_batches(n: int, rows: int = 8, seed: int = 1) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "dense": rng.normal(size=(rows, 4)).astype("float32"),
            "ids": rng.integers(0, 500, (rows, 3)),
            "label": rng.integers(0, 2, (rows, 1)),
        }
        for _ in range(n)
    ]


def persistables(program: fluidps.Program) -> list[str]:
    return sorted(v.name for v in program.list_vars() if v.persistable and v.name not in ("feed", "fetch"))
