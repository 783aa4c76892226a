"""The training workloads bench.distributed times, built from the examples: each a model
builder, its batches, and what bench/launched.py needs to build the same one in every
process of a `fluidps launch` job."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import fluidps

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import ctr_embedding
import ctr_hashed
import digits_mlp

CTR_VOCAB = ctr_embedding.VOCAB  # the example's table rows


@dataclass
class Workload:
    name: str
    build: Callable[[], tuple[fluidps.Program, fluidps.Program, fluidps.Variable]]  # main, startup, loss
    batches: list[dict[str, np.ndarray]]
    steps: int  # per timed window
    info: dict  # extra row fields
    launch_args: tuple[str, ...]  # what bench/launched.py needs to build the same workload


def digits_workload(batch: int, steps: int) -> Workload:
    x, _, y, _ = digits_mlp.load_data(0)
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(8):
        idx = rng.choice(len(x), batch, replace=False)
        batches.append({"image": x[idx], "label": y[idx]})

    def build():
        main, startup, _, loss, _ = digits_mlp.build()
        return main, startup, loss

    info = {"model": "64-256-256-10", "optimizer": "adam"}
    return Workload(
        "digits_mlp", build, batches, steps, info, ("--workload", "digits_mlp", "--batch", str(batch))
    )


def ctr_workload(batch: int, steps: int, vocab: int, distributed_table: bool = False) -> Workload:
    """The CTR model with a `vocab`-row table; `distributed_table`: marked is_distributed,
    so that jobs keep it on the pservers and prefetch rows (the local rows do not change)."""
    ctr_embedding.VOCAB, ctr_embedding.PER_FIELD = vocab, vocab // ctr_embedding.FIELDS
    world = ctr_embedding.ClickWorld()
    batches = [world.sample(batch, seed=100 + i) for i in range(8)]

    def build():
        ctr_embedding.VOCAB, ctr_embedding.PER_FIELD = vocab, vocab // ctr_embedding.FIELDS
        main, startup, _, loss, _ = ctr_embedding.build(distributed_table=distributed_table)
        return main, startup, loss

    info = {
        "table": f"{vocab}x8",
        "fields": ctr_embedding.FIELDS,
        "optimizer": "lazy adam",
        "distributed_table": distributed_table,
    }
    name = "ctr_distributed" if distributed_table else "ctr_embedding"
    launch_args = ("--workload", name, "--batch", str(batch), "--vocab", str(vocab))
    return Workload(name, build, batches, steps, info, launch_args)


def ctr_hashed_workload(batch: int, steps: int) -> Workload:
    """The CTR model over raw feature hashes, its table sharded over the pservers by id."""
    world = ctr_hashed.HashedClickWorld()
    batches = [world.sample(batch, seed=100 + i) for i in range(8)]

    def build():
        main, startup, _, loss, _ = ctr_hashed.build()
        return main, startup, loss

    info = {"table": "hashed x8", "fields": ctr_hashed.FIELDS, "optimizer": "adam (per-row state)"}
    return Workload(
        "ctr_hashed", build, batches, steps, info, ("--workload", "ctr_hashed", "--batch", str(batch))
    )


def make(name: str, batch: int, steps: int, vocab: int = CTR_VOCAB) -> Workload:
    """A workload by its name (as in bench.distributed's --models)."""
    if name == "digits_mlp":
        return digits_workload(batch, steps)
    if name == "ctr_hashed":
        return ctr_hashed_workload(batch, steps)
    if name in ("ctr_embedding", "ctr_distributed"):
        return ctr_workload(batch, steps, vocab, name == "ctr_distributed")
    raise ValueError(f"unknown workload {name!r}")
