"""A batch's ids kept once (unique_ids) and a gradient's repeated rows summed (sum_rows):
what a distributed table's trainer does before asking for rows and before sending its
gradient. Both must agree with the sort-based versions exactly, whatever the ids."""

from __future__ import annotations

import numpy as np
import pytest
from optest import run_op

from fluidps.ops.selected_rows import SelectedRows, merge_rows, sum_rows, unique_ids

RNG = np.random.default_rng(5)

ID_CASES = {
    "zipf": (RNG.zipf(1.3, 5000) % 100_000).astype(np.int64),
    "feature hashes": RNG.integers(0, 2**63 - 1, 3000, dtype=np.int64).repeat(3),
    # Ids that share their low bits (a weak hash would put them all in one slot).
    "multiples of 2**32": (np.arange(2000, dtype=np.int64) % 700) << 32,
    "one id": np.full(1000, 42, dtype=np.int64),
    "all distinct": RNG.permutation(4096).astype(np.int64),
    "empty": np.zeros(0, dtype=np.int64),
}


@pytest.mark.parametrize("name", sorted(ID_CASES))
def test_unique_ids_keeps_each_id_once_in_first_seen_order(name):
    ids = ID_CASES[name]
    unique, inverse = unique_ids(ids)
    np.testing.assert_array_equal(np.sort(unique), np.unique(ids))
    np.testing.assert_array_equal(unique[inverse], ids)
    _, first = np.unique(ids, return_index=True)
    np.testing.assert_array_equal(unique, ids[np.sort(first)])


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(ID_CASES))
def test_sum_rows_and_merge_rows_add_repeats_in_order_bit_for_bit(name, dtype):
    ids = ID_CASES[name]
    value = RNG.normal(size=(len(ids), 3)).astype(dtype)
    unique, inverse = unique_ids(ids)
    summed = sum_rows(inverse, len(unique), value)
    merged_rows, merged = merge_rows(ids, value)  # sorted rows; repeats added in order
    order = np.argsort(unique)
    np.testing.assert_array_equal(unique[order], merged_rows)
    np.testing.assert_array_equal(summed[order], merged)
    # np.add.at adds each repeat in turn, from zeros: the sums an optimizer's merge makes.
    expected = np.zeros_like(merged)
    np.add.at(expected, np.searchsorted(merged_rows, ids), value)
    np.testing.assert_array_equal(merged, expected)


@pytest.mark.parametrize(("shape", "pad"), [((6, 4), -1), ((6, 4), 3), ((30,), 0)])
def test_the_distributed_lookup_gradient_sums_repeated_rows_when_told(shape, pad):
    """With sum_repeated_rows each row comes once and the gradient is the same tensor."""
    ids = RNG.integers(0, 8, size=shape).astype(np.int64)
    ids.reshape(-1)[::4] = max(pad, 0)
    dout = RNG.normal(size=(*shape, 3)).astype(np.float32)
    attrs = {
        "table_name": "emb",
        "table_names": ["emb.block0", "emb.block1"],
        "endpoints": ["127.0.0.1:1", "127.0.0.1:2"],
        "height_sections": [5, 3],
        "padding_idx": pad,
        "lookup_table_version": "lookup_table_v2",
    }
    grads = {}
    for summed in (False, True):
        got = run_op(
            "distributed_lookup_table_grad",
            {"Ids": ids, "Outputs@GRAD": dout},
            attrs | {"sum_repeated_rows": summed},
            outputs={"W@GRAD": 1},
        )
        grads[summed] = got["W@GRAD"]
    kept = ids.reshape(-1)[ids.reshape(-1) != pad]
    assert isinstance(grads[True], SelectedRows) and grads[True].height == 8
    np.testing.assert_array_equal(grads[False].rows, kept)  # every looked-up row, repeats too
    np.testing.assert_array_equal(np.sort(grads[True].rows), np.unique(kept))  # each row once
    np.testing.assert_array_equal(grads[True].to_dense(), grads[False].to_dense())


@pytest.mark.parametrize(("shape", "pad"), [((6, 4), -1), ((6, 4), 3)])
def test_the_distributed_lookup_gradient_sums_by_the_ids_its_lookup_found(shape, pad):
    """Given the forward op's UniqueIds / UniqueIndex, the grad op sums by them (its rows
    are those ids, in their order) instead of finding them again: the same tensor. An
    index that does not fit the gradient is refused, naming both."""
    ids = RNG.integers(0, 8, size=shape).astype(np.int64)
    ids.reshape(-1)[::4] = max(pad, 0)
    dout = RNG.normal(size=(*shape, 3)).astype(np.float32)
    attrs = {
        "table_name": "emb",
        "table_names": ["emb.block0"],
        "endpoints": ["127.0.0.1:1"],
        "height_sections": [8],
        "padding_idx": pad,
        "lookup_table_version": "lookup_table_v2",
        "sum_repeated_rows": True,
    }
    kept = ids.reshape(-1)[ids.reshape(-1) != pad]
    found = unique_ids(kept[::-1].copy())[0]  # another order than the batch's: it is theirs
    index = np.searchsorted(np.sort(found), kept)
    index = np.argsort(found)[index]  # kept[i] == found[index[i]]
    inputs = {"Ids": ids, "Outputs@GRAD": dout, "UniqueIds": found, "UniqueIndex": index}
    got = run_op("distributed_lookup_table_grad", inputs, attrs, outputs={"W@GRAD": 1})["W@GRAD"]
    plain = run_op(
        "distributed_lookup_table_grad", {"Ids": ids, "Outputs@GRAD": dout}, attrs, outputs={"W@GRAD": 1}
    )["W@GRAD"]
    np.testing.assert_array_equal(got.rows, found)
    np.testing.assert_array_equal(got.to_dense(), plain.to_dense())
    with pytest.raises(Exception, match=r"UniqueIndex .* places 3 ids, the gradient has \d+ rows"):
        run_op(
            "distributed_lookup_table_grad", inputs | {"UniqueIndex": index[:3]}, attrs, outputs={"W@GRAD": 1}
        )
