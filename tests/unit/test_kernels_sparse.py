"""Kernels of embedding lookups and optimizers, dense and sparse (SelectedRows).

Lookups run against numpy and finite differences; every optimizer runs several
steps through the Executor, in place on a scope's arrays as Fluid programs
use it, against a numpy reference of Fluid's formula; sparse gradients are
checked against the dense update with the densified gradient.
"""

from __future__ import annotations

import numpy as np
import pytest
from optest import OpProgram, check_grad, check_output, run_op

import fluidps
from fluidps.errors import ExecutionError
from fluidps.ir.types import VarType
from fluidps.ops import REGISTRY
from fluidps.ops.selected_rows import SelectedRows

RNG = np.random.default_rng(11)


# -- lookups -----------------------------------------------------------------------------


def _ids(shape, rows, dtype, pad=None):
    ids = RNG.integers(0, rows, size=shape).astype(dtype)
    if pad is not None:
        ids.reshape(-1)[::3] = pad  # make sure padding rows are looked up
    return ids


def _lookup_reference(w, ids, pad):
    out = w[ids].copy()
    if pad != -1:
        out[ids == pad] = 0
    return out


LOOKUP_CASES = [
    # (op type, ids shape, padding_idx)
    ("lookup_table", (5, 1), -1),
    ("lookup_table", (2, 3, 1), 2),
    ("lookup_table_v2", (7,), -1),
    ("lookup_table_v2", (2, 4), 0),
    ("lookup_table_v2", (2, 2, 3), 5),
]


@pytest.mark.parametrize("id_dtype", ["int64", "int32"])
@pytest.mark.parametrize(("op_type", "shape", "pad"), LOOKUP_CASES)
def test_lookup_forward(op_type, shape, pad, id_dtype):
    w = RNG.normal(size=(6, 4))
    ids = _ids(shape, 6, id_dtype, None if pad == -1 else pad)

    def reference(W, Ids):
        flat = Ids[..., 0] if op_type == "lookup_table" else Ids
        return {"Out": _lookup_reference(W, flat, pad)}

    check_output(op_type, {"W": w, "Ids": ids}, reference, attrs={"padding_idx": pad})


@pytest.mark.parametrize("op_type", ["lookup_table", "lookup_table_v2"])
@pytest.mark.parametrize("bad", [6, 100, -2])
def test_lookup_rejects_ids_out_of_range(op_type, bad):
    ids = np.array([[1], [bad], [0]], dtype=np.int64)
    if op_type == "lookup_table_v2":
        ids = ids.reshape(3)
    w = RNG.normal(size=(6, 4)).astype("float32")
    with pytest.raises(ExecutionError) as info:
        run_op(op_type, {"W": w, "Ids": ids})
    message = str(info.value)
    assert op_type in message and "W_0" in message and str(bad) in message and "6 rows" in message


def test_lookup_padding_idx_is_not_an_id_check_bypass():
    # -1 means "no padding": an id of -1 is then out of range, not a padding row.
    ids = np.array([0, -1], dtype=np.int64)
    with pytest.raises(ExecutionError, match="id -1"):
        run_op("lookup_table_v2", {"W": np.ones((3, 2), np.float32), "Ids": ids})


def test_lookup_v1_needs_trailing_one():
    # Ids declared [2, 1] pass inference; a fed [2, 2] (feeds of non-data variables are
    # not shape-checked) is caught by the kernel.
    prog = OpProgram("lookup_table", {"W": np.ones((3, 2)), "Ids": np.zeros((2, 1), np.int64)}, None, None)
    with pytest.raises(ExecutionError, match=r"\[\.\.\., 1\]"):
        prog.run({"W_0": np.ones((3, 2)), "Ids_0": np.zeros((2, 2), np.int64)})


@pytest.mark.parametrize("id_dtype", ["int64", "int32"])
@pytest.mark.parametrize(("op_type", "shape", "pad"), LOOKUP_CASES)
def test_lookup_dense_grad(op_type, shape, pad, id_dtype):
    w = RNG.normal(size=(6, 3))
    ids = _ids(shape, 6, id_dtype, None if pad == -1 else pad)
    check_grad(op_type, {"W": w, "Ids": ids}, wrt=["W"], attrs={"padding_idx": pad})


@pytest.mark.parametrize(("op_type", "shape", "pad"), LOOKUP_CASES)
def test_lookup_sparse_grad_equals_dense(op_type, shape, pad):
    w = RNG.normal(size=(6, 3))
    ids = _ids(shape, 6, "int64", None if pad == -1 else pad)
    dout = RNG.normal(size=(*(shape[:-1] if op_type == "lookup_table" else shape), 3))
    grads = {}
    for sparse in (False, True):
        got = run_op(
            op_type + "_grad",
            {"W": w, "Ids": ids, "Out@GRAD": dout},
            {"padding_idx": pad, "is_sparse": sparse},
            outputs={"W@GRAD": 1},
        )
        grads[sparse] = got["W@GRAD"]
    sr = grads[True]
    assert isinstance(sr, SelectedRows) and isinstance(grads[False], np.ndarray)
    assert sr.height == 6 and sr.value.shape == (sr.rows.shape[0], 3)
    kept = ids.reshape(-1)[ids.reshape(-1) != pad]
    np.testing.assert_array_equal(sr.rows, kept)  # every looked-up row, in order, padding left out
    np.testing.assert_allclose(sr.to_dense(), grads[False], rtol=1e-12, atol=1e-12)
    # And the sparse gradient, densified, matches finite differences.
    check_grad(op_type, {"W": w, "Ids": ids}, wrt=["W"], attrs={"padding_idx": pad, "is_sparse": True})


# -- optimizers: programs whose state lives in a scope, updated in place ---------------------


class Optimizer:
    """One optimizer op in a program, state (param, accumulators, lr) in a scope,
    outputs naming their inputs as Fluid programs do; the gradient is fed."""

    def __init__(self, op_type, state, grad_like, attrs=None, pows=True):
        self.program = fluidps.Program()
        block = self.program.global_block()
        self.scope = fluidps.Scope()
        for name, value in state.items():
            block.create_var(name, shape=value.shape, dtype=value.dtype, persistable=True)
            self.scope[name] = value.copy()
        kind = VarType.SELECTED_ROWS if isinstance(grad_like, SelectedRows) else VarType.LOD_TENSOR
        block.create_var("grad", shape=grad_like.shape, dtype=grad_like.dtype, type=kind)
        slots = {slot: name for slot, name in _SLOTS[op_type].items() if name in state}
        inputs = {slot: [name] for slot, name in slots.items()}
        inputs["Grad"] = ["grad"]
        outputs = {slot + "Out": [name] for slot, name in slots.items() if slot != "LearningRate"}
        if not pows:
            outputs = {k: v for k, v in outputs.items() if "Pow" not in k}
        REGISTRY.append_op(block, op_type, inputs, outputs, attrs)
        self.exe = fluidps.Executor(scope=self.scope)

    def step(self, grad):
        self.exe.run(self.program, feed={"grad": grad})

    def __getitem__(self, name):
        return self.scope[name]


_SLOTS = {
    "sgd": {"Param": "p", "LearningRate": "lr"},
    "momentum": {"Param": "p", "Velocity": "v", "LearningRate": "lr"},
    "adagrad": {"Param": "p", "Moment": "m", "LearningRate": "lr"},
    "adam": {
        "Param": "p",
        "Moment1": "m1",
        "Moment2": "m2",
        "Beta1Pow": "b1p",
        "Beta2Pow": "b2p",
        "LearningRate": "lr",
    },
}


def _state(op_type, shape, dtype, lr=0.1, positive_moment=False):
    """Initial optimizer state of `shape`, as Fluid's startup program would leave it
    (but with nonzero accumulators, so that they matter)."""
    p = RNG.normal(size=shape).astype(dtype)
    state = {"p": p, "lr": np.array([lr], dtype=dtype)}
    if op_type == "momentum":
        state["v"] = RNG.normal(size=shape).astype(dtype)
    elif op_type == "adagrad":
        state["m"] = RNG.uniform(0.1, 1.0, size=shape).astype(dtype)
    elif op_type == "adam":
        state["m1"] = RNG.normal(scale=0.1, size=shape).astype(dtype)
        state["m2"] = RNG.uniform(0.0, 0.1, size=shape).astype(dtype)
        state["b1p"] = np.array([0.9**3], dtype=dtype)
        state["b2p"] = np.array([0.999**3], dtype=dtype)
    return state


# Numpy references of Fluid's formulas; scalars in the parameter's dtype, as Fluid's T.
# Float attributes are float32 in a ProgramDesc, so a float64 kernel sees 0.9 as float32(0.9).


def _attr(s, attrs, name, default):
    return s["p"].dtype.type(np.float32(attrs.get(name, default)))


def ref_sgd(s, g, attrs):
    s["p"] = s["p"] - s["lr"][0] * g


def ref_momentum(s, g, attrs):
    mu = _attr(s, attrs, "mu", None)
    g = g * _attr(s, attrs, "rescale_grad", 1.0)
    if attrs.get("regularization_method") == "l2_decay":
        g = g + _attr(s, attrs, "regularization_coeff", 0.0) * s["p"]
    s["v"] = s["v"] * mu + g
    if attrs.get("use_nesterov"):
        s["p"] = s["p"] - (g + s["v"] * mu) * s["lr"][0]
    else:
        s["p"] = s["p"] - s["lr"][0] * s["v"]


def ref_adagrad(s, g, attrs):
    s["m"] = s["m"] + g * g
    s["p"] = s["p"] - s["lr"][0] * g / (np.sqrt(s["m"]) + _attr(s, attrs, "epsilon", 1e-6))


def ref_adam(s, g, attrs, rows=None, next_powers=False):
    """Fluid's Adam; with `rows`, only those rows (lazy mode) are updated; with
    `next_powers`, bias-corrected with the powers after this step (see
    test_sparse_adam_is_the_dense_update_with_next_powers)."""
    t = s["p"].dtype.type
    b1, b2 = _attr(s, attrs, "beta1", 0.9), _attr(s, attrs, "beta2", 0.999)
    eps = _attr(s, attrs, "epsilon", 1e-8)
    b1p, b2p, one = s["b1p"][0], s["b2p"][0], t(1)
    if next_powers:
        b1p, b2p = b1p * b1, b2p * b2
    lr_t = s["lr"][0] * (np.sqrt(one - b2p) / (one - b1p))
    sel = slice(None) if rows is None else rows
    g = g if rows is None else g[rows]
    m1 = b1 * s["m1"][sel] + (one - b1) * g
    m2 = b2 * s["m2"][sel] + (one - b2) * g * g
    p = s["p"][sel] - lr_t * (m1 / (np.sqrt(m2) + eps * np.sqrt(one - b2p)))
    for name, value in (("m1", m1), ("m2", m2), ("p", p)):
        s[name] = s[name].copy()
        s[name][sel] = value
    s["b1p"], s["b2p"] = s["b1p"] * b1, s["b2p"] * b2


REFERENCES = {"sgd": ref_sgd, "momentum": ref_momentum, "adagrad": ref_adagrad, "adam": ref_adam}

DENSE_CASES = [
    ("sgd", {}),
    ("momentum", {"mu": 0.9}),
    ("momentum", {"mu": 0.8, "use_nesterov": True}),
    ("momentum", {"mu": 0.9, "regularization_method": "l2_decay", "regularization_coeff": 0.01}),
    ("momentum", {"mu": 0.9, "use_nesterov": True, "rescale_grad": 0.5}),
    ("adagrad", {"epsilon": 1e-6}),
    ("adam", {}),
    ("adam", {"beta1": 0.8, "beta2": 0.99, "epsilon": 1e-4}),
]
TOLERANCE = {"float32": {"rtol": 1e-5, "atol": 1e-6}, "float64": {"rtol": 1e-12, "atol": 1e-13}}


def _assert_state(opt, want, dtype, what):
    for name, value in want.items():
        got = opt[name]
        assert got.dtype == np.dtype(dtype), f"{what}: {name} became {got.dtype}"
        np.testing.assert_allclose(got, value, err_msg=f"{what}: {name}", **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("op_type", "attrs"), DENSE_CASES)
def test_optimizer_dense_against_fluid_formula(op_type, attrs, dtype):
    state = _state(op_type, (4, 3), dtype)
    opt = Optimizer(op_type, state, np.zeros((4, 3), dtype), attrs)
    param = opt["p"]
    want = {k: v.copy() for k, v in state.items()}
    for step in range(4):
        g = RNG.normal(size=(4, 3)).astype(dtype)
        opt.step(g)
        REFERENCES[op_type](want, g, attrs)
        _assert_state(opt, want, dtype, f"{op_type} {attrs} step {step}")
    assert opt["p"] is param, "the parameter is updated in place"


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_adam_updates_beta_pows_only_when_asked(dtype):
    state = _state("adam", (5,), dtype)
    opt = Optimizer("adam", state, np.zeros(5, dtype), pows=False)
    g = RNG.normal(size=5).astype(dtype)
    opt.step(g)
    want = {k: v.copy() for k, v in state.items()}
    ref_adam(want, g, {})
    np.testing.assert_allclose(opt["p"], want["p"], **TOLERANCE[dtype])
    np.testing.assert_array_equal(opt["b1p"], state["b1p"])
    np.testing.assert_array_equal(opt["b2p"], state["b2p"])


def test_optimizer_output_naming_another_variable_leaves_the_input():
    p, g = RNG.normal(size=(3, 2)), RNG.normal(size=(3, 2))
    v = np.zeros_like(p)
    before = p.copy()
    got = run_op(
        "momentum", {"Param": p, "Grad": g, "Velocity": v, "LearningRate": np.array(0.5)}, {"mu": 0.9}
    )
    np.testing.assert_allclose(got["ParamOut"], before - 0.5 * g)
    np.testing.assert_allclose(got["VelocityOut"], g)
    # run_op feeds these very arrays: ParamOut naming another variable leaves Param as it was.
    np.testing.assert_array_equal(p, before)
    np.testing.assert_array_equal(v, 0)


def test_learning_rate_must_hold_one_value():
    p = np.ones((2, 2), np.float32)
    state = {"p": p, "lr": np.array([0.1], np.float32)}
    opt = Optimizer("sgd", state, p)
    opt.scope["lr"] = np.array([0.1, 0.2], np.float32)
    with pytest.raises(ExecutionError, match="one value"):
        opt.step(p)


# -- sparse gradients ----------------------------------------------------------------------


def _sparse_grad(height, width, n, dtype, rows=None):
    """A SelectedRows gradient of n rows with repeats, in no particular order."""
    if rows is None:
        rows = RNG.integers(0, height, size=n)
        rows[-1] = rows[0]  # at least one repeated row
    return SelectedRows(rows, RNG.normal(size=(len(rows), width)).astype(dtype), height)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op_type", ["sgd", "adagrad"])
def test_sparse_update_equals_dense_update(op_type, dtype):
    state = _state(op_type, (20, 3), dtype)
    sparse = Optimizer(op_type, state, _sparse_grad(20, 3, 1, dtype))
    dense = Optimizer(op_type, state, np.zeros((20, 3), dtype))
    for step in range(3):
        g = _sparse_grad(20, 3, 8, dtype)
        sparse.step(g)
        dense.step(g.to_dense())
        for name in state:
            # sgd applies repeated rows one by one, the dense update their sum: rounding differs.
            np.testing.assert_allclose(
                sparse[name], dense[name], err_msg=f"{op_type} step {step}: {name}", **TOLERANCE[dtype]
            )


def _next_powers(opt, state, attrs):
    """The beta powers after opt's next step, as the scope arrays of a state."""
    return {
        "b1p": opt["b1p"] * _attr(state, attrs, "beta1", 0.9),
        "b2p": opt["b2p"] * _attr(state, attrs, "beta2", 0.999),
    }


@pytest.mark.parametrize("unique", [False, True], ids=["repeated_rows", "unique_rows"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("attrs", [{"lazy_mode": False}, {"lazy_mode": False, "beta1": 0.5, "epsilon": 1e-3}])
def test_sparse_adam_is_the_dense_update_with_next_powers(attrs, dtype, unique):
    """Non-lazy sparse Adam updates every row, as the dense update of the densified
    gradient does, but (as Fluid's sparse kernel, which writes the in-place beta powers
    before it reads them; PaddlePaddle's own numbers show it) it bias-corrects with
    the powers of the next step."""
    state = _state("adam", (20, 3), dtype)
    sparse = Optimizer("adam", state, _sparse_grad(20, 3, 1, dtype), attrs)
    # The dense op leaves its powers alone; each step gets the sparse op's next powers.
    dense = Optimizer("adam", state, np.zeros((20, 3), dtype), attrs, pows=False)
    want = {k: v.copy() for k, v in state.items()}
    for step in range(3):
        # (Rows each once, in no order, are sorted for the walk over every row, as merged ones are.)
        g = _sparse_grad(20, 3, 8, dtype, rows=RNG.permutation(20)[:8] if unique else None)
        for name, value in _next_powers(sparse, state, attrs).items():
            dense.scope[name] = value
        sparse.step(g)
        dense.step(g.to_dense())
        for name in state:
            np.testing.assert_allclose(
                sparse[name], dense[name], err_msg=f"step {step}: {name}", **TOLERANCE[dtype]
            )
        ref_adam(want, g.to_dense(), attrs, next_powers=True)
        _assert_state(sparse, want, dtype, f"sparse adam step {step}")


def test_sparse_adam_with_separate_power_outputs_uses_the_current_powers():
    # Fluid's kernel reads Beta1Pow after writing Beta1PowOut: only when they are one
    # variable does the update see the new power.
    state = _state("adam", (6, 2), "float64")
    g = _sparse_grad(6, 2, 4, "float64")
    inputs = {
        "Param": state["p"],
        "Grad": g,
        "LearningRate": state["lr"],
        "Moment1": state["m1"],
        "Moment2": state["m2"],
        "Beta1Pow": state["b1p"],
        "Beta2Pow": state["b2p"],
    }
    got = run_op("adam", inputs, {"lazy_mode": True}, outputs={"Beta1PowOut": 1, "Beta2PowOut": 1})
    want = {k: v.copy() for k, v in state.items()}
    ref_adam(want, g.to_dense(), {}, rows=np.unique(g.rows))
    for slot, name in (
        ("ParamOut", "p"),
        ("Moment1Out", "m1"),
        ("Beta1PowOut", "b1p"),
        ("Beta2PowOut", "b2p"),
    ):
        np.testing.assert_allclose(got[slot], want[name], rtol=1e-12, err_msg=slot)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(
    "attrs",
    [
        {"mu": 0.9},
        {"mu": 0.9, "use_nesterov": True},
        {"mu": 0.7, "regularization_method": "l2_decay", "regularization_coeff": 0.1, "rescale_grad": 2.0},
    ],
)
def test_sparse_momentum_updates_its_rows_like_the_dense_update(attrs, dtype):
    state = _state("momentum", (20, 3), dtype)
    touched = np.array([3, 7, 11, 19])
    state["v"][np.setdiff1d(np.arange(20), touched)] = 0
    sparse = Optimizer("momentum", state, _sparse_grad(20, 3, 1, dtype), attrs)
    dense = Optimizer("momentum", state, np.zeros((20, 3), dtype), attrs)
    untouched = np.setdiff1d(np.arange(20), touched)
    for step in range(3):
        # The same rows every step (shuffled, repeated), so that the dense update, whose
        # zero gradient rows keep velocity zero, is the lazy one there too.
        rows = RNG.permutation(np.concatenate([touched, touched[:2]]))
        g = _sparse_grad(20, 3, 0, dtype, rows=rows)
        sparse.step(g)
        dense.step(g.to_dense())
        for name in ("p", "v"):
            np.testing.assert_allclose(
                sparse[name][touched],
                dense[name][touched],
                err_msg=f"step {step}: {name}",
                **TOLERANCE[dtype],
            )
        np.testing.assert_array_equal(sparse["p"][untouched], state["p"][untouched])
        np.testing.assert_array_equal(sparse["v"][untouched], 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_lazy_adam_updates_only_its_rows(dtype):
    attrs = {"lazy_mode": True}
    state = _state("adam", (30, 4), dtype)
    lazy = Optimizer("adam", state, _sparse_grad(30, 4, 1, dtype), attrs)
    want = {k: v.copy() for k, v in state.items()}
    for step in range(3):
        g = _sparse_grad(30, 4, 6, dtype)
        before = {k: lazy[k].copy() for k in state}
        # One dense step from the same state (with the powers the sparse kernel uses).
        dense = Optimizer(
            "adam", {**before, **_next_powers(lazy, state, attrs)}, np.zeros((30, 4), dtype), {}
        )
        dense.step(g.to_dense())
        lazy.step(g)
        rows = np.unique(g.rows)
        rest = np.setdiff1d(np.arange(30), rows)
        for name in ("p", "m1", "m2"):
            np.testing.assert_array_equal(lazy[name][rest], before[name][rest], err_msg=f"{name} untouched")
            np.testing.assert_allclose(lazy[name][rows], dense[name][rows], **TOLERANCE[dtype])
        ref_adam(want, g.to_dense(), attrs, rows=rows, next_powers=True)
        _assert_state(lazy, want, dtype, f"lazy adam step {step}")


@pytest.mark.parametrize(("op_type", "attrs"), [("momentum", {"mu": 0.9}), ("adagrad", {}), ("adam", {})])
def test_duplicate_rows_are_merged(op_type, attrs):
    # The squared (adagrad, adam) or regularized terms make sum-then-update differ from
    # update-per-duplicate; merged rows must give the update of the summed gradient.
    state = _state(op_type, (6, 2), "float64")
    g = SelectedRows(np.array([4, 1, 4, 4]), RNG.normal(size=(4, 2)), 6)
    dup = Optimizer(op_type, state, g, attrs)
    merged = Optimizer(op_type, state, g, attrs)
    once = g.merged()  # each row once: applied as it came, not copied first
    given = once.value.copy()
    dup.step(g)
    merged.step(once)
    for name in state:
        np.testing.assert_array_equal(dup[name], merged[name], err_msg=name)
    np.testing.assert_array_equal(once.value, given)  # and left as it was
    # And the touched rows follow the formula with the summed gradient.
    rows = np.array([1, 4])
    want = {k: v.copy() for k, v in state.items()}
    if op_type == "adam":
        ref_adam(want, g.to_dense(), attrs, rows=rows, next_powers=True)
    else:
        REFERENCES[op_type](want, g.to_dense(), attrs)
    for name, value in want.items():
        got, value = (dup[name], value) if value.size == 1 else (dup[name][rows], value[rows])
        np.testing.assert_allclose(got, value, rtol=1e-12, atol=1e-14, err_msg=name)


@pytest.mark.parametrize(("op_type", "attrs"), [("momentum", {"mu": 0.9}), ("adam", {}), ("adagrad", {})])
def test_empty_sparse_gradient_changes_nothing(op_type, attrs):
    state = _state(op_type, (5, 2), "float32")
    opt = Optimizer(op_type, state, _sparse_grad(5, 2, 1, "float32"), attrs)
    opt.step(SelectedRows(np.zeros(0, np.int64), np.zeros((0, 2), np.float32), 5))
    for name in state:
        np.testing.assert_array_equal(opt[name], state[name], err_msg=name)


def test_sparse_gradient_must_match_the_parameter():
    state = _state("sgd", (5, 2), "float32")
    opt = Optimizer("sgd", state, _sparse_grad(5, 2, 1, "float32"))
    with pytest.raises(ExecutionError, match="does not match Param"):
        opt.step(_sparse_grad(6, 2, 3, "float32"))
