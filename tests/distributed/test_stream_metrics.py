"""`fluidps serve --role coordinator --stream ... --metrics-port P`: a streaming job's
coordinator process serves its Prometheus metrics over HTTP, and the consumer lag it
shows is the records appended less those committed."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
import urllib.request

import numpy as np
import zmq
from rpc_harness import free_port

from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.io import StreamLog
from helpers import stop_group

TIMEOUT = 60.0  # a bound for a hang, not a speed
READY = " ready on "


def scrape(url: str) -> dict[str, float]:
    """The samples of a Prometheus text page, by name with labels as written."""
    with urllib.request.urlopen(url, timeout=TIMEOUT) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def ready_lines(process: subprocess.Popen) -> list[str]:
    """Its output up to the line saying it is ready."""
    lines, deadline = [], time.monotonic() + TIMEOUT
    while not lines or READY not in lines[-1]:
        ready, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))
        line = process.stdout.readline().decode() if ready else ""
        assert line, f"the coordinator did not say it was ready (exit status {process.poll()}): {lines}"
        lines.append(line)
    return lines


def test_a_stream_coordinator_serves_its_lag_over_http(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append({"x": np.arange(100, dtype=np.float32)})
    secret_file = tmp_path / "job.secret"
    JobSecret.generate().write(str(secret_file))
    port = free_port()
    command = [
        sys.executable, "-m", "fluidps", "serve", "--role", "coordinator", "--endpoint", "tcp://127.0.0.1:0",
        "--stream", f"log:{log.path}", "--secret-file", str(secret_file), "--metrics-port", str(port),
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        bufsize=0,  # (unbuffered: select sees each line that readline has not read yet)
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    context = zmq.Context()
    client = None
    try:
        lines = ready_lines(process)
        url = f"http://127.0.0.1:{port}/metrics"
        assert any(f"metrics on {url}" in line for line in lines), lines
        address = lines[-1].split(READY, 1)[1].strip()
        settings = RpcSettings(
            peer_timeout=20.0, request_timeout=TIMEOUT, secret=JobSecret.read(str(secret_file))
        )
        client = RpcClient(context, address, "coordinator", settings, 0, 0xA)
        ask = {"stream": f"log:{log.path}", "group": "trainers", "window_records": 30, "window_seconds": None}
        window = json.loads(client.call(Message(Kind.TASK_GET, text=json.dumps(ask | {"follow": True}))).text)
        done = {"lease": window["lease"], "samples": 30, "loss": None, "exact": True, "checkpoints": {}}
        assert client.call(Message(Kind.TASK_DONE, text=json.dumps(done))).text == "counted"

        deadline = time.monotonic() + TIMEOUT
        while (samples := scrape(url)).get("fluidps_stream_committed_offset") != 30:
            assert time.monotonic() < deadline, samples
            time.sleep(0.1)
        assert log.committed("trainers") == 30
        assert samples["fluidps_stream_consumer_lag"] == 100 - log.committed("trainers")
        assert samples["fluidps_stream_end_offset"] == 100
        assert samples["fluidps_stream_records_trained_total"] == 30
        assert samples["fluidps_stream_window_seconds_count"] == 1

        client.call(Message(Kind.SHUTDOWN))
        assert process.wait(timeout=TIMEOUT) == 0
    finally:
        if client is not None:
            client.close()
        context.term()
        stop_group(process)
        process.stdout.close()
