"""`fluidps launch --stream`: a job that trains from a stream until SIGTERM drains it.

Records arrive while the job runs; SIGTERM to the launcher drains the job: each trainer
finishes the window in hand, its reader ends, its script writes what it read and exits,
and the launcher exits 0. Every record before the committed offset was trained on by
exactly one trainer, once, and none after it. A trainer killed in the middle of a window
loses nothing and applies nothing twice: its window goes to another trainer, and the
pserver drops the gradients of the batches it had applied. So does a pserver killed in
the middle of the job: it comes back from its checkpoint, the windows it lost go out
again, and the windows' offsets are committed only once its checkpoints hold them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from fluidps.io import StreamLog

JOB = Path(__file__).with_name("stream_job.py")
TIMEOUT = 240.0  # a bound for a hang, not a speed
WINDOW = 64

sys.path.insert(0, str(JOB.parent))
from stream_job import records  # noqa: E402


def launch(tmp_path, log: StreamLog, out: Path, *script_args: str, options: tuple = ()) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "fluidps", "launch", "--stream", f"log:{log.path}", "--pservers", "1",
        "--trainers", "2", "--mode", "async", "--log-dir", str(tmp_path / "job"), "--grace", "10", *options,
        str(JOB), "--out", str(out), "--window-records", str(WINDOW), *script_args,
    ]  # fmt: skip
    env = os.environ | {"FLUIDPS_PEER_TIMEOUT": "20", "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "launch.log", "w") as launch_log:
        return subprocess.Popen(command, stdout=launch_log, stderr=subprocess.STDOUT, env=env)


def stop(proc: subprocess.Popen) -> None:
    """Stop a launcher still running, and its job: SIGTERM drains a streaming job, a second
    one stops it at once (the launcher stops its processes; a SIGKILL would leave them)."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def assert_each_record_applied_once(out: Path, total: int, batch: int) -> None:
    """The counter model's weights (trainer 0's) are minus the sum of each batch's mean x:
    exact in float32, so a batch applied twice, or not at all, shows."""
    x = records(0, total, counter=True)["x"]
    want = -sum(x[i : i + batch].mean(axis=0, dtype=np.float64) for i in range(0, total, batch))
    got = np.array(json.loads((out / "trainer.0.json").read_text())["w"]).reshape(-1)
    np.testing.assert_array_equal(got, want.astype(np.float32))


def wait_for(proc: subprocess.Popen, log_path: Path, condition, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not condition():
        assert proc.poll() is None, f"the job ended before {what}:\n{log_path.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}:\n{log_path.read_text()[-4000:]}"
        time.sleep(0.05)


def test_a_streaming_job_trains_each_record_once_and_drains_on_sigterm(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(records(0, 256))
    out = tmp_path / "out"
    out.mkdir()
    command = [
        sys.executable, "-m", "fluidps", "launch", "--stream", f"log:{log.path}", "--pservers", "1",
        "--trainers", "2", "--mode", "async", "--log-dir", str(tmp_path / "job"), "--grace", "10",
        str(JOB), "--out", str(out), "--window-records", str(WINDOW),
    ]  # fmt: skip
    env = os.environ | {"FLUIDPS_PEER_TIMEOUT": "20", "PYTHONUNBUFFERED": "1"}
    stop_appending = threading.Event()

    def append_meanwhile() -> None:
        start = 256
        while not stop_appending.wait(0.05) and start < 200_000:
            log.append(records(start, 32))
            start += 32

    appender = threading.Thread(target=append_meanwhile, daemon=True)
    with open(tmp_path / "launch.log", "w") as launch_log:
        proc = subprocess.Popen(command, stdout=launch_log, stderr=subprocess.STDOUT, env=env)
    try:
        appender.start()
        deadline = time.monotonic() + TIMEOUT
        while log.committed("trainers") < 1024:  # training as records arrive
            assert proc.poll() is None, (tmp_path / "launch.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "launch.log").read_text()[-4000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=TIMEOUT)
    finally:
        stop_appending.set()
        appender.join(timeout=30)
        stop(proc)
    text = (tmp_path / "launch.log").read_text()
    assert status == 0, text[-4000:]
    assert "draining" in text and "records applied" in text

    results = [json.loads((out / f"trainer.{k}.json").read_text()) for k in range(2)]
    read = sorted(i for r in results for batch in r["batches"] for i in batch)
    committed = log.committed("trainers")
    assert committed % WINDOW == 0 and committed >= 1024
    assert read == list(range(committed))  # each record before the offset once, none after it
    assert all(r["batches"] for r in results)  # both trainers took windows
    # async SGD on y = x W + 0.5 from every record: W is learned
    np.testing.assert_allclose(np.array(results[0]["w"]).reshape(-1), [0.5, -1.0, 2.0, 0.25], atol=0.05)


def test_a_trainer_killed_mid_window_loses_nothing_and_applies_nothing_twice(tmp_path):
    total, batch = 16 * WINDOW, 16
    log = StreamLog(tmp_path / "log")
    log.append(records(0, total, counter=True))
    out = tmp_path / "out"
    out.mkdir()
    log_path = tmp_path / "launch.log"
    proc = launch(
        tmp_path, log, out, "--model", "counter", "--follow", "0", "--announce", "--step-sleep", "0.3",
        "--batch-size", str(batch),
    )  # fmt: skip
    try:
        # Trainer 1 is killed once it has trained on the third batch of a window (the
        # three were applied: their SENDs went before the step that printed this; the
        # window ends with the fourth).
        def deep_in_a_window() -> bool:
            lines = re.findall(r"\[trainer\.1\] trained on records (\d+)\.\.", log_path.read_text())
            return any(int(first) % WINDOW == 2 * batch for first in lines)

        wait_for(proc, log_path, deep_in_a_window, "trainer 1 is three batches into a window")
        pid = int(re.findall(r"started trainer\.1 \(pid (\d+)\)", log_path.read_text())[-1])
        os.kill(pid, signal.SIGKILL)
        status = proc.wait(timeout=TIMEOUT)  # (follow=0: the job ends once every window is done)
    finally:
        stop(proc)
    text = log_path.read_text()
    assert status == 0, text[-4000:]
    assert re.search(
        r"window \d+ \(trainer 1\) failed: trainer 1 restarted while it held the window", text
    ), text[-4000:]
    assert log.committed("trainers") == total
    assert_each_record_applied_once(out, total, batch)
    assert "were applied before (the window went to another trainer)" in text, text[-4000:]


def test_a_pserver_killed_mid_job_comes_back_and_every_record_is_applied_once(tmp_path):
    total, batch = 24 * WINDOW, 16
    log = StreamLog(tmp_path / "log")
    log.append(records(0, total, counter=True))
    out = tmp_path / "out"
    out.mkdir()
    log_path, snapshot, checkpoints = (
        tmp_path / "launch.log",
        tmp_path / "job" / "coordinator.json",
        tmp_path / "ckpt",
    )
    proc = launch(
        tmp_path, log, out, "--model", "counter", "--follow", "0", "--step-sleep", "0.05", "--batch-size", str(batch),
        options=("--checkpoint-dir", str(checkpoints), "--checkpoint-every-seconds", "2"),
    )  # fmt: skip
    try:
        # Killed while a window is done that no checkpoint of the pserver holds yet: it is lost
        # with the pserver's memory, though its trainer was told it was applied.
        def a_window_only_in_memory() -> bool:
            try:
                queue = json.loads(snapshot.read_text())["windows"]["queue"]
            except (OSError, ValueError, KeyError):
                return False
            manifests = sorted(checkpoints.glob("pserver-0-*.json"))
            if not manifests or queue["committed"] < 2 * WINDOW:
                return False
            newest = int(manifests[-1].stem.rsplit("-", 1)[1])
            notes = [queue["applied"][str(w)]["note"] for w in queue["unsaved"]]
            return any(note.get("0", [0])[0] == newest for note in notes)

        wait_for(proc, log_path, a_window_only_in_memory, "a window is done that no checkpoint holds yet")
        pid = int(re.findall(r"started pserver\.0 \(pid (\d+)\)", log_path.read_text())[-1])
        os.kill(pid, signal.SIGKILL)
        status = proc.wait(timeout=TIMEOUT)  # (follow=0: the job ends once every window is done and saved)
    finally:
        stop(proc)
    text = log_path.read_text()
    assert status == 0, text[-4000:]
    assert "restores its newest checkpoint" in text, text[-4000:]
    assert re.search(
        r"window \d+ \(\d+\.\.\d+\) goes out again: pserver 0 came back from a checkpoint", text
    ), text[-4000:]
    assert log.committed("trainers") == total
    assert_each_record_applied_once(out, total, batch)
