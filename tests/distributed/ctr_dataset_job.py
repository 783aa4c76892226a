"""A held-out fault job: click-through rate on a synthetic click log, read through a coordinator.

    python tests/distributed/ctr_dataset_job.py --write-dataset DIR
    fluidps launch --dataset DIR --pservers 2 --trainers 2 tests/distributed/ctr_dataset_job.py --out OUT

Another model and other data than examples/distributed_digits.py, which the fault
tests were written against: an `is_sparse=True` embedding of four categorical
fields (its gradients SelectedRows, its table cut into row blocks on the pservers)
under lazy Adam, then a small MLP. Each id has a hidden weight; a click is drawn
with the probability the sum of its sample's weights says, so a model that learns
the weights reaches the held-out accuracy that the draws allow, about 0.8.

Trainer 0 writes the held-out accuracy into OUT/trainer.0.json at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import fluidps
from fluidps import layers, optimizer

FIELDS, PER_FIELD, DIM = 4, 250, 4
TRAIN, TEST = 10000, 2000
RECORDS_PER_SHARD = 500  # 20 tasks a pass


def click_log(samples: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids [samples, FIELDS], clicks [samples, 1]): heavy-tailed ids per field, clicks
    drawn from the hidden weights (the same in every process: they come from seed 0)."""
    weights = np.random.default_rng(0).normal(0.0, 1.5, size=FIELDS * PER_FIELD)
    rng = np.random.default_rng(seed)
    ranks = (rng.zipf(1.3, size=(samples, FIELDS)) - 1) % PER_FIELD
    ids = (ranks + np.arange(FIELDS) * PER_FIELD).astype(np.int64)
    p = 1.0 / (1.0 + np.exp(-weights[ids].sum(axis=1)))
    clicks = (rng.random(samples) < p).astype(np.int64).reshape(-1, 1)
    return ids, clicks


def build(seed: int = 1):
    """(main, startup, test_program, loss, accuracy)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.embedding_v2(ids, [FIELDS * PER_FIELD, DIM], is_sparse=True)
        h = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 16, act="relu")
        logits = layers.fc(h, 2)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, click))
        accuracy = layers.accuracy(layers.softmax(logits), click)
        test_program = main.clone(for_test=True)
        optimizer.Adam(0.005, lazy_mode=True).minimize(loss)
    return main, startup, test_program, loss, accuracy


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--write-dataset", metavar="DIR")
    args = parser.parse_args()
    if args.write_dataset:
        ids, clicks = click_log(TRAIN, seed=1)
        dataset = fluidps.io.Dataset.write(
            args.write_dataset, {"ids": ids, "click": clicks}, records_per_shard=RECORDS_PER_SHARD
        )
        print(f"wrote {dataset.describe()}")
        return

    role = fluidps.role_from_env()
    main_program, startup, test_program, loss, accuracy = build()
    if role.dataset:
        block = main_program.global_block()
        with fluidps.program_guard(main_program, startup):
            layers.dataset_reader(
                role.dataset, [block.var("ids"), block.var("click")], args.batch_size, passes=args.epochs
            )
    mine = fluidps.transpile_for_role(role, main_program, startup)  # (in the launcher's --mode)
    exe = fluidps.Executor()
    if role.is_pserver:
        exe.run(mine.startup)
        exe.run(mine.main)
        return
    steps, result = 0, {}
    try:
        exe.run(mine.startup)  # the parameters as they are now
        while True:
            try:
                exe.run(mine.main, fetch_list=[loss])
            except fluidps.EOFException:
                break
            steps += 1
        result = {"trainer_id": role.trainer_id, "steps": steps}
        if role.trainer_id == 0:
            exe.run(mine.startup)  # the final parameters
            ids, clicks = click_log(TEST, seed=2)
            (acc,) = exe.run(test_program, feed={"ids": ids, "click": clicks}, fetch_list=[accuracy])
            result["test_accuracy"] = float(acc)
            print(f"held-out accuracy {float(acc):.4f} after {steps} steps of this trainer", flush=True)
    finally:
        for problem in exe.close():
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    if args.out is not None:
        (args.out / f"trainer.{role.trainer_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
