"""A small click-through-rate job for tests/distributed, run by `fluidps launch`.

    fluidps launch --pservers 2 --trainers 1 tests/distributed/ctr_job.py OUTDIR STEPS [adam|sgd]

The model is a shrunk examples/ctr_embedding.py: an `is_sparse=True` embedding
(its gradient a SelectedRows of the looked-up rows) updated by lazy Adam, or by
SGD, which unlike Adam shows whether gradients were averaged or summed. The
table is cut into one row block per pserver. The ids are heavy-tailed and the
first half of the fields draw from the first half of the table, so each block
gets some rows and most rows of each block are never touched.

Every process writes what the tests check into OUTDIR: a trainer its losses,
the ids it fed and its parameters after startup and at the end; a pserver its
stats (the sparse rows it received) and the slices it held.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import fluidps
from fluidps import layers, optimizer

FIELDS = 4
VOCAB = 2000
DIM = 4
BATCH = 32
# 2000 x 4 = 8000 elements: two blocks of 1000 rows on two pservers.
CONFIG = fluidps.DistributeTranspilerConfig(min_block_size=2000)


def build(optimizer_name: str = "adam", seed: int = 1):
    """(main, startup, loss); the optimizer ops are in main."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [VOCAB, DIM], is_sparse=True)
        h = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 16, act="relu")
        logits = layers.fc(h, 2)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        if optimizer_name == "adam":
            optimizer.Adam(0.01, lazy_mode=True).minimize(loss)
        else:
            optimizer.SGD(0.5).minimize(loss)
    return main, startup, loss


def batch(step: int, trainer_id: int = 0) -> dict[str, np.ndarray]:
    """The feed of one step: the same for a given (step, trainer) in every process."""
    rng = np.random.default_rng([step, trainer_id])
    per_field = VOCAB // FIELDS
    ranks = (rng.zipf(1.5, size=(BATCH, FIELDS)) - 1) % per_field
    ids = (ranks + np.arange(FIELDS) * per_field).astype(np.int64)
    label = (ids[:, :1] % 3 == 0).astype(np.int64)
    return {"ids": ids, "label": label}


def main() -> None:
    out, steps = Path(sys.argv[1]), int(sys.argv[2])
    role = fluidps.role_from_env()
    program, startup, loss = build(sys.argv[3] if len(sys.argv) > 3 else "adam")
    mine = fluidps.transpile_for_role(role, program, startup, CONFIG)
    exe = fluidps.Executor()
    if role.is_pserver:
        exe.run(mine.startup)
        exe.run(mine.main)
        held = [
            {"param": s.param, "grad": s.grad, "offset": s.offset, "rows": s.rows, "sparse": s.sparse}
            for s in mine.plan.slices_on(role.current_endpoint)
        ]
        stats = exe.runtime.pserver_loops[0].stats()
        (out / f"pserver.{role.pserver_index}.json").write_text(json.dumps(stats | {"slices": held}))
        return

    params = [p.name for p in program.all_parameters()]
    trainer = mine.main
    losses, fed = [], []
    try:
        exe.run(mine.startup)
        np.savez(out / f"trainer.{role.trainer_id}.initial.npz", **{n: exe.scope[n] for n in params})
        for step in range(steps):
            feed = batch(step, role.trainer_id)
            (value,) = exe.run(trainer, feed=feed, fetch_list=[loss])
            losses.append(float(value))
            fed.append(feed["ids"])
    finally:
        problems = exe.close()
    np.savez(out / f"trainer.{role.trainer_id}.final.npz", **{n: exe.scope[n] for n in params})
    np.save(out / f"trainer.{role.trainer_id}.ids.npy", np.stack(fed))
    result = {"losses": losses, "close_problems": problems}
    (out / f"trainer.{role.trainer_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
