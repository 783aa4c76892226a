"""The benchmarks run end to end in a tiny configuration and print one JSON row
per line with the fields their docstrings promise. Speed is never asserted."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository root, where `bench` lives

SPARSE_KEYS = {
    "workload",
    "table_rows",
    "rows",
    "width",
    "fluidps_ms",
    "kernel_ms",
    "numpy_add_at_ms",
    "speedup",
    "rows_per_s",
}
SPARSE_TIMES = ("fluidps_ms", "kernel_ms", "numpy_add_at_ms", "speedup")


def bench(module: str, *args: str) -> list[dict]:
    """Run `python -m bench.<module> ARGS` from the repository root; its rows."""
    result = subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines, result.stderr
    return [json.loads(line) for line in lines]  # every line is one JSON object


def assert_sparse_rows(rows: list[dict], table_rows: int, n_rows: int, width: int) -> None:
    assert [r["workload"] for r in rows] == [
        "sgd_sparse_rows",
        "adam_lazy_sparse_rows",
        "hashed_adam_lookup_update",
        "hashed_checkpoint_delta",
    ]
    for r in rows[:2]:
        assert set(r) == SPARSE_KEYS
        for key in SPARSE_TIMES:
            assert isinstance(r[key], float) and r[key] > 0, (r["workload"], key, r[key])
    assert set(rows[2]) == {"workload", "table_rows", "rows", "width", "fluidps_ms", "rows_per_s"}
    for r in rows[:3]:
        assert (r["table_rows"], r["rows"], r["width"]) == (table_rows, n_rows, width)
        assert r["rows_per_s"] > 0 and r["fluidps_ms"] > 0
    checkpoint = rows[3]
    assert (checkpoint["table_rows"], checkpoint["width"]) == (table_rows, width)
    assert 0 < checkpoint["rows_updated"] <= min(5 * n_rows, table_rows)
    assert checkpoint["delta_bytes"] > 0 and checkpoint["base_bytes"] > 0


def test_sparse_update_bench_prints_one_row_per_workload():
    args = ["--table-rows", "300", "--rows", "40", "--width", "4", "--repeats", "2", "--hashed-ids", "5000"]
    rows = bench("sparse_update", *args)
    assert_sparse_rows(rows[:4], 300, 40, 4)
    (memory,) = rows[4:]
    assert memory["workload"] == "hashed_table_memory" and memory["ids"] >= 5000
    assert memory["table_bytes"] > memory["ideal_bytes"] == memory["ids"] * (4 + 10) * 4


@pytest.mark.parametrize("with_torch", [False, True], ids=["fluidps", "torch"])
def test_local_bench_rows(with_torch):
    if with_torch and importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    args = ["--steps", "2", "--repeats", "1", "--ctr-batch", "16", "--ctr-steps", "2", "--ctr-vocab", "2600"]
    args += ["--sparse-table-rows", "300", "--sparse-rows", "40", "--sparse-repeats", "2"]
    # Without torch, every executor: interpreted, compiled without fusion, compiled.
    kinds = ["interpreted", "compiled"] if with_torch else ["interpreted", "unfused", "compiled"]
    rows = bench(
        "local", *args, *(["--executor", "both"] if with_torch else ["--no-torch", "--executor", "all"])
    )
    n = len(kinds)
    workloads = ["digits_mlp", "digits_mlp", "tiny", "ctr_embedding"]
    assert [r["workload"] for r in rows] == [w for w in workloads for _ in range(n)] + [
        "sgd_sparse_rows",
        "adam_lazy_sparse_rows",
        "hashed_adam_lookup_update",
        "hashed_checkpoint_delta",
    ]
    training, sparse = rows[: 4 * n], rows[4 * n :]
    assert [r["executor"] for r in training] == kinds * 4
    peer_keys = {"torch", "fluidps_vs_torch"} if with_torch else set()
    for r in training:
        assert {"workload", "unit", "fluidps", "threads", "batch", "optimizer"} | peer_keys <= set(r)
        assert ("torch" in r) == with_torch
        assert r["threads"] == 1
        for key in ("fluidps", *sorted(peer_keys)):
            assert isinstance(r[key], float) and r[key] > 0, (r["workload"], key, r[key])
        if r["executor"] != "interpreted":  # the run that compiled, cold and from the disk cache
            assert r["first_compile_s"] > 0 and (
                r["workload"] == "ctr_embedding" or r["cached_compile_s"] > 0
            )
    assert [r["unit"] for r in training] == ["steps/s"] * 3 * n + ["samples/s"] * n
    assert [r["batch"] for r in training] == [b for b in (64, 128, 64, 16) for _ in range(n)]
    assert training[0]["model"] == "64-256-256-10" and training[2 * n]["model"] == "64-10"
    assert training[3 * n]["table"] == "2600x8" and training[3 * n]["fields"] == 26
    # bench.local ends with bench.sparse_update's rows, its flags passed on.
    assert_sparse_rows(sparse, 300, 40, 16)


def test_distributed_bench_quick_smoke_run():
    args = ["--quick", "--models", "digits_mlp", "--topologies", "1x1", "--modes", "sync"]
    rows = bench("distributed", *args, "--no-torch", "--bandwidth-mib", "1")
    note, *rest = rows
    assert set(note) == {"note"} and "cores" in note["note"]
    training = [r for r in rest if r["bench"] == "digits_mlp"]
    bandwidth = [r for r in rest if r["bench"] == "bandwidth"]
    proof = [r for r in rest if r["bench"] == "proof"]
    assert len(training) + len(bandwidth) + len(proof) == len(rest)
    # what the job's proof costs a message: a small SEND and one of the bandwidth's size
    assert [r["bytes"] for r in proof] == [4096, 1 << 20]
    for r in proof:
        assert r["with_proof_us"] > 0 and r["without_proof_us"] > 0
        assert r["ratio"] == pytest.approx(r["with_proof_us"] / r["without_proof_us"], rel=1e-2)
    jobs = (
        ("local", 1, 0, None),
        ("sync", 1, 1, "RemoteExecutor"),
        ("sync", 1, 1, "fluidps launch"),  # the same job, each trainer feeding itself
    )
    assert [(r["executor"], r["mode"], r["trainers"], r["pservers"], r.get("runner")) for r in training] == [
        *(("interpreted", *job) for job in jobs),
        *(("compiled", *job) for job in jobs),  # every process's Executor compiles, then
        ("compiled", "sync", 1, 1, "raw pyzmq (ceiling)"),  # the same exchange over raw pyzmq (bench.ceiling)
    ]
    common = {"global_batch", "samples_per_s", "steps", "loss", "model", "optimizer", "processes", "cores"}
    local, job, launched = training[:3]
    assert common | {"vs_local"} <= set(training[6]) and training[6]["processes"] == 2
    for compiled, interpreted in zip(training[3:6], training[:3], strict=True):
        # The same batches to the same parameters, interpreted or compiled (float32 rounding).
        assert compiled["loss"] == pytest.approx(interpreted["loss"], rel=1e-3)
    assert common <= set(local) and common | {"warmup_steps", "setup_s", "stats_ms", "vs_local"} <= set(job)
    assert common | {"warmup_steps", "wall_s", "vs_local"} <= set(launched)
    assert launched["steps"] == job["steps"] and launched["samples_per_s"] > 0 and launched["loss"] > 0
    assert "stats_error" not in job  # the sync job's pserver_stats() answered and matched its steps
    assert (local["processes"], job["processes"]) == (1, 3)
    for r in training:
        assert r["global_batch"] == 128 and r["steps"] > 0
        assert r["samples_per_s"] > 0 and r["loss"] > 0
    assert job["setup_s"] > 0 and job["vs_local"] > 0
    for row in (job, launched, training[6]):
        # Against the local rates timed around it: the first is the one before (the local row's
        # for the first job), the second the next row's first.
        before, after = row["local_around"]
        assert before > 0 and after > 0
        assert row["vs_local"] == pytest.approx(row["samples_per_s"] / ((before + after) / 2), rel=1e-2)
    assert job["local_around"][0] == pytest.approx(training[0]["samples_per_s"], abs=0.1)
    assert launched["local_around"][0] == job["local_around"][1]
    assert sorted((r["op"], r["path"]) for r in bandwidth) == [
        ("pull", "fluidps exe.scope"),
        ("pull", "pyzmq copy=False"),
        ("push", "fluidps exe.scope"),
        ("push", "pyzmq copy=False"),
    ]
    for r in bandwidth:
        assert {"bytes", "mib_per_s", "ms", "repeats", "to", "processes", "cores"} <= set(r)
        assert r["bytes"] == 1 << 20 and r["mib_per_s"] > 0 and r["ms"] > 0


def test_distributed_bench_runs_a_launched_job_with_and_without_the_jobs_proof():
    """--runners launch-unproven: the same launched job with no job secret, to measure what
    the proof on every message costs; both train to the same loss."""
    args = ["--quick", "--models", "digits_mlp", "--topologies", "1x1", "--modes", "sync", "--no-torch"]
    args += ["--bandwidth-mib", "0", "--runners", "launch,launch-unproven", "--executors", "compiled"]
    rows = bench("distributed", *args)
    jobs = [r for r in rows if r.get("runner", "").startswith("fluidps launch")]
    assert [r["runner"] for r in jobs] == ["fluidps launch", "fluidps launch (no proof)"]
    assert jobs[0]["loss"] == pytest.approx(jobs[1]["loss"], rel=1e-6)
    assert all(r["samples_per_s"] > 0 and r["vs_local"] > 0 for r in jobs)


def quick_remote_job(model: str, modes: str) -> list[str]:
    """bench.distributed's flags for a quick 1x1 RemoteExecutor job of `model` in `modes`."""
    return [
        "--quick",
        "--models",
        model,
        "--topologies",
        "1x1",
        "--modes",
        modes,
        "--runners",
        "RemoteExecutor",
        "--executors",
        "interpreted",
    ]


def test_distributed_bench_runs_the_ctr_model_with_a_distributed_table():
    args = quick_remote_job("ctr_distributed", "sync")
    rows = bench("distributed", *args, "--ctr-vocab", "2600,5200", "--no-torch", "--bandwidth-mib", "1")
    training = [r for r in rows if r.get("bench") == "ctr_distributed"]
    assert [(r["mode"], r["table"]) for r in training] == [
        ("local", "2600x8"),
        ("sync", "2600x8"),
        ("local", "5200x8"),
        ("sync", "5200x8"),
    ]
    for r in training:
        assert r["distributed_table"] is True and r["samples_per_s"] > 0 and r["loss"] > 0
    for job in training[1::2]:
        assert "stats_error" not in job and job["vs_local"] > 0


def test_distributed_bench_profiles_every_process_of_a_job():
    args = quick_remote_job("ctr_distributed", "sync,async")
    rows = bench(
        "distributed", *args, "--ctr-vocab", "2600", "--no-torch", "--bandwidth-mib", "1", "--profile"
    )
    jobs = [r for r in rows if r.get("bench") == "ctr_distributed" and r["mode"] != "local"]
    assert [r["mode"] for r in jobs] == ["sync", "async"]
    for job in jobs:
        profile = job["profile"]
        assert sorted(profile) == ["client", "pserver 0", "trainer 0"]
        assert profile["client"]["client step"] > 0
        trainer, pserver = profile["trainer 0"], profile["pserver 0"]
        assert {"compute", "send", "recv", "distributed_lookup_table", "serialize"} <= set(trainer)
        assert {"optimize", "handle SEND", "handle PREFETCH", "deserialize"} <= set(pserver)
        assert ("send_barrier" in trainer) == (job["mode"] == "sync")


def test_distributed_bench_runs_the_ctr_model_over_a_hashed_table():
    args = quick_remote_job("ctr_hashed", "sync")
    rows = bench("distributed", *args, "--no-torch", "--bandwidth-mib", "1", "--hashed-ids", "3000")
    training = [r for r in rows if r.get("bench") == "ctr_hashed"]
    assert [r["mode"] for r in training] == ["local", "sync"]
    for r in training:
        assert r["table"] == "hashed x8" and r["samples_per_s"] > 0 and r["loss"] > 0
    job = training[1]
    assert "stats_error" not in job and job["vs_local"] > 0
    assert len(job["trainer_rss_mib"]) == len(job["pserver_rss_mib"]) == 1
    (memory,) = [r for r in rows if r.get("bench") == "hashed_job_memory"]
    assert memory["ids_fed"] >= 3000 and memory["rows"] == memory["ids_fed"]  # 62-bit ids: all distinct
    assert memory["ideal_mib"] == round(memory["rows"] * 50 * 4 / 2**20, 1)
    assert len(memory["pserver_rss_mib"]) == len(memory["pserver_table_mib"]) == 2
    assert memory["table_over_ideal"] >= 1 and memory["trainer_rss_mib"] > 0


@pytest.mark.parametrize("bound", [False, True], ids=["unbound", "bound"])
def test_the_ceiling_runs_two_trainers_in_lockstep_through_one_pserver(bound):
    """bench.ceiling with 2 trainers: the pserver waits for both trainers' gradients each
    step and answers both (a pserver that answered one would leave the other waiting);
    also with each process bound to a core, as fluidps launch --bind-cores binds a job's."""
    flags = ["--bind-cores"] if bound else []
    local, job = bench("ceiling", "--trainers", "2", "--steps", "5", "--repeats", "1", *flags)
    assert local["mode"] == "local" and local["samples_per_s"] > 0
    assert (job["mode"], job["trainers"], job["pservers"], job["runner"]) == (
        "sync",
        2,
        1,
        "raw pyzmq (ceiling)" + (", bound to cores" if bound else ""),
    )
    assert job["samples_per_s"] > 0 and 0 < job["loss"] < 2.4  # it trained: below ln(10) at the start


def test_the_ceiling_of_a_distributed_table_sends_the_next_batchs_rows_with_the_parameters():
    _, job = bench(
        "ceiling",
        "--workload",
        "ctr_distributed",
        "--batch",
        "64",
        "--vocab",
        "5000",
        "--steps",
        "5",
        "--repeats",
        "1",
    )
    assert (job["mode"], job["trainers"], job["runner"]) == ("sync", 1, "raw pyzmq (ceiling)")
    assert job["samples_per_s"] > 0 and 0 < job["loss"] < 0.7  # it trained: below ln(2) at the start


def test_the_cores_bench_times_a_wake_up_across_cores_and_on_one():
    """bench.cores: one row per placement (two cores where there are two), each with the
    spread of its round trips, and the cores it bound the two processes to."""
    rows = bench("cores", "--quick")
    cores = sorted(os.sched_getaffinity(0))
    expected = ["two cores", "one core"] if len(cores) > 1 else ["one core"]
    assert [r["placement"] for r in rows] == expected
    for row in rows:
        assert (row["bench"], row["probe"], row["rounds"]) == ("cores", "wake_up", 1)
        spread = row["round_trip_us"]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert rows[-1]["cores"] == [cores[0], cores[0]]
    if len(cores) > 1:
        assert rows[0]["cores"] == [cores[0], cores[-1]]


def test_the_guard_bench_times_a_step_with_the_guard_and_without():
    rows = bench("guard", "--steps", "3", "--windows", "2", "--models", "tiny")
    assert [(r["workload"], r["executor"]) for r in rows] == [("tiny", "interpreted"), ("tiny", "compiled")]
    for row in rows:
        assert row["ops"] == 11 and row["windows"] == 2
        assert row["step_us_guarded"] > 0 and row["step_us_unguarded"] > 0
        assert row["ratio_range"][0] <= row["ratio"] <= row["ratio_range"][1]


def test_the_pipeline_bench_compares_each_schedule_with_local_training():
    rows = bench("pipeline", "--quick")
    note, local, default, *pipeline = rows
    assert "cores" in note["note"]
    assert local["bench"] == "local" and local["threads"] == 1 and local["samples_per_s"] > 0
    assert default["bench"] == "local (default threads)" and default["samples_per_s"] > 0
    assert [(r["schedule"], r["microbatches"]) for r in pipeline] == [("1F1B", 2), ("F-then-B", 2)]
    for r in pipeline:
        assert r["samples_per_s"] > 0 and r["ideal"] == pytest.approx(4 / 3, rel=1e-3)
        assert r["vs_local"] == pytest.approx(r["samples_per_s"] / local["samples_per_s"], rel=1e-2, abs=1e-3)
        assert r["reachable"] == pytest.approx(r["ideal"] / r["micro_batching_cost"], rel=1e-2, abs=1e-3)
        assert r["gemm_cost"] > 0
        assert r["gemm_limit"] == pytest.approx(r["ideal"] / r["gemm_cost"], rel=1e-2, abs=1e-3)
        stages = r["stages_memory"]
        assert [s["stage"] for s in stages] == [0, 1] and all(s["param_bytes"] > 0 for s in stages)
        # 1F1B holds at most p - stage micro-batches' activations; F-then-B, m (here 2)
        bound = [2, 1] if r["schedule"] == "1F1B" else [2, 2]
        assert [s["peak_live_microbatches"] for s in stages] == bound
    assert pipeline[0]["loss"] == pipeline[1]["loss"]  # both schedules train the same


def test_the_placement_bench_measures_every_split_and_the_automatic_one():
    transport, profile, *splits, auto, repeat, sliced, whole, planning = bench("placement", "--quick")
    assert (
        transport["row"] == "transport"
        and transport["alpha_us"] > 0
        and transport["raw_pyzmq_4k_push_us"] > 0
    )
    assert profile["row"] == "profile" and profile["signatures"] > 0
    assert [r["cut"] for r in splits] == [1, 2, 3]  # every cut between the 3 hidden layers
    for r in [*splits, auto]:
        assert r["step_ms"] > 0 and len(r["busy_ms"]) == len(r["predicted_busy_ms"]) == 2
        errors = [p / b - 1 for p, b in zip(r["predicted_busy_ms"], r["busy_ms"], strict=True)]
        assert r["stage_error"] == [pytest.approx(e, abs=0.02) for e in errors]  # (of the rounded times)
    best = min(splits, key=lambda r: r["step_ms"])
    assert auto["row"] == "auto" and auto["best_cut"] == best["cut"] and auto["equal_cut"] == 2
    assert auto["first_pass_best_step_ms"] == best["step_ms"]  # (then measured again, next to auto)
    assert auto["vs_best"] == pytest.approx(auto["step_ms"] / auto["best_step_ms"], rel=1e-2)
    assert auto["vs_equal"] == pytest.approx(auto["step_ms"] / auto["equal_step_ms"], rel=1e-2)
    assert 1 <= transport["wait_factor"] <= 2 and profile["neighbors"] == min(2, os.cpu_count() or 1) - 1
    assert len(transport["rounds"]) == 1 and transport["rounds"][0]["wait_factor"] == transport["wait_factor"]
    assert all(
        r["constants"] == {k: transport[k] for k in r["constants"]} for r in [*splits, auto]
    )  # (--quick)
    by_cut = {r["cut"]: r for r in splits}
    assert repeat["row"] == "repeat" and [repeat[w]["cut"] for w in ("best", "equal", "last")] == [
        best["cut"],
        2,
        3,
    ]
    moves = []
    for which in ("best", "equal", "last"):
        row = repeat[which]
        assert row["first_busy_ms"] == by_cut[row["cut"]]["busy_ms"]
        assert row["again_over_first"] == [
            pytest.approx(b / a, abs=0.002)
            for a, b in zip(row["first_busy_ms"], row["again_busy_ms"], strict=True)
        ]
        moves += [abs(r - 1) for r in row["again_over_first"]]
    assert repeat["largest_move"] == pytest.approx(max(moves), abs=0.002)
    assert planning["ops"] > 800 and planning["stages"] == 4
    assert sliced["sliced"] and not whole["sliced"]
    for row in (sliced, whole):
        for method in ("RoundRobin", "Cost"):
            loads = row[method]["loads_ms"]
            assert len(loads) == 3 and row[method]["max_over_mean"] == pytest.approx(
                3 * max(loads) / sum(loads), rel=1e-2
            )
    assert sliced["Cost"]["max_over_mean"] <= 1.1  # cut into blocks, the load balances


def test_the_streaming_bench_measures_the_log_training_freshness_deltas_swaps_and_memory():
    """bench.streaming --quick: every row, with what each promises; counts and sizes are
    checked, never how fast anything ran."""
    log, throughput, freshness, delta, swaps, memory = bench("streaming", "--quick")
    assert [r["row"] for r in (log, throughput, freshness, delta, swaps, memory)] == [
        "log", "throughput", "freshness", "delta", "swaps", "memory"
    ]  # fmt: skip
    assert all(r["bench"] == "streaming" for r in (log, throughput, freshness, delta, swaps, memory))

    assert log["records"] == 20_000 and log["bytes_per_record"] == 96.0
    speeds = [
        "append_fsync_per_s",
        "append_no_fsync_per_s",
        "read_per_s",
        "parquet_read_per_s",
        "npz_read_per_s",
    ]
    assert all(log[key] > 0 for key in speeds)
    assert log["log_read_over_parquet"] == pytest.approx(
        log["read_per_s"] / log["parquet_read_per_s"], rel=1e-2
    )

    # The same clicks, batches and model from the log and from Parquet: the same loss.
    assert (throughput["records"], throughput["batch"], throughput["rounds"]) == (20_000, 128, 1)
    assert throughput["stream_events_per_s"] > 0 and throughput["parquet_events_per_s"] > 0
    assert throughput["stream_over_parquet"] == pytest.approx(
        throughput["stream_events_per_s"] / throughput["parquet_events_per_s"], rel=1e-2
    )
    assert len(throughput["stream_rounds"]) == len(throughput["parquet_rounds"]) == 1
    assert throughput["same_loss"] and 0 < throughput["last_loss"]["stream"] < 0.7  # (ln 2 untrained)

    # Every event written was served by some version that includes it.
    assert (freshness["rate_per_s"], freshness["window_seconds"]) == (1000, 1.0)
    assert freshness["events"] == freshness["events_served"] == 5000
    assert 0 < freshness["p50_s"] <= freshness["p95_s"] <= freshness["max_s"]
    parts = ("append_to_committed_s", "committed_to_exported_s", "exported_to_served_s")
    assert all(freshness[f"median_{p}"] >= 0 for p in parts)
    # the untrained model, the warm-up window's, and at least one window of the writer's
    assert freshness["versions_exported"] >= 3 and freshness["versions_served"] >= 2
    assert freshness["train_steps"] >= 5000 / 128 and freshness["server_last_error"] is None

    # 1% of a 20,000-row table's ids trained: a delta of those rows and the dense layers.
    assert (delta["table"], delta["ids_trained"], delta["ids_trained_fraction"]) == ("20000x8", 200, 0.01)
    assert 0 < delta["rows_changed"] <= 200 and delta["kind"] == "delta"
    table = next(v for name, v in delta["vars"].items() if name.startswith("embedding"))
    assert table[0] == "rows" and 0 < table[1] < delta["delta_bytes"]
    assert sum(size for _, size in delta["vars"].values()) == delta["delta_bytes"]
    assert delta["delta_over_base"] == pytest.approx(delta["delta_bytes"] / delta["base_bytes"], abs=1e-4)
    assert delta["delta_over_base"] < 0.03

    # Predictions while versions are swapped in: none failed, none was half of a delta,
    # and no thread was ever answered by an older version than before.
    assert (swaps["predictions"], swaps["threads"]) == (2000, 4)
    assert swaps["errors"] == swaps["mismatched"] == swaps["backwards"] == 0, swaps
    assert (
        swaps["versions_exported"] >= 4 and swaps["bases_exported"] >= 1 and swaps["versions_answered"] >= 1
    )
    assert swaps["refreshes_refused"] == 0 and swaps["helper_errors"] == [], swaps

    # The hashed table on a pserver process: bounded rows while ids keep coming and going.
    assert "fluidps serve" in memory["pserver"] and memory["events"] == 60_000 and memory["batch"] == 500
    timeline = memory["timeline"]
    assert len(timeline) == 20 and [t["events"] for t in timeline] == sorted({t["events"] for t in timeline})
    assert timeline[-1]["events"] == memory["events"]
    assert all(0 < t["rows"] <= memory["rows_bound"] and t["rss_mib"] > 0 for t in timeline)
    assert all(t["rows"] == t["created"] - t["evicted"] for t in timeline)
    assert memory["created"] > memory["rows_max_after_warmup"] and memory["evicted"] > 0
    warm = [t for t in timeline if t["events"] >= memory["warmup_events"]]
    assert warm[0]["rss_mib"] == memory["rss_warm_mib"] and timeline[-1]["rss_mib"] == memory["rss_end_mib"]
    assert warm[-1]["created"] > warm[0]["created"] and warm[-1]["evicted"] > warm[0]["evicted"]
    assert memory["rss_max_mib"] == max(t["rss_mib"] for t in warm)
