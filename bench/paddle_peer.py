"""PaddlePaddle peer for bench.local: the same workloads, built on Paddle's dygraph API.

Only the benchmark imports Paddle, and only when it is installed; fluidps itself never does.

Dygraph (eager mode) is used: on CPU it was the fastest Paddle API for these workloads and
the only one that stays on one thread. Measured on Paddle 3.3.1 against the static graph
(`paddle.enable_static()` + `paddle.static.Executor`, FLAGS_new_executor_serial_run=1): the
legacy ProgramDesc executor (FLAGS_enable_pir_api=0) ran the digits MLP and the tiny model
10-20% slower and the ctr model at the same speed; the default PIR executor ran the digits
MLP 10-20% slower and the ctr model about 8x slower. Both static executors also start
threads of their own.

Each builder returns a `step(i)` callable for bench.local's `timed`, mirroring
bench.local's torch_classifier / torch_ctr: same shapes, optimizer, batch, and a loss fetched
to the host every step.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable

import numpy as np


def load_paddle():
    """The `paddle` module set to CPU and one math-library thread, or None when not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "No ccache found", from paddle.utils.cpp_extension
            import paddle
    except ImportError:
        return None
    paddle.set_device("cpu")
    set_num_threads = getattr(paddle.base.core, "set_num_threads", None)  # MKL / OpenMP
    if set_num_threads is not None:
        set_num_threads(1)
    paddle.disable_static()
    return paddle


def classifier_step(paddle, sizes: list[int], batch: int) -> Callable[[int], None]:
    """Softmax classifier `sizes` (ReLU between Linear layers), plain SGD lr 0.01."""
    nn = paddle.nn
    layers_ = []
    for a, b in itertools.pairwise(sizes[:-1]):
        layers_ += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers_, nn.Linear(sizes[-2], sizes[-1]))
    opt = paddle.optimizer.SGD(learning_rate=0.01, parameters=model.parameters())
    rng = np.random.default_rng(0)
    batches = [
        (
            paddle.to_tensor(rng.random((batch, sizes[0]), dtype=np.float32)),
            paddle.to_tensor(rng.integers(0, sizes[-1], (batch, 1))),
        )
        for _ in range(8)
    ]

    def step(i: int) -> None:
        x, y = batches[i % 8]
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.clear_grad()
        loss.item()

    return step


def ctr_step(
    paddle, batches: list[dict[str, np.ndarray]], vocab: int, fields: int, dim: int, dense: int
) -> Callable[[int], None]:
    """`fields` ids into a sparse `vocab` x `dim` embedding plus `dense` features, MLP 64-32-2.

    One Adam(lazy_mode=True): the embedding's gradient is SelectedRows, so only the rows in
    the batch (and their moments) are updated; the MLP gets ordinary Adam.
    """
    nn = paddle.nn
    emb = nn.Embedding(vocab, dim, sparse=True)
    mlp = nn.Sequential(
        nn.Linear(fields * dim + dense, 64),
        nn.ReLU(),
        nn.Linear(64, 32),
        nn.ReLU(),
        nn.Linear(32, 2),
    )
    opt = paddle.optimizer.Adam(
        learning_rate=0.001, parameters=emb.parameters() + mlp.parameters(), lazy_mode=True
    )
    tensors = [{k: paddle.to_tensor(v) for k, v in b.items()} for b in batches]

    def step(i: int) -> None:
        b = tensors[i % len(tensors)]
        h = paddle.concat([emb(b["ids"]).reshape([b["ids"].shape[0], -1]), b["dense"]], axis=1)
        loss = nn.functional.cross_entropy(mlp(h), b["label"])
        loss.backward()
        opt.step()
        opt.clear_grad()
        loss.item()

    return step
