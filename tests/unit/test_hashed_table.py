"""HashedTable: the numba open-addressing index and dense rows behind auto-growing
embedding tables, checked against a dict, and its id-keyed initial values."""

from __future__ import annotations

import numpy as np
import pytest

from fluidps.ops.hashed_table import HashedTable, IdIndex, initial_rows


def test_adds_and_removes_match_a_dict_and_rows_stay_dense():
    rng = np.random.default_rng(0)
    table, model = HashedTable(dim=3, state_width=2, capacity=16), {}
    for step in range(400):
        ids = np.unique(rng.integers(0, 3000, rng.integers(1, 120)))
        new = ids[table.rows_of(ids) < 0]
        values = rng.normal(size=(len(new), 3)).astype(np.float32)
        rows = table.add(new, values)
        table.state[rows] = values[:, :2] * 2  # state and counters move with their rows
        table.updated[rows] = step
        model.update({int(i): (v, step) for i, v in zip(new, values, strict=True)})
        if step % 3 == 0:
            gone = np.unique(rng.integers(0, 3000, 60))
            table.remove(gone)
            for i in gone:
                model.pop(int(i), None)
        assert len(table) == len(model)
    ids = np.array(sorted(model), dtype=np.int64)
    rows = table.rows_of(ids)
    assert sorted(rows.tolist()) == list(range(len(model)))  # dense: rows 0..n-1, each once
    np.testing.assert_array_equal(table.ids[rows], ids)
    np.testing.assert_array_equal(table.values[rows], [model[i][0] for i in ids.tolist()])
    np.testing.assert_array_equal(table.state[rows], [model[i][0][:2] * 2 for i in ids.tolist()])
    np.testing.assert_array_equal(table.updated[rows], [model[i][1] for i in ids.tolist()])
    absent = np.setdiff1d(np.arange(3000), ids)
    assert (table.rows_of(absent) == -1).all()
    assert table.index.count == len(model) and len(table.index.keys) >= len(model) / 0.7


def test_removing_in_a_long_probe_chain_keeps_every_other_id_reachable():
    index = IdIndex(capacity=16)  # small, so that many ids share probe chains
    ids = np.arange(0, 11, dtype=np.int64) * 1024
    index.add(ids, 0)
    from fluidps.ops.hashed_table import remove

    table_ids = ids.copy()
    for k, gone in enumerate(ids[::2]):
        n, _, _ = remove(index.keys, index.rows, np.array([gone]), table_ids, len(ids) - k)
        left = table_ids[:n]
        rows = index.find(left)
        np.testing.assert_array_equal(table_ids[rows], left)
        assert (index.find(np.array([gone])) == -1).all()


def test_initial_rows_depend_only_on_seed_and_id():
    ids = np.array([3, 2**40 + 17, 0, 3, 999_999_999_999], dtype=np.int64)
    out = np.empty((5, 6), np.float32)
    initial_rows(ids, 6, 11, False, -0.5, 0.5, out)
    np.testing.assert_array_equal(out[0], out[3])  # the same id, the same row
    shuffled = np.empty((5, 6), np.float32)
    initial_rows(ids[::-1].copy(), 6, 11, False, -0.5, 0.5, shuffled)
    np.testing.assert_array_equal(shuffled[::-1], out)  # whatever order ids come in
    other_seed = np.empty((5, 6), np.float32)
    initial_rows(ids, 6, 12, False, -0.5, 0.5, other_seed)
    assert not np.array_equal(other_seed, out)
    assert len({tuple(r) for r in out.tolist()}) == 4  # distinct ids, distinct rows


@pytest.mark.parametrize("normal", [False, True])
def test_initial_rows_follow_their_distribution(normal):
    ids = np.arange(20_000, dtype=np.int64) * 7919
    out = np.empty((len(ids), 8), np.float64)
    if normal:
        initial_rows(ids, 8, 1, True, 0.25, 2.0, out)
        assert abs(out.mean() - 0.25) < 0.03 and abs(out.std() - 2.0) < 0.03
    else:
        initial_rows(ids, 8, 1, False, -0.1, 0.3, out)
        assert out.min() >= -0.1 and out.max() < 0.3
        assert abs(out.mean() - 0.1) < 0.005
        counts, _ = np.histogram(out, bins=10, range=(-0.1, 0.3))
        assert counts.min() > 0.9 * counts.mean()


def test_memory_grows_with_the_ids_held_not_the_id_space():
    rng = np.random.default_rng(1)
    ids = np.unique(rng.integers(0, 2**40, 200_000))
    table = HashedTable(dim=8, state_width=16)
    values = np.zeros((len(ids), 8), np.float32)
    for chunk in np.array_split(np.arange(len(ids)), 20):
        table.add(ids[chunk], values[chunk])
    ideal = len(ids) * (8 + 16) * 4
    assert ideal < table.nbytes < 2 * ideal


def _dense_reference(rule, p, g_steps, lr, eps=1e-6, beta1=0.9, beta2=0.999, l1=0.01, l2=0.1):
    """The same updates of one row in float64 numpy, step by step."""
    p = p.astype(np.float64).copy()
    m1 = np.zeros_like(p)
    m2 = np.zeros_like(p)
    b1p, b2p = beta1, beta2
    for g in g_steps:
        g = g.astype(np.float64)
        if rule == "sgd":
            p -= lr * g
        elif rule == "adagrad":
            m1 += g * g
            p -= lr * g / (np.sqrt(m1) + eps)
        elif rule == "adam":
            m1 = beta1 * m1 + (1 - beta1) * g
            m2 = beta2 * m2 + (1 - beta2) * g * g
            p -= lr * np.sqrt(1 - b2p) / (1 - b1p) * m1 / (np.sqrt(m2) + eps * np.sqrt(1 - b2p))
            b1p, b2p = b1p * beta1, b2p * beta2
        else:
            new = m1 + g * g
            m2 = m2 + g - (np.sqrt(new) - np.sqrt(m1)) / lr * p
            p = np.where(np.abs(m2) > l1, (l1 * np.sign(m2) - m2) / (np.sqrt(new) / lr + 2 * l2), 0.0)
            m1 = new
    return p


@pytest.mark.parametrize("rule", ["sgd", "adagrad", "adam", "ftrl"])
def test_row_rules_update_each_row_by_its_own_history(rule):
    """Rows updated a different number of times each follow their own rule (Adam: their
    own bias correction), as a per-row float64 reference says."""
    from fluidps.ops.hashed_table import RULES, initial_state, state_width, update_rows

    rng = np.random.default_rng(2)
    dim, ids = 4, np.array([10, 2**35, 7], dtype=np.int64)
    table = HashedTable(dim, state_width(rule, dim))
    start = rng.normal(size=(3, dim)).astype(np.float32)
    rows = table.add(ids, start)
    table.state[rows] = initial_state(rule, dim, 3, np.float32, 0.9, 0.999)
    history = {int(i): [] for i in ids}
    f32 = np.float32
    for step in range(6):
        touched = ids[: 1 + step % 3]  # id 10 every step, 2**35 on two of three, 7 on one of three
        g = rng.normal(size=(len(touched), dim)).astype(np.float32)
        update_rows(
            RULES.index(rule), table.values, table.state, table.rows_of(touched), g,
            f32(0.1), f32(1e-6), f32(0.9), f32(0.999), f32(0.01), f32(0.1),
        )  # fmt: skip
        for i, gi in zip(touched.tolist(), g, strict=True):
            history[i].append(gi)
    for k, i in enumerate(ids.tolist()):
        want = _dense_reference(rule, start[k], history[i], 0.1)
        np.testing.assert_allclose(table.values[table.rows_of(np.array([i]))[0]], want, rtol=2e-5, atol=2e-6)
