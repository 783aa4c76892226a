"""The examples reach their advertised results (the digits ones as shipped)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(autouse=True)
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_digits_mlp_reaches_97_percent():
    import digits_mlp

    metrics = digits_mlp.train(progress=False)
    assert metrics["test_accuracy"] >= 0.97


def test_digits_pipeline_reaches_97_percent_on_two_stages(tmp_path):
    import digits_pipeline

    metrics = digits_pipeline.train(progress=False, out=tmp_path)
    assert metrics["test_accuracy"] >= 0.97
    import fluidps

    saved = fluidps.Program.parse_from_string((tmp_path / "main.pb").read_bytes())
    assert {op.attr("op_device") for op in saved.global_block().ops} == {"stage:0", "stage:1"}


def test_digits_lenet_reaches_98_percent():
    import digits_lenet

    metrics = digits_lenet.train(progress=False)
    assert metrics["test_accuracy"] >= 0.98


def test_ctr_embedding_auc_in_reduced_form():
    import ctr_embedding

    metrics = ctr_embedding.train(train_examples=60_000, test_examples=10_000, progress=False)
    assert metrics["test_auc"] > 0.7


def test_ctr_streaming_serves_each_version_and_learns_as_it_goes(tmp_path):
    """Online training from a drifting click log: every minute's export is served and
    scored on the next minute's clicks; deltas hold a part of the table."""
    import ctr_streaming

    result = ctr_streaming.run(minutes=5, workdir=str(tmp_path), verbose=False)
    rows = result["rows"]
    assert result["records"] == 5 * ctr_streaming.MINUTE and len(rows) >= 3
    assert rows[-1]["next_minute_auc"] > 0.65 and rows[-1]["next_minute_auc"] > rows[0]["next_minute_auc"]
    from fluidps.io.exports import read_manifest

    base = sum(v["bytes"] for v in read_manifest(tmp_path / "exports", 1)["vars"].values())
    deltas = [r["bytes"] for r in rows if r["kind"] == "delta"]
    assert deltas and max(deltas) < 0.5 * base  # the rows a minute touched, not the table


def test_movielens_streaming_scores_every_rating_before_training_on_it(tmp_path):
    """MovieLens-100K replayed in time order: every rating appended is scored, then trained
    on (the group commits them all); both AUCs are well above chance, and the random
    split, which sees each user's future, scores higher than the stream."""
    import importlib.util

    if importlib.util.find_spec("recbole") is None:
        pytest.skip("MovieLens-100K comes from the recbole package: pip install --no-deps recbole")
    import movielens_streaming

    result = movielens_streaming.run(workdir=str(tmp_path), verbose=False)
    assert result["ratings"] == 100_000
    assert result["appended"] == result["scored"] == result["committed"] == result["ratings"]
    assert result["progressive_auc"] > 0.6 and result["offline_auc"] > 0.6
    assert result["offline_auc"] > result["progressive_auc"]


def test_movielens_loader_says_how_to_get_the_data_when_recbole_is_missing(monkeypatch):
    import movielens_streaming

    from fluidps.errors import DatasetError

    monkeypatch.setattr(movielens_streaming.importlib.util, "find_spec", lambda name, package=None: None)
    with pytest.raises(DatasetError, match="pip install --no-deps recbole"):
        movielens_streaming.load_ratings()


def test_ctr_hashed_trains_over_raw_hashes_the_same_locally_and_in_a_job():
    """A RemoteExecutor job of 2 pservers creates and evicts the same rows as local
    training, and both learn (AUC well above chance)."""
    import ctr_hashed

    job = ctr_hashed.train(train_examples=40_000, test_examples=5_000, progress=False)
    local = ctr_hashed.train(train_examples=40_000, test_examples=5_000, local=True, progress=False)
    assert local["test_auc"] > 0.7 and abs(job["test_auc"] - local["test_auc"]) < 0.01
    shards = list(job["shards"].values())
    assert len(shards) == 2 and all(s["rss_bytes"] > 0 for s in shards)
    for counter in ("rows", "created", "evicted", "pending_ids"):
        assert sum(s[counter] for s in shards) == local["shards"]["local"][counter]
    assert local["shards"]["local"]["rows"] < local["distinct_ids"]  # admission keeps rare ids out


def test_examples_run_as_scripts(tmp_path):
    import subprocess

    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "digits_mlp.py"), "--epochs", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("test accuracy ")
    assert "digits_mlp" in result.stderr  # the progress bar
