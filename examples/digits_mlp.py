"""Train an MLP on scikit-learn's bundled 8x8 digits with Adam, locally.

    python examples/digits_mlp.py            # about 97-98% test accuracy in a few seconds

The model is built once with fluidps.layers; fluidps.Executor runs the
startup program (parameter initialization) and then the training program
batch by batch on numba-compiled kernels.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import fluidps
from fluidps import layers, optimizer


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Pixels scaled to [0, 1] as float32, labels as int64 [n, 1]; a stratified 80/20 split."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64).reshape(-1, 1)
    return train_test_split(x, y, test_size=0.2, random_state=seed, stratify=digits.target)


def build(hidden: int = 256, learning_rate: float = 0.001, seed: int = 1):
    """(main, startup, test_program, loss, accuracy) of a 64-hidden-hidden-10 MLP."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        image = layers.data("image", [64])
        label = layers.data("label", [1], dtype="int64")
        h = layers.fc(image, hidden, act="relu")
        h = layers.fc(h, hidden, act="relu")
        logits = layers.fc(h, 10)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        accuracy = layers.accuracy(layers.softmax(logits), label)
        test_program = main.clone(for_test=True)
        optimizer.Adam(learning_rate).minimize(loss)
    return main, startup, test_program, loss, accuracy


def shuffled_batches(
    examples: int, epochs: int, batch_size: int, seed: int, drop_last: bool = False
) -> Iterator[tuple[int, np.ndarray]]:
    """(epoch, indices) of each mini-batch: every epoch a new permutation of the examples."""
    rng = np.random.default_rng(seed)
    per_epoch = examples // batch_size if drop_last else int(np.ceil(examples / batch_size))
    for epoch in range(epochs):
        order = rng.permutation(examples)
        for i in range(0, per_epoch * batch_size, batch_size):
            yield epoch, order[i : i + batch_size]


def fit(
    model, data, epochs: int, batch_size: int, seed: int, progress: bool, name: str, drop_last: bool = False
) -> dict:
    """Train `model` = (main, startup, test_program, loss, accuracy) on `data` =
    (x_train, x_test, y_train, y_test) with shuffled mini-batches; evaluate once.
    `drop_last`: skip each epoch's last, smaller batch (a pipeline cuts every batch
    into equal micro-batches)."""
    main, startup, test_program, loss, accuracy = model
    x_train, x_test, y_train, y_test = data
    exe = fluidps.Executor()
    exe.run(startup)
    batches = list(shuffled_batches(len(x_train), epochs, batch_size, seed, drop_last))
    steps = len(batches)
    bar = tqdm(total=steps, desc=name, unit="step", disable=not progress)
    loss_value = float("nan")  # (no epochs: nothing trained)
    start = time.perf_counter()
    for epoch, idx in batches:
        (loss_value,) = exe.run(main, feed={"image": x_train[idx], "label": y_train[idx]}, fetch_list=[loss])
        bar.set_postfix(epoch=epoch + 1, loss=f"{float(loss_value):.4f}")
        bar.update()
    seconds = time.perf_counter() - start
    bar.close()
    (test_accuracy,) = exe.run(test_program, feed={"image": x_test, "label": y_test}, fetch_list=[accuracy])
    return {
        "test_accuracy": float(test_accuracy),
        "final_loss": float(loss_value),
        "train_seconds": seconds,
        "steps": steps,
    }


def train(
    epochs: int = 20, batch_size: int = 64, learning_rate: float = 0.001, seed: int = 0, progress: bool = True
) -> dict:
    """Train and evaluate; returns the final metrics."""
    model = build(learning_rate=learning_rate, seed=seed + 1)
    return fit(model, load_data(seed), epochs, batch_size, seed, progress, "digits_mlp")


def report(metrics: dict) -> None:
    print(
        f"test accuracy {metrics['test_accuracy']:.4f} after {metrics['steps']} steps "
        f"({metrics['train_seconds']:.1f}s, final loss {metrics['final_loss']:.4f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    report(train(args.epochs, args.batch_size, args.lr, args.seed))


if __name__ == "__main__":
    main()
