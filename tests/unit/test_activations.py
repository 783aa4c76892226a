"""The activations' table (fluidps.ops.activation.ACTIVATIONS): every op it lists is
defined from it, its kernels map its rules, and the generated kernels stay cacheable."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from fluidps.ops import REGISTRY
from fluidps.ops.activation import _KERNELS, ACTIVATIONS
from helpers import python_output

# Edge values with the random ones: zero, both signs, tiny, large, past exp's range.
EDGES = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 0.5, 2.0, 88.0, -88.0, 710.0, -710.0, 1e30, -1e30]


def _inputs(dtype: str) -> np.ndarray:
    rng = np.random.default_rng(3)
    with np.errstate(over="ignore"):
        values = np.concatenate([np.array(EDGES).astype(dtype), rng.normal(0, 5, 50).astype(dtype)])
    return values.reshape(8, 8)


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(f"u{a.itemsize}")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op_type", list(ACTIVATIONS))
def test_each_kernel_is_its_rules_mapped_over_the_array(op_type, dtype):
    rules, kernels = ACTIVATIONS[op_type], _KERNELS[op_type]
    x = _inputs(dtype)
    with np.errstate(all="ignore"):
        out = kernels.forward(x)
        want = np.array([rules.forward(v) for v in x.ravel()]).astype(dtype).reshape(x.shape)
        assert out.dtype == x.dtype and np.array_equal(_bits(out), _bits(want))
        if rules.grad is None:
            assert kernels.grad is None and not REGISTRY.has_kernel(op_type + "_grad")
            return
        source = np.where(x == 0, 1, out if rules.grad_reads == "Out" else x).astype(dtype)  # no 1 / 0
        dout = _inputs(dtype)[::-1].copy()
        dx = kernels.grad(source, dout)
        want = [rules.grad(s, d) for s, d in zip(source.ravel(), dout.ravel(), strict=True)]
        want = np.array(want).astype(dtype).reshape(x.shape)
        assert dx.dtype == x.dtype and np.array_equal(_bits(dx), _bits(want))


@pytest.mark.parametrize("op_type", list(ACTIVATIONS))
def test_every_activation_is_an_op_with_its_gradient_reading_what_the_table_says(op_type):
    rules = ACTIVATIONS[op_type]
    assert REGISTRY.has_kernel(op_type) and REGISTRY.has_lowering(op_type)
    if rules.grad is None:
        assert op_type + "_grad" not in REGISTRY
        return
    grad = REGISTRY[op_type + "_grad"]
    assert REGISTRY.has_kernel(grad.type) and REGISTRY.has_lowering(grad.type)
    slots = {s.name for s in grad.inputs}
    assert {rules.grad_reads, "Out@GRAD"} <= slots


LOAD_KERNELS = """
import json
import numpy as np
from fluidps.ops.activation import _KERNELS

stats = {}
for kernels in _KERNELS.values():
    for fn in filter(None, kernels):
        for dtype in ("float32", "float64"):
            x = np.linspace(0.5, 2.0, 6, dtype=dtype)
            fn(x) if fn is kernels.forward else fn(x, x)
        stats[fn.__name__] = [sum(fn.stats.cache_hits.values()), sum(fn.stats.cache_misses.values())]
print(json.dumps(stats))
"""


def test_a_second_process_loads_every_generated_kernel_from_numbas_cache(tmp_path):
    """The kernels are generated at import, each a module-level function of its own name:
    numba caches each one, and the next process loads them instead of compiling them."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    first, second = (json.loads(python_output(LOAD_KERNELS, env=env)) for _ in range(2))
    names = {f"_{t}" for t in ACTIVATIONS} | {f"_{t}_grad" for t, r in ACTIVATIONS.items() if r.grad}
    assert set(first) == set(second) == names
    assert all(misses == 2 for _, misses in first.values())  # compiled once per dtype
    assert all(stats == [2, 0] for stats in second.values()), second  # loaded, none compiled
