"""A pserver's message limit follows its plan (fluidps.executor.ps.message_limit)."""

from __future__ import annotations

from types import SimpleNamespace

from fluidps.executor.ps.message_limit import FLOOR, HEADROOM, UNBOUNDED_BYTES, message_limit, variable_bytes
from fluidps.ir.types import VarType


def _var(shape, dtype=VarType.FP32):
    return SimpleNamespace(shape=shape, dtype=dtype)


def test_a_variable_takes_its_elements_times_its_itemsize():
    assert variable_bytes(_var([1000, 64])) == 256_000
    assert variable_bytes(_var([3], VarType.INT64)) == 24
    assert variable_bytes(_var([1000, 64], VarType.FP64)) == 512_000


def test_an_unknown_dimension_or_variable_counts_as_unbounded():
    assert variable_bytes(_var([-1, 16])) == UNBOUNDED_BYTES  # a hashed table's rows
    assert variable_bytes(None) == UNBOUNDED_BYTES
    assert variable_bytes(_var(None)) == UNBOUNDED_BYTES


def test_the_limit_is_headroom_times_what_is_served_with_a_floor():
    small = {"w": _var([8, 16]), "w@GRAD": _var([8, 16])}
    assert message_limit(small, ["w", "w@GRAD"]) == FLOOR
    big = {"emb": _var([4_000_000, 64]), "emb@GRAD": _var([4_000_000, 64])}
    assert message_limit(big, ["emb", "emb@GRAD", "emb"]) == HEADROOM * 2 * 4_000_000 * 64 * 4
    hashed = {"table": _var([-1, 8]), "table@GRAD": _var([-1, 8])}
    assert message_limit(hashed, hashed) == HEADROOM * 2 * UNBOUNDED_BYTES
