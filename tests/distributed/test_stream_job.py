"""`fluidps launch --stream`: a job that trains from a stream until SIGTERM drains it.

Records arrive while the job runs; SIGTERM to the launcher drains the job: each trainer
finishes the window in hand, its reader ends, its script writes what it read and exits,
and the launcher exits 0. Every record before the committed offset was trained on by
exactly one trainer, once, and none after it.
"""

from __future__ import annotations

import json
import os
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
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
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
