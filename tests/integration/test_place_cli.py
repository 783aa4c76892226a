"""`fluidps calibrate` and `fluidps place`, as a person runs them: a real calibration
(two processes over fluidps's transport), a placement printed, measured and written,
and the written program cut into stages by `fluidps transpile --pipeline`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import fluidps
from fluidps import layers
from fluidps.ir.graph import STAGE_COLOURS
from fluidps.transpiler.cost_model import load_machine, machine_id


def run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=600, env=env
    )


def write_mlp(tmp_path: Path) -> tuple[Path, Path]:
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 2
    with fluidps.program_guard(main, startup):
        h = layers.data("x", [32])
        y = layers.data("y", [1], dtype="int64")
        for width in (128, 128, 8, 8):
            h = layers.fc(h, width, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 4), y))
        fluidps.optimizer.SGD(0.1).minimize(loss)
    main_file, startup_file = tmp_path / "main.pb", tmp_path / "startup.pb"
    main_file.write_bytes(main.serialize_to_string())
    startup_file.write_bytes(startup.serialize_to_string())
    return main_file, startup_file


def test_calibrate_then_place_measure_and_transpile_the_placed_program(tmp_path):
    env = {
        **os.environ,
        "FLUIDPS_CALIBRATION": str(tmp_path / "calibration.json"),
        "FLUIDPS_OP_PROFILE": str(tmp_path / "profile.json"),
    }
    main_file, startup_file = write_mlp(tmp_path)

    uncalibrated = run("place", str(main_file), "--stages", "2", "--micro-batches", "4", env=env)
    assert uncalibrated.returncode == 0, uncalibrated.stderr
    assert "warning: no transport calibration" in uncalibrated.stderr
    assert "predicted step" in uncalibrated.stdout

    refused = run("calibrate", "--rounds", "0", env=env)
    assert refused.returncode != 0 and "--rounds" in refused.stderr
    calibrated = run("calibrate", "--calls", "5", "--rounds", "1", env=env)  # (the default takes three)
    assert calibrated.returncode == 0, calibrated.stderr
    assert f"stored in {tmp_path / 'calibration.json'}" in calibrated.stdout
    model = load_machine(tmp_path / "calibration.json")
    assert model.calibrated and model.machine == machine_id()
    assert model.alpha_s > 0 and model.gemm_flops > 0 and model.send_cpu_s > 0
    assert "a stage's own" in calibrated.stdout  # measured by a two-stage job

    measured = run(
        "place", str(main_file), "--stages", "2", "--micro-batches", "4", "--batch-size", "32",
        "--measure", "--startup", str(startup_file), "-o", str(tmp_path / "placed.pb"), "--json", env=env,
    )  # fmt: skip
    assert measured.returncode == 0, measured.stderr
    assert measured.stderr == ""  # calibrated, and every op measured: nothing to warn about
    assert (tmp_path / "profile.json").exists()
    report = json.loads(measured.stdout[measured.stdout.index("{") : measured.stdout.rindex("}") + 1])
    assert [s["stage"] for s in report["stages"]] == [0, 1] and report["predicted_step_ms"] > 0
    assert all(s["ops"] for s in report["stages"])
    # the placed program ran as a job of two stage processes: each stage's time, measured
    assert report["measured_step_ms"] > 0
    assert all(s["measured_ms_per_step"] > 0 and s["predicted_ms_per_step"] > 0 for s in report["stages"])
    assert "1 thread(s)" in measured.stdout or "2 thread(s)" in measured.stdout
    # timed next to the other stage when this host has a core for each, as the job runs it
    neighbors = 1 if (os.cpu_count() or 1) >= 2 else 0
    assert f"next to {neighbors} busy neighbor(s)" in measured.stdout

    drawn = run("dot", str(tmp_path / "placed.pb"), "-o", str(tmp_path / "placed.dot"), env=env)
    assert drawn.returncode == 0, drawn.stderr
    dot = (tmp_path / "placed.dot").read_text()  # each op in its stage's colour: the cut shows
    assert STAGE_COLOURS[0] in dot and STAGE_COLOURS[1] in dot and "cluster_legend" in dot

    stages = run("transpile", str(tmp_path / "placed.pb"), "--pipeline", "--microbatches", "4",
                 "-o", str(tmp_path / "stages"), env=env)  # fmt: skip
    assert stages.returncode == 0, stages.stderr
    assert (tmp_path / "stages" / "stage_1.pb").exists()


def test_place_refuses_bad_input_in_one_line(tmp_path):
    env = {**os.environ, "FLUIDPS_CALIBRATION": str(tmp_path / "none.json")}
    main_file, _ = write_mlp(tmp_path)
    cases = [
        (["--stages", "40"], "40 pipeline stages need at least 40 forward ops"),
        (["--stages", "2", "--memory-cap", "10"], "memory cap of 10 bytes"),
        (["--stages", "2", "--measure"], "--measure runs the program: give its --startup program"),
        (["--stages", "2", "--profile", str(tmp_path / "missing.json")], "no op profile at"),
        (["--stages", "2", "--neighbors", "-1"], "--neighbors must be 0 or more, got -1"),
    ]
    for flags, message in cases:
        done = run("place", str(main_file), *flags, env=env)
        assert done.returncode == 2 and message in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr
