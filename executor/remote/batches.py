"""A fed batch across a job's trainers: cut along dim 0, one piece per trainer, and their
fetches put back together as if one process had run the whole batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.program import Program


def batch_size(feed: Mapping[str, Any]) -> int:
    return next((len(v) for v in feed.values() if np.ndim(v) > 0), 1)


def split_feed(feed: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    """Each fed array split along dim 0 into `parts` nearly equal pieces, one per trainer."""
    if parts == 1:
        return [feed]
    out: list[dict[str, Any]] = [{} for _ in range(parts)]
    for name, value in feed.items():
        if not isinstance(value, np.ndarray) or value.ndim == 0:
            raise ExecutionError(
                f"feed {name!r} must be an array with a batch dimension to split across trainers"
            )
        if len(value) < parts:
            raise ExecutionError(
                f"feed {name!r} has {len(value)} rows; a job of {parts} trainers needs at least one per trainer"
            )
        for i, piece in enumerate(np.array_split(value, parts)):
            out[i][name] = np.ascontiguousarray(piece)
    return out


def combine(program: Program, name: str, values: list[Any], sizes: list[int]) -> Any:
    """One fetch from every trainer's: weighted mean of scalars, concatenation of
    per-example values, trainer 0's value otherwise."""
    first = values[0]
    if len(values) == 1 or not isinstance(first, np.ndarray):
        return first
    var = program.global_block().find_var(name)
    shape = var.shape if var is not None else None
    if first.size == 1 and np.issubdtype(first.dtype, np.floating):
        weights = np.asarray(sizes, dtype=np.float64) / sum(sizes)
        mean = sum(w * v.astype(np.float64) for w, v in zip(weights, values, strict=True))
        return mean.astype(first.dtype)
    if shape and shape[0] == -1:
        return np.concatenate(values)
    return first


def combine_fetches(
    program: Program, fetch_names: Sequence[str], values: Sequence[Mapping[str, Any]], sizes: Sequence[int]
) -> list[Any]:
    """Each fetch from every trainer's fetched values (one mapping per trainer, weighted by
    `sizes`, the samples each ran), combined as `combine` does."""
    return [combine(program, name, [v[name] for v in values], list(sizes)) for name in fetch_names]
