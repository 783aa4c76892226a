"""Pserver checkpoints (fluidps.io.checkpoints) and `fluidps checkpoint list / merge`."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import fluidps
from fluidps.io import TensorReader, load_vars, lod_tensor_from_bytes
from fluidps.io.checkpoints import (
    Checkpoint,
    CheckpointStore,
    assemble,
    latest,
    merge,
    merge_checkpoints,
    scan,
)

F32 = np.dtype(np.float32)


def _values(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "fc.w": rng.standard_normal((5, 3)).astype(np.float32),
        "fc.w64": rng.standard_normal((4, 2)),
        "ids": rng.integers(-(2**40), 2**40, size=7, dtype=np.int64),
        "lr": np.array(rng.standard_normal()),  # 0-d float64
        "step_i": np.array(rng.integers(0, 2**50), dtype=np.int64),  # 0-d int64
    }


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def _flip_byte(path: Path, at: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


# -- save, scan, load ---------------------------------------------------------------------


def test_save_scan_latest_load_round_trip(tmp_path: Path):
    store = CheckpointStore(tmp_path, 3, keep=5)
    saved = []
    for n in range(1, 4):
        values = _values(n)
        placements = {"fc.w": ("fc.w_orig", 10 * n), "ids": ("ids", None)}
        c = store.save(values, placements, step=100 * n, reason=f"r{n}")
        saved.append((c, values))
        assert c.count == n
        assert (tmp_path / f"pserver-3-{n:06d}.data").is_file()
        assert (tmp_path / f"pserver-3-{n:06d}.json").is_file()
        assert c.path == tmp_path / f"pserver-3-{n:06d}.json"
        assert c.data_path == tmp_path / f"pserver-3-{n:06d}.data"

    found = scan(tmp_path)
    assert [c.count for c in found] == [1, 2, 3]
    for c, (returned, values) in zip(found, saved, strict=True):
        assert c == returned
        _assert_same(c.load(), values)

    newest, problems = latest(tmp_path)
    assert problems == []
    assert list(newest) == [3]
    c, loaded = newest[3]
    assert c.count == 3 and c.step == 300 and c.reason == "r3"
    _assert_same(loaded, saved[-1][1])

    by_name = {p.name: p for p in c.pieces}
    assert (by_name["fc.w"].origin, by_name["fc.w"].offset) == ("fc.w_orig", 30)
    assert (by_name["ids"].origin, by_name["ids"].offset) == ("ids", None)
    assert (by_name["lr"].origin, by_name["lr"].offset) == ("lr", None)  # no placement: itself, whole
    assert by_name["lr"].shape == () and by_name["lr"].rows == 1
    assert by_name["fc.w"].rows == 5

    manifest = json.loads(c.path.read_text())
    assert manifest["pserver_id"] == 3
    assert manifest["count"] == 3
    assert manifest["step"] == 300
    assert manifest["reason"] == "r3"
    data_bytes = c.data_path.read_bytes()
    assert manifest["data"] == {
        "file": "pserver-3-000003.data",
        "bytes": len(data_bytes),
        "sha256": hashlib.sha256(data_bytes).hexdigest(),
    }
    entries = {v["name"]: v for v in manifest["vars"]}
    assert entries["fc.w"]["origin"] == "fc.w_orig" and entries["fc.w"]["offset"] == 30
    assert entries["fc.w"]["shape"] == [5, 3]
    assert entries["step_i"]["shape"] == [] and entries["step_i"]["offset"] is None


def test_data_file_is_paddle_tensor_records_in_manifest_order(tmp_path: Path):
    values = _values(7)
    c = CheckpointStore(tmp_path, 0).save(values, {}, step=1, reason="test")
    reader = TensorReader(c.data_path.read_bytes(), str(c.data_path))
    for piece in c.pieces:
        array, lod = reader.read_lod_tensor(piece.name)
        assert lod == []
        np.testing.assert_array_equal(array, values[piece.name])
    assert reader.at_end()


def test_save_keeps_native_byte_order_loadable(tmp_path: Path):
    """A big-endian array is stored little-endian on disk (Paddle's format); its checkpoint
    must load back with the same values."""
    value = np.arange(6, dtype=">f4").reshape(2, 3)
    c = CheckpointStore(tmp_path, 0).save({"w": value}, {}, step=1, reason="test")
    loaded = c.load()["w"]
    np.testing.assert_array_equal(loaded, value)
    assert loaded.shape == (2, 3)


def test_keep_prunes_only_this_pservers_old_checkpoints(tmp_path: Path):
    other = CheckpointStore(tmp_path, 1, keep=1).save(_values(99), {}, step=1, reason="other")
    other_files = {p: p.read_bytes() for p in (other.path, other.data_path)}
    keep = 2
    store = CheckpointStore(tmp_path, 0, keep=keep)
    saved = {}
    for n in range(1, keep + 3):
        saved[n] = _values(n)
        store.save(saved[n], {}, step=n, reason="periodic")
    mine = [c for c in scan(tmp_path) if c.pserver_id == 0]
    assert [c.count for c in mine] == [keep + 1, keep + 2]
    for c in mine:
        _assert_same(c.load(), saved[c.count])
    for n in range(1, keep + 1):
        assert not (tmp_path / f"pserver-0-{n:06d}.json").exists()
        assert not (tmp_path / f"pserver-0-{n:06d}.data").exists()
    for path, data in other_files.items():
        assert path.read_bytes() == data
    assert [c.count for c in scan(tmp_path) if c.pserver_id == 1] == [1]


def test_keep_must_be_positive(tmp_path: Path):
    with pytest.raises(fluidps.CheckpointError, match="keep"):
        CheckpointStore(tmp_path, 0, keep=0)


def test_next_save_removes_this_pservers_stray_temporary_files(tmp_path: Path):
    store = CheckpointStore(tmp_path, 1, keep=3)
    store.save(_values(1), {}, step=1, reason="periodic")
    mine = [tmp_path / ".pserver-1-000002.data.0123456789ab.tmp", tmp_path / ".pserver-1-000002.json.ab.tmp"]
    others = [
        tmp_path / ".pserver-0-000002.data.0123456789ab.tmp",
        tmp_path / ".pserver-10-000001.data.x.tmp",
    ]
    for path in mine + others:
        path.write_bytes(b"half a checkpoint")
    c = store.save(_values(2), {}, step=2, reason="periodic")
    assert c.count == 2
    for path in mine:
        assert not path.exists(), path
    for path in others:  # another pserver's write may be in flight
        assert path.exists(), path
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".pserver-1-")]


# -- corruption ----------------------------------------------------------------------------


def test_corrupt_data_file_is_detected_and_latest_falls_back(tmp_path: Path):
    store = CheckpointStore(tmp_path, 0)
    first = _values(1)
    store.save(first, {}, step=1, reason="periodic")
    bad = store.save(_values(2), {}, step=2, reason="periodic")
    _flip_byte(bad.data_path)
    actual = hashlib.sha256(bad.data_path.read_bytes()).hexdigest()
    assert actual != bad.sha256

    with pytest.raises(fluidps.CheckpointError) as err:
        bad.load()
    message = str(err.value)
    assert "pserver-0-000002" in message and "is corrupt" in message
    assert str(bad.data_path) in message
    assert actual in message and bad.sha256 in message

    newest, problems = latest(tmp_path)
    c, values = newest[0]
    assert c.count == 1
    _assert_same(values, first)
    assert len(problems) == 1
    assert "pserver-0-000002" in problems[0] and "is corrupt" in problems[0]


def test_truncated_data_file_is_incomplete(tmp_path: Path):
    store = CheckpointStore(tmp_path, 0)
    first = _values(1)
    store.save(first, {}, step=1, reason="periodic")
    bad = store.save(_values(2), {}, step=2, reason="periodic")
    data = bad.data_path.read_bytes()
    bad.data_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(fluidps.CheckpointError, match=r"pserver-0-000002\.json is incomplete"):
        bad.load()
    newest, problems = latest(tmp_path)
    assert newest[0][0].count == 1
    _assert_same(newest[0][1], first)
    assert any("pserver-0-000002" in p and "is incomplete" in p for p in problems)


def test_missing_data_file_is_reported(tmp_path: Path):
    store = CheckpointStore(tmp_path, 0)
    store.save(_values(1), {}, step=1, reason="periodic")
    bad = store.save(_values(2), {}, step=2, reason="periodic")
    bad.data_path.unlink()
    with pytest.raises(fluidps.CheckpointError, match="cannot read"):
        bad.load()
    newest, problems = latest(tmp_path)
    assert newest[0][0].count == 1
    assert any("pserver-0-000002" in p for p in problems)


def _edit_manifest(edit: Callable[[dict, Path], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        body = json.loads(path.read_text())
        edit(body, path.parent)
        path.write_text(json.dumps(body))

    return damage


def _point_outside(relative: bool) -> Callable[[dict, Path], None]:
    def edit(body: dict, directory: Path) -> None:
        # An intact copy of the data outside the directory: only the path check can refuse it.
        outside = directory.parent / "outside.data"
        shutil.copy(directory / body["data"]["file"], outside)
        body["data"]["file"] = "../outside.data" if relative else str(outside)

    return edit


DAMAGES: dict[str, Callable[[Path], None]] = {
    "bad json": lambda path: path.write_text(path.read_text()[:-20]),
    "not an object": lambda path: path.write_text("[1, 2, 3]"),
    "wrong format": _edit_manifest(lambda b, _: b.update(format="something-else")),
    "wrong version": _edit_manifest(lambda b, _: b.update(version=2)),
    "negative offset": _edit_manifest(lambda b, _: b["vars"][0].update(offset=-3)),
    "negative dim": _edit_manifest(lambda b, _: b["vars"][0].update(shape=[-1, 3])),
    "bad dtype": _edit_manifest(lambda b, _: b["vars"][0].update(dtype="not-a-dtype")),
    "no data": _edit_manifest(lambda b, _: b.pop("data")),
    "data path escapes": _edit_manifest(_point_outside(relative=True)),
    "absolute data path": _edit_manifest(_point_outside(relative=False)),
    "dtype lies": _edit_manifest(lambda b, _: b["vars"][0].update(dtype="<f8")),
    "shape lies": _edit_manifest(lambda b, _: b["vars"][0].update(shape=[3, 5])),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_damaged_manifest_is_a_problem_not_a_crash(tmp_path: Path, damage: str):
    directory = tmp_path / "ckpt"
    store = CheckpointStore(directory, 0)
    first = _values(1)
    store.save(first, {"fc.w": ("fc.w", 0)}, step=1, reason="periodic")
    bad = store.save(_values(2), {"fc.w": ("fc.w", 0)}, step=2, reason="periodic")
    assert bad.pieces[0].name == "fc.w"
    DAMAGES[damage](bad.path)

    newest, problems = latest(directory)
    assert list(newest) == [0]
    c, values = newest[0]
    assert c.count == 1
    _assert_same(values, first)
    assert any("pserver-0-000002.json" in p for p in problems), problems


# -- assemble: restoring, resharding ---------------------------------------------------------

W = np.random.default_rng(5).standard_normal((64, 8)).astype(np.float32)
BETA = np.array([0.9**3], dtype=np.float32)


def _two_pservers(directory: Path, w: np.ndarray = W, step: int = 10) -> list[Checkpoint]:
    """A 2-pserver job's checkpoints: rows [0, 30) and [30, 64) of `w`, and a whole copy of
    its beta1 power accumulator on each."""
    a = CheckpointStore(directory, 0).save(
        {"w.block0": w[:30], "w_beta1_pow_acc_0": BETA},
        {"w.block0": ("w", 0, len(w))},  # as pservers record them: origin, offset, its rows
        step=step,
        reason="periodic",
    )
    b = CheckpointStore(directory, 1).save(
        {"w.block1": w[30:], "w_beta1_pow_acc_0": BETA},
        {"w.block1": ("w", 30, len(w))},
        step=step,
        reason="periodic",
    )
    return [a, b]


def _sources(directory: Path):
    newest, problems = latest(directory)
    assert problems == []
    return sorted(newest.values(), key=lambda cv: cv[0].created, reverse=True)


def test_assemble_reshards_two_pservers_into_three(tmp_path: Path):
    _two_pservers(tmp_path)
    cuts = [(0, 22), (22, 44), (44, 64)]
    wanted = [(f"w.block{i}", "w", lo, (hi - lo, 8), F32) for i, (lo, hi) in enumerate(cuts)]
    wanted.append(("w_beta1_pow_acc_0", "w_beta1_pow_acc_0", None, (1,), F32))
    out = assemble(wanted, _sources(tmp_path))
    assert sorted(out) == ["w.block0", "w.block1", "w.block2", "w_beta1_pow_acc_0"]
    for i, (lo, hi) in enumerate(cuts):
        assert out[f"w.block{i}"].dtype == np.float32
        np.testing.assert_array_equal(out[f"w.block{i}"], W[lo:hi])
    np.testing.assert_array_equal(out["w_beta1_pow_acc_0"], BETA)


def test_assemble_whole_variable_and_same_layout(tmp_path: Path):
    _two_pservers(tmp_path)
    sources = _sources(tmp_path)
    whole = assemble([("w", "w", None, (64, 8), F32)], sources)
    np.testing.assert_array_equal(whole["w"], W)
    same = assemble([("w.block1", "w", 30, (34, 8), F32), ("w.block0", "w", 0, (30, 8), F32)], sources)
    np.testing.assert_array_equal(same["w.block0"], W[:30])
    np.testing.assert_array_equal(same["w.block1"], W[30:])


def test_assemble_returns_copies(tmp_path: Path):
    _two_pservers(tmp_path)
    sources = _sources(tmp_path)
    out = assemble([("w.block0", "w", 0, (30, 8), F32)], sources)
    out["w.block0"][:] = 0
    again = assemble([("w.block0", "w", 0, (30, 8), F32)], sources)
    np.testing.assert_array_equal(again["w.block0"], W[:30])


def test_assemble_names_the_missing_row(tmp_path: Path):
    first, _ = _two_pservers(tmp_path)
    only_first = [(first, first.load())]
    with pytest.raises(fluidps.CheckpointError, match=r"row 30 of 'w'"):
        assemble([("w.block1", "w", 22, (22, 8), F32)], only_first)
    with pytest.raises(fluidps.CheckpointError, match=r"'w'"):
        assemble([("w", "w", None, (64, 8), F32)], only_first)
    with pytest.raises(fluidps.CheckpointError, match=r"'emb'.*'emb.block0'"):
        assemble([("emb.block0", "emb", 0, (4, 8), F32)], only_first)


def test_assemble_missing_row_in_the_middle(tmp_path: Path):
    c = CheckpointStore(tmp_path, 0).save(
        {"w.a": W[:10], "w.b": W[20:]}, {"w.a": ("w", 0), "w.b": ("w", 20)}, step=1, reason="x"
    )
    with pytest.raises(fluidps.CheckpointError, match=r"row 10 of 'w'"):
        assemble([("w", "w", None, (64, 8), F32)], [(c, c.load())])


def test_assemble_newest_source_wins_where_rows_overlap(tmp_path: Path):
    old_dir, new_dir = tmp_path / "old", tmp_path / "new"
    old = _two_pservers(old_dir, W)
    w2 = W + 1000
    a = CheckpointStore(new_dir, 0).save({"w.block0": w2[:32]}, {"w.block0": ("w", 0)}, step=20, reason="x")
    b = CheckpointStore(new_dir, 1).save({"w.block1": w2[32:]}, {"w.block1": ("w", 32)}, step=20, reason="x")
    new_sources = [(c, c.load()) for c in (a, b)]
    old_sources = [(c, c.load()) for c in old]
    wanted = [("w.block0", "w", 0, (22, 8), F32), ("w.block1", "w", 22, (42, 8), F32)]
    newer_first = assemble(wanted, new_sources + old_sources)
    np.testing.assert_array_equal(np.concatenate([newer_first["w.block0"], newer_first["w.block1"]]), w2)
    older_first = assemble(wanted, old_sources + new_sources)
    np.testing.assert_array_equal(np.concatenate([older_first["w.block0"], older_first["w.block1"]]), W)


def test_assemble_newest_sliced_source_wins_over_an_older_whole_copy(tmp_path: Path):
    """A job shrank: the old job kept `w` whole on pserver 2, the new one slices it over
    pservers 0 and 1. The newest rows (listed first) must win, also over a whole copy."""
    old = CheckpointStore(tmp_path / "old", 2).save({"w": W}, {}, step=5, reason="old layout")
    w2 = W + 1000
    new = _two_pservers(tmp_path / "new", w2, step=50)
    sources = [(c, c.load()) for c in new] + [(old, old.load())]
    out = assemble([("w", "w", None, (64, 8), F32), ("w.block1", "w", 30, (34, 8), F32)], sources)
    np.testing.assert_array_equal(out["w"], w2)
    np.testing.assert_array_equal(out["w.block1"], w2[30:])
    np.testing.assert_array_equal(merge(sources)["w"], w2)


def test_assemble_whole_source_serves_any_slice(tmp_path: Path):
    c = CheckpointStore(tmp_path, 0).save({"w": W}, {}, step=1, reason="x")
    out = assemble([("w.block2", "w", 44, (20, 8), F32)], [(c, c.load())])
    np.testing.assert_array_equal(out["w.block2"], W[44:])


def test_assemble_shape_or_dtype_mismatch(tmp_path: Path):
    _two_pservers(tmp_path)
    sources = _sources(tmp_path)
    with pytest.raises(fluidps.CheckpointError, match=r"'w'.*float64"):
        assemble([("w", "w", None, (64, 8), np.dtype(np.float64))], sources)
    with pytest.raises(fluidps.CheckpointError, match=r"'w'"):
        assemble([("w", "w", None, (64, 4), F32)], sources)
    with pytest.raises(fluidps.CheckpointError, match=r"w_beta1_pow_acc_0"):
        assemble([("w_beta1_pow_acc_0", "w_beta1_pow_acc_0", None, (2,), F32)], sources)


# -- merge -------------------------------------------------------------------------------


def test_merge_gives_whole_variables(tmp_path: Path):
    _two_pservers(tmp_path)
    merged = merge(_sources(tmp_path))
    assert sorted(merged) == ["w", "w_beta1_pow_acc_0"]
    np.testing.assert_array_equal(merged["w"], W)
    assert merged["w"].dtype == np.float32
    np.testing.assert_array_equal(merged["w_beta1_pow_acc_0"], BETA)


def test_merge_checkpoints_writes_paddle_files(tmp_path: Path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "model"
    _two_pservers(ckpt)
    values = merge_checkpoints(ckpt, out)
    np.testing.assert_array_equal(values["w"], W)
    assert sorted(p.name for p in out.iterdir()) == ["w", "w_beta1_pow_acc_0"]
    array, lod = lod_tensor_from_bytes((out / "w").read_bytes())
    assert lod == [] and array.dtype == np.float32
    np.testing.assert_array_equal(array, W)

    program = fluidps.Program()
    block = program.global_block()
    block.create_var("w", shape=[64, 8], dtype="float32", persistable=True)
    block.create_var("w_beta1_pow_acc_0", shape=[1], dtype="float32", persistable=True)
    scope = fluidps.Scope()
    load_vars(None, out, program, vars=["w", "w_beta1_pow_acc_0"], scope=scope)
    np.testing.assert_array_equal(scope["w"], W)
    np.testing.assert_array_equal(scope["w_beta1_pow_acc_0"], BETA)


def test_merge_checkpoints_without_out_dir_writes_nothing(tmp_path: Path):
    _two_pservers(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    values = merge_checkpoints(tmp_path)
    np.testing.assert_array_equal(values["w"], W)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_merge_checkpoints_uses_the_newest_intact_ones(tmp_path: Path):
    _two_pservers(tmp_path, W, step=1)
    newer = _two_pservers(tmp_path, W + 1, step=2)
    _flip_byte(newer[1].data_path)
    values = merge_checkpoints(tmp_path)
    np.testing.assert_array_equal(values["w"][:30], W[:30] + 1)
    np.testing.assert_array_equal(values["w"][30:], W[30:])


def test_merge_checkpoints_without_intact_checkpoint(tmp_path: Path):
    with pytest.raises(fluidps.CheckpointError, match="no intact"):
        merge_checkpoints(tmp_path / "nothing")
    c = CheckpointStore(tmp_path, 0).save({"w": W}, {}, step=1, reason="x")
    _flip_byte(c.data_path)
    with pytest.raises(fluidps.CheckpointError, match=r"no intact.*pserver-0-000001.*is corrupt"):
        merge_checkpoints(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_merge_checkpoints_refuses_when_a_pservers_rows_are_lost(tmp_path: Path):
    """Pserver 1's only checkpoint (rows 30..63 of w) is corrupt: the merged model would
    lack those rows, which must be an error, not a silently shorter `w`."""
    _, second = _two_pservers(tmp_path)
    _flip_byte(second.data_path)
    try:
        values = merge_checkpoints(tmp_path)
    except fluidps.CheckpointError as e:
        assert "row 30 of 'w'" in str(e) and "pserver-1-000001" in str(e)
    else:
        pytest.fail(f"merge_checkpoints returned w with shape {list(values['w'].shape)}, not [64, 8]")


# -- the command line ------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", "checkpoint", *args], capture_output=True, text=True, timeout=120
    )


def test_cli_list(tmp_path: Path):
    _two_pservers(tmp_path, W, step=1)
    _two_pservers(tmp_path, W, step=2)
    result = _cli("list", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    found = scan(tmp_path)
    assert len(lines) == len(found) == 4
    for line, c in zip(lines, found, strict=True):
        assert line.startswith(f"pserver {c.pserver_id} #{c.count}")
        assert line.rstrip().endswith("ok")
        assert "BAD" not in line


def test_cli_list_reports_a_corrupt_checkpoint(tmp_path: Path):
    _two_pservers(tmp_path, W, step=1)
    _, bad = _two_pservers(tmp_path, W, step=2)
    _flip_byte(bad.data_path)
    result = _cli("list", str(tmp_path))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 4
    bad_lines = [line for line in lines if "BAD" in line]
    assert len(bad_lines) == 1
    assert bad_lines[0].startswith("pserver 1 #2") and "is corrupt" in bad_lines[0]
    assert sum(line.rstrip().endswith("ok") for line in lines) == 3


def test_cli_list_empty_directory(tmp_path: Path):
    result = _cli("list", str(tmp_path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert str(tmp_path) in result.stderr


def test_cli_merge(tmp_path: Path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "model"
    _two_pservers(ckpt)
    result = _cli("merge", str(ckpt), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert "wrote 2 variables" in result.stdout
    np.testing.assert_array_equal(lod_tensor_from_bytes((out / "w").read_bytes())[0], W)
    np.testing.assert_array_equal(lod_tensor_from_bytes((out / "w_beta1_pow_acc_0").read_bytes())[0], BETA)

    empty = _cli("merge", str(tmp_path / "none"), "-o", str(tmp_path / "x"))
    assert empty.returncode == 2
    assert len(empty.stderr.strip().splitlines()) == 1 and "no intact" in empty.stderr


def test_a_count_is_never_written_twice_even_past_an_unreadable_manifest(tmp_path):
    store = CheckpointStore(tmp_path, 0)
    store.save({"w": np.zeros(2, np.float32)}, {}, 1, "test")
    (tmp_path / "pserver-0-000002.json").write_text("{not json")  # a damaged newest manifest
    assert store.save({"w": np.ones(2, np.float32)}, {}, 2, "test").count == 3
