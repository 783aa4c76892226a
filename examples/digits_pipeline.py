"""Train the digits MLP as a pipeline of two stages: micro-batches flow through them.

    python examples/digits_pipeline.py                 # about 97-98% test accuracy
    python examples/digits_pipeline.py --out pipeline  # also save the program, then:
    fluidps transpile pipeline/main.pb --pipeline --microbatches 4 -o pipeline/stages
    fluidps dot pipeline/main.pb -o pipeline/main.svg  # each op in its stage's colour

    # The Fluid way: this script in one process per stage, each training its stage.
    fluidps launch --stages 2 examples/digits_pipeline.py --epochs 5
    # Two replicas of the pipeline, each stage's parameters on a pserver of its own.
    fluidps launch --stages 2 --trainers 2 --pservers 1 examples/digits_pipeline.py --epochs 5

The first two layers run on stage 0, the classifier and the loss on stage 1;
PipelineOptimizer cuts each batch of 64 into 4 micro-batches on the 1F1B
schedule and updates once a batch with their gradients' sum, so training
follows examples/digits_mlp.py's.

Launched, every process builds the same model and reads the same batches;
`fluidps.transpile_for_role` gives it its stage's programs (what `fluidps launch`
told it: FLUIDPS_STAGE), whose Executor.run trains that stage alone, passing
activations and gradients to the other stage's process. The last stage reports
the loss; with --out each stage saves the parameters it trained.
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import numpy as np
from digits_mlp import fit, load_data, report, shuffled_batches

import fluidps
from fluidps import layers, optimizer


def build(hidden: int = 256, learning_rate: float = 0.001, seed: int = 1, micro_batches: int = 4):
    """(main, startup, test_program, loss, accuracy), the MLP cut into two stages."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        image = layers.data("image", [64])
        label = layers.data("label", [1], dtype="int64")
        with fluidps.device_guard("stage:0"):
            h = layers.fc(image, hidden, act="relu")
            h = layers.fc(h, hidden, act="relu")
        with fluidps.device_guard("stage:1"):
            logits = layers.fc(h, 10)
            loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
            accuracy = layers.accuracy(layers.softmax(logits), label)
        test_program = main.clone(for_test=True)
        pipeline = optimizer.PipelineOptimizer(optimizer.Adam(learning_rate), num_microbatches=micro_batches)
        pipeline.minimize(loss)
    return main, startup, test_program, loss, accuracy


def train(
    epochs: int = 20, batch_size: int = 64, seed: int = 0, progress: bool = True, out: Path | None = None
) -> dict:
    model = build(seed=seed + 1)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "main.pb").write_bytes(model[0].serialize_to_string())
        (out / "startup.pb").write_bytes(model[1].serialize_to_string())
    return fit(model, load_data(seed), epochs, batch_size, seed, progress, "digits_pipeline", drop_last=True)


def train_stage(epochs: int, batch_size: int = 64, seed: int = 0, out: Path | None = None) -> None:
    """This process's part of a launched pipeline: a stage of one replica, on its share
    of the batches train() would take (replica r of N takes rows r*B .. (r+1)*B - 1 of
    each batch of N*B), or a pserver of one stage's parameters."""
    role = fluidps.role_from_env()
    main, startup, _, loss, _ = build(seed=seed + 1)
    mine = fluidps.transpile_for_role(role, main, startup)
    exe = fluidps.Executor()
    if role.is_pserver:  # stage role.stage's parameters: serve until every replica is done
        exe.run(mine.startup)
        exe.run(mine.main)
        return
    x_train, _, y_train, _ = load_data(seed)
    last = mine.plan.owner(loss.name) == role.stage  # this stage computes the loss
    replica = slice(role.trainer_id * batch_size, (role.trainer_id + 1) * batch_size)
    try:
        exe.run(mine.startup)  # this stage's parameters only (from its pservers, if it has some)
        global_size = role.trainers * batch_size
        batches = shuffled_batches(len(x_train), epochs, global_size, seed, drop_last=True)
        for epoch, group in itertools.groupby(batches, key=lambda batch: batch[0]):
            losses = []
            for _, idx in group:
                rows = idx[replica]
                feed = {"image": x_train[rows], "label": y_train[rows]}
                losses += exe.run(mine.main, feed=feed, fetch_list=[loss] if last else [])
            if last:
                print(f"epoch {epoch + 1}: loss {np.mean(losses):.4f}", flush=True)
        params = mine.plan.stages[role.stage].params
        if out is not None and role.trainer_id == 0:
            out.mkdir(parents=True, exist_ok=True)
            np.savez(out / f"stage.{role.stage}.npz", **{n: exe.scope[n] for n in params})
        print(f"stage {role.stage}: {len(params)} parameters trained", flush=True)
    finally:
        exe.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory to save main.pb / startup.pb in")
    args = parser.parse_args()
    if os.environ.get("FLUIDPS_STAGE"):  # (fluidps launch --stages)
        train_stage(args.epochs, seed=args.seed, out=args.out)
    else:
        report(train(args.epochs, seed=args.seed, out=args.out))


if __name__ == "__main__":
    main()
