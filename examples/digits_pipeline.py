"""Train the digits MLP as a pipeline of two stages: micro-batches flow through them.

    python examples/digits_pipeline.py                 # about 97-98% test accuracy
    python examples/digits_pipeline.py --out pipeline  # also save the program, then:
    fluidps transpile pipeline/main.pb --pipeline --microbatches 4 -o pipeline/stages
    fluidps dot pipeline/main.pb -o pipeline/main.svg  # each op in its stage's colour

The first two layers run on stage 0, the classifier and the loss on stage 1;
PipelineOptimizer cuts each batch of 64 into 4 micro-batches on the 1F1B
schedule and updates once a batch with their gradients' sum, so training
follows examples/digits_mlp.py's.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from digits_mlp import fit, load_data, report

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


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="directory to save main.pb / startup.pb in")
    args = parser.parse_args()
    report(train(args.epochs, seed=args.seed, out=args.out))


if __name__ == "__main__":
    main()
