"""`fluidps serve-model`: predictions over HTTP from an export directory, new versions
swapped in while it serves, a damaged one refused (a real server process on loopback)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from serving_model import batch, ctr_model

import fluidps
from fluidps.endpoints import pick_free_ports
from fluidps.io import Exporter
from fluidps.io.exports import VERSIONS_DIR, read_manifest

TIMEOUT = 120.0  # a bound for a hang


def call(url: str, body: dict | None = None) -> tuple[int, dict | str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as reply:
            text = reply.read().decode()
            status = reply.status
    except urllib.error.HTTPError as e:
        text, status = e.read().decode(), e.code
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def wait_until(condition, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + TIMEOUT
    while True:
        try:
            if condition():
                return
        except (urllib.error.URLError, ConnectionError):
            pass
        assert proc.poll() is None, f"the server exited before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting until {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_serve_model_answers_swaps_versions_and_refuses_a_damaged_one(tmp_path):
    main, startup, test, prob, loss = ctr_model()
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    exporter = Exporter(tmp_path / "exports", ["ids"], [prob], main)
    exporter.export(scope)
    full = batch(99)  # (the test program reads the label too: its loss)
    query = full["ids"]
    want = {1: exe.run(test, feed=full, fetch_list=[prob], scope=scope)[0]}

    (port,) = pick_free_ports("127.0.0.1", 1)
    base = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    command = [sys.executable, "-m", "fluidps", "serve-model", str(tmp_path / "exports"), "--port", str(port),
               "--poll", "0.1"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: call(f"{base}/healthz")[0] == 200, "it answers", proc, log)
        status, answer = call(f"{base}/predict", {"inputs": {"ids": query.tolist()}})
        assert status == 200 and answer["version"] == 1
        np.testing.assert_allclose(np.array(answer["outputs"][prob.name]), want[1], rtol=1e-6)

        exe.run(main, feed=batch(1), fetch_list=[loss], scope=scope)
        exporter.export(scope)  # a delta
        want[2] = exe.run(test, feed=full, fetch_list=[prob], scope=scope)[0]
        wait_until(lambda: call(f"{base}/healthz")[1]["version"] == 2, "it serves version 2", proc, log)
        status, answer = call(f"{base}/predict", {"inputs": {"ids": query.tolist()}})
        assert status == 200 and answer["version"] == 2
        np.testing.assert_allclose(np.array(answer["outputs"][prob.name]), want[2], rtol=1e-6)

        exe.run(main, feed=batch(2), fetch_list=[loss], scope=scope)
        exporter.export(scope)  # damaged before it is looked at: refused
        entry = next(iter(read_manifest(tmp_path / "exports", 3)["vars"].values()))
        damaged = tmp_path / "exports" / VERSIONS_DIR / "00000003" / entry["file"]
        damaged.write_bytes(damaged.read_bytes()[:-4])
        wait_until(lambda: call(f"{base}/healthz")[1]["last_error"], "it refuses version 3", proc, log)
        status, health = call(f"{base}/healthz")
        assert health["version"] == 2 and "does not match its checksum" in health["last_error"]
        assert call(f"{base}/predict", {"inputs": {"ids": query.tolist()}})[1]["version"] == 2

        status, answer = call(f"{base}/predict", {"inputs": {"x": [[1]]}})
        assert status == 400 and "the model takes ids" in answer["error"]
        status, answer = call(f"{base}/predict", {"rows": []})
        assert status == 400 and '{"inputs"' in answer["error"]
        status, text = call(f"{base}/metrics")
        assert status == 200 and "fluidps_model_version 2.0" in text
        assert 'fluidps_predict_requests_total{outcome="refused"} 2.0' in text
    finally:
        proc.terminate()
        proc.wait(timeout=30)
