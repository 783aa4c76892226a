"""Every op module, listed once. Adding an op family means adding it here."""

from __future__ import annotations

from fluidps.ops import (
    activation,
    arith,
    compare,
    conv,
    copy,
    creation,
    distributed,
    distributed_lookup,
    dropout,
    elementwise,
    io,
    lookup_table,
    matmul,
    metric,
    optimizers,
    pipeline,
    pool,
    reader,
    reduce,
    shape,
    softmax,
    sparse_embedding,
)
from fluidps.ops.registry import OpRegistry

FAMILIES = (
    io,
    reader,
    creation,
    copy,
    arith,
    matmul,
    elementwise,
    compare,
    activation,
    softmax,
    reduce,
    shape,
    lookup_table,
    sparse_embedding,
    conv,
    pool,
    dropout,
    metric,
    optimizers,
    distributed,
    distributed_lookup,
    pipeline,
)

REGISTRY = OpRegistry(module.family for module in FAMILIES)
