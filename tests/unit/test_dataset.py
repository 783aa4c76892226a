"""fluidps.io.Dataset and `fluidps data`: shards in three formats, tasks, checksums, errors."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fluidps.errors import DatasetError
from fluidps.io import Dataset


def records(n: int = 1000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "image": rng.random((n, 8), dtype=np.float32),
        "label": np.arange(n, dtype=np.int64).reshape(-1, 1),  # a record's label is its index
        "weight": rng.random(n).astype(np.float64),
    }


def fluidps_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("fmt", ["npz", "npy", "parquet"])
def test_write_then_read_every_record_back_through_tasks(tmp_path, fmt):
    data = records()
    dataset = Dataset.write(tmp_path / "ds", data, records_per_shard=300, format=fmt)
    assert [s.records for s in dataset.shards] == [300, 300, 300, 100] and dataset.records == 1000
    assert {f.name: (f.dtype, f.shape) for f in dataset.fields.values()} == {
        "image": (np.float32, (8,)),
        "label": (np.int64, (1,)),
        "weight": (np.float64, ()),
    }
    tasks = dataset.tasks(64)
    assert all(t.records <= 64 for t in tasks) and len(tasks) == 5 + 5 + 5 + 2  # never across shards
    seen = np.concatenate([dataset.read_task(t)["label"][:, 0] for t in tasks])
    np.testing.assert_array_equal(seen, np.arange(1000))  # every record once, in order
    task = tasks[6]  # shard 1, records 64..127
    part = dataset.read_task(task)
    start = 300 * task.shard + task.start
    np.testing.assert_array_equal(part["image"], data["image"][start : start + task.records])
    np.testing.assert_array_equal(part["weight"], data["weight"][start : start + task.records])


@pytest.mark.parametrize("fmt", ["npz", "npy", "parquet"])
def test_shards_without_a_manifest_are_found_and_described(tmp_path, fmt):
    Dataset.write(tmp_path / "ds", records(500), records_per_shard=200, format=fmt)
    (tmp_path / "ds" / "dataset.json").unlink()
    dataset = Dataset(tmp_path / "ds")
    assert [s.records for s in dataset.shards] == [200, 200, 100]
    assert dataset.read(2, 0, 3)["label"][:, 0].tolist() == [400, 401, 402]


def test_fingerprint_tells_datasets_apart_and_is_stable(tmp_path):
    a = Dataset.write(tmp_path / "a", records(100), 50)
    again = Dataset(tmp_path / "a")
    other = Dataset.write(tmp_path / "b", records(100), 40)
    assert a.fingerprint == again.fingerprint != other.fingerprint


def test_a_corrupt_shard_is_detected_by_its_checksum(tmp_path):
    dataset = Dataset.write(tmp_path / "ds", records(100), 50)
    shard = tmp_path / "ds" / dataset.shards[1].file
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    reopened = Dataset(tmp_path / "ds")
    reopened.read(0, 0, 10)  # shard 0 is fine
    with pytest.raises(DatasetError, match=r"part-00001\.npz is corrupt: its sha256 is"):
        reopened.read(1, 0, 10)


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda m: m.update(format="other"), "is not a version 1 fluidps-dataset manifest"),
        (lambda m: m["fields"][0].update(dtype="O"), "fields hold numbers or booleans"),
        (lambda m: m["fields"][0].update(shape=[-1]), "invalid shape"),
        (lambda m: m["shards"][0].update(file="../escape.npz"), "must be a .npz, .npy or .parquet file in"),
        (lambda m: m["shards"][0].update(records="10"), "'records' must be a int"),
        (lambda m: m.update(fields=[]), "lists no fields"),
    ],
)
def test_a_bad_manifest_is_refused_with_a_clear_error(tmp_path, mutate, message):
    Dataset.write(tmp_path / "ds", records(100), 50)
    path = tmp_path / "ds" / "dataset.json"
    manifest = json.loads(path.read_text())
    mutate(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(DatasetError, match=message):
        Dataset(tmp_path / "ds")


def test_reading_outside_the_data_and_bad_arguments_are_errors(tmp_path):
    dataset = Dataset.write(tmp_path / "ds", records(100), 50)
    with pytest.raises(DatasetError, match="has no shard 5"):
        dataset.read(5, 0, 1)
    with pytest.raises(DatasetError, match=r"records 40\.\.60 are outside shard 0"):
        dataset.read(0, 40, 60)
    with pytest.raises(DatasetError, match="records_per_task must be >= 1"):
        dataset.tasks(0)
    with pytest.raises(DatasetError, match="is not empty"):
        Dataset.write(tmp_path / "ds", records(10), 5)
    with pytest.raises(DatasetError, match="every field needs one row per record"):
        Dataset.write(tmp_path / "x", {"a": np.zeros(3), "b": np.zeros(4)}, 2)
    with pytest.raises(DatasetError, match="is not a directory"):
        Dataset(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="has no shards"):
        Dataset(tmp_path / "empty")


def test_a_shard_that_disagrees_with_the_manifest_is_refused(tmp_path):
    dataset = Dataset.write(tmp_path / "ds", records(100), 50, format="npz")
    np.savez(tmp_path / "ds" / dataset.shards[0].file, image=np.zeros((50, 3), np.float32))
    with pytest.raises(DatasetError, match=r"has no field 'label'|field 'image' is float32"):
        Dataset(tmp_path / "ds", verify=False).read(0, 0, 1)


def test_data_split_and_info_from_the_command_line(tmp_path):
    data = records(250)
    np.savez(tmp_path / "all.npz", **data)
    done = fluidps_cli("data", "split", str(tmp_path / "all.npz"), "-o", str(tmp_path / "ds"),
                       "--records-per-shard", "100", "--shuffle", "--seed", "3")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("wrote 250 records in 3 shard(s)")
    dataset = Dataset(tmp_path / "ds")
    labels = np.concatenate(
        [dataset.read(i, 0, s.records)["label"][:, 0] for i, s in enumerate(dataset.shards)]
    )
    assert sorted(labels.tolist()) == list(range(250)) and labels.tolist() != list(range(250))  # shuffled
    info = fluidps_cli("data", "info", str(tmp_path / "ds"), "--records-per-task", "30")
    assert info.returncode == 0 and f"fingerprint {dataset.fingerprint}" in info.stdout
    assert "10 tasks of at most 30 records" in info.stdout  # 4 + 4 + 2
    # A dataset directory re-shards; a plain .npy needs its field's name.
    resplit = fluidps_cli("data", "split", str(tmp_path / "ds"), "-o", str(tmp_path / "again"),
                          "--records-per-shard", "125", "--format", "npy")  # fmt: skip
    assert resplit.returncode == 0 and "250 records in 2 shard(s)" in resplit.stdout
    np.save(tmp_path / "plain.npy", np.arange(10.0))
    plain = fluidps_cli("data", "split", str(tmp_path / "plain.npy"), "-o", str(tmp_path / "p"),
                        "--records-per-shard", "4", "--field", "x")  # fmt: skip
    assert plain.returncode == 0 and "x float64[]" in plain.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["data", "split", "nope.npz", "-o", "out", "--records-per-shard", "5"], "nope.npz does not exist"),
        (
            ["data", "split", "x.csv", "-o", "out", "--records-per-shard", "5"],
            "is not a .npz, .npy or .parquet",
        ),
        (["data", "info", "missing-dir"], "is not a directory"),
    ],
)
def test_data_commands_fail_with_one_line(tmp_path, args, message):
    (tmp_path / "x.csv").write_text("1,2\n")
    done = subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1
