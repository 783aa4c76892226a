"""Small programs and helpers the transpiler's tests share: the MLP and the sparse model
they transpile, and the op types of a block."""

from __future__ import annotations

import fluidps
from fluidps import layers, optimizer

EPS2 = "127.0.0.1:6170,127.0.0.1:6171"
BACKWARD_MLP = [
    "fill_constant", "mean_grad", "softmax_with_cross_entropy_grad", "elementwise_add_grad", "mul_grad",
    "relu_grad", "elementwise_add_grad", "mul_grad",
]  # fmt: skip


def mlp(lr=0.01, decay=False, l2=False):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [64])
        y = layers.data("y", [1], dtype="int64")
        h = layers.fc(x, 256, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 10), y))
        rate = layers.exponential_decay(lr, 100, 0.5, staircase=True) if decay else lr
        optimizer.Adam(rate, regularization=fluidps.L2Decay(1e-4) if l2 else None).minimize(loss)
    return main, startup


def sparse_model(vocab=100_000):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [4], dtype="int64")
        y = layers.data("y", [1], dtype="int64")
        emb = layers.reshape(layers.embedding_v2(ids, [vocab, 8], is_sparse=True), [-1, 32])
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(emb, 2), y))
        optimizer.SGD(0.1).minimize(loss)
    return main, startup


def transpile(main, startup, mode="sync", pservers=EPS2, trainers=2, trainer_id=0, **config):
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(mode=mode, **config))
    return t, t.transpile(trainer_id, main, pservers, trainers=trainers, startup_program=startup)


def ops(program, block=0):
    return [op.type for op in program.block(block).ops]
