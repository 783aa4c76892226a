"""A job process's Prometheus metrics (fluidps.executor.metrics.job_metrics): a coordinator's and a
pserver's, taken from the real loops as they work, with the names and labels the
streaming guide lists; the environment and the launcher giving each process its port;
a clear error without prometheus_client."""

from __future__ import annotations

import io
import json
import sys
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest
import zmq
from job_harness import PserverThreads
from rpc_harness import SECRET

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import BuilderError
from fluidps.executor.env import CONTRACT_VARS, METRICS_HOST_ENV, METRICS_PORT_ENV, metrics_from_env
from fluidps.executor.launch.launcher import Launcher
from fluidps.executor.metrics.job_metrics import METRICS, CoordinatorMetrics, JobMetrics
from fluidps.executor.tasks.coordinator import Coordinator
from fluidps.executor.tasks.lease_times import BUCKETS, LeaseTimes
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.io import StreamLog
from fluidps.ops.sparse_table import SparseTable

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=60.0, secret=SECRET)
WAIT = 60.0  # a bound for a hang, not a speed


def wait_for(what: str, condition) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.02)


# -- lease times --------------------------------------------------------------------------


def test_lease_times_count_each_finished_lease_once_in_cumulative_buckets():
    times = LeaseTimes(kept=2)
    times.leased(1, 10.0)
    times.leased(1, 11.0)  # (asked again: the first start stands)
    times.finished(1, 10.3)
    times.leased(2, 10.0)
    times.finished(2, 10.0 + BUCKETS[-1] + 1)  # past every bound: only +Inf counts it
    times.leased(3, 10.0)
    times.failed_lease(3)
    times.finished(3, 20.0)  # failed first: not timed
    times.finished(99, 20.0)  # given before a restart: not timed
    snap = times.snapshot()
    assert (snap.count, snap.failed) == (2, 1)
    assert snap.sum == pytest.approx(0.3 + BUCKETS[-1] + 1)
    counts = dict(snap.buckets)
    assert counts[0.25] == 0 and counts[0.5] == 1 and counts[BUCKETS[-1]] == 1 and counts[float("inf")] == 2
    for lease in range(10, 20):  # never reported: only the latest `kept` are remembered
        times.leased(lease, 0.0)
    assert len(times._started) == 2


# -- a coordinator -------------------------------------------------------------------------


def window_ask(log: StreamLog) -> str:
    fields = {"stream": f"log:{log.path}", "group": "trainers", "window_records": 30, "window_seconds": None}
    return json.dumps(fields | {"follow": True})


def done(window: dict) -> str:
    samples = window["stop"] - window["start"]
    return json.dumps(
        {"lease": window["lease"], "samples": samples, "loss": None, "exact": True, "checkpoints": {}}
    )


class Coordinated:
    """A coordinator on a thread with its metrics (every tick publishes), and a trainer's client."""

    def __init__(self):
        self.coordinator = Coordinator("tcp://127.0.0.1:0", SETTINGS, task_timeout=30)
        self.metrics = JobMetrics(0)
        self.metrics.watch("coordinator", CoordinatorMetrics(self.coordinator, every=0.0))
        self.thread = threading.Thread(target=self.coordinator.serve_forever, daemon=True)
        self.thread.start()
        self.context = zmq.Context()
        self.client = RpcClient(self.context, self.coordinator.address, "coordinator", SETTINGS, 0, 0xA)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)

    def close(self) -> None:
        self.client.close()
        self.coordinator.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.context.term()


@pytest.fixture
def coordinated():
    job = Coordinated()
    yield job
    job.close()


def test_a_stream_coordinators_metrics_follow_its_windows(coordinated, tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append({"x": np.arange(100, dtype=np.float32)})
    job, client = coordinated, coordinated.client
    wait_for("the first numbers", lambda: job.value("fluidps_coordinator_trainers_alive") is not None)
    assert job.value("fluidps_stream_consumer_lag") is None  # (no stream until a reader asks)

    first = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log))).text)
    wait_for("the window pending", lambda: job.value("fluidps_stream_windows", state="pending") == 1)
    assert job.value("fluidps_stream_consumer_lag") == 100
    assert job.value("fluidps_stream_end_offset") == 100
    assert job.value("fluidps_stream_windows", state="todo") == 2  # (cut ahead: 30..60, 60..90)
    assert job.value("fluidps_coordinator_trainers_alive") == 1
    info = {"source": f"log:{log.path}", "group": "trainers", "follow": "true"}
    assert job.value("fluidps_stream_info", **info) == 1

    assert client.call(Message(Kind.TASK_DONE, text=done(first))).text == "counted"
    wait_for("the offset committed", lambda: job.value("fluidps_stream_committed_offset") == 30)
    assert job.value("fluidps_stream_records_trained_total") == 30
    assert job.value("fluidps_stream_consumer_lag") == 100 - 30 == 100 - log.committed("trainers")
    assert job.value("fluidps_stream_window_seconds_count") == 1
    assert job.value("fluidps_stream_window_seconds_bucket", le="+Inf") == 1
    assert job.value("fluidps_stream_window_seconds_sum") >= 0

    second = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log))).text)
    failed = json.dumps({"lease": second["lease"], "reason": "its step failed"})
    assert client.call(Message(Kind.TASK_FAILED, text=failed)).text == "requeued"
    wait_for("the failure counted", lambda: job.value("fluidps_coordinator_lease_failures_total") == 1)
    assert job.value("fluidps_stream_window_seconds_count") == 1  # (a failed lease is not timed)
    log.append({"x": np.arange(20, dtype=np.float32)})
    wait_for("the new end", lambda: job.value("fluidps_stream_end_offset") == 120)
    assert job.value("fluidps_stream_consumer_lag") == 90

    coordinated.coordinator.drain()  # (what SIGTERM does to it)
    wait_for("the drain shown", lambda: job.value("fluidps_stream_draining") == 1)


def test_every_metric_a_scrape_shows_is_listed_with_its_help(coordinated, tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append({"x": np.arange(40, dtype=np.float32)})
    coordinated.client.call(Message(Kind.TASK_GET, text=window_ask(log)))
    wait_for("the stream's numbers", lambda: coordinated.value("fluidps_stream_end_offset") == 40)
    shown = {m.name for m in coordinated.metrics.registry.collect() if m.name.startswith("fluidps_")}
    listed = {name.removesuffix("_total") for name in METRICS}
    assert shown and shown <= listed | {"fluidps_stream"}  # (an info family's name; samples _info)
    assert all(name.startswith("fluidps_") and help_text for name, (_, help_text) in METRICS.items())


# -- pservers and a trainer ------------------------------------------------------------------


def ctr_model():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 7
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [3, 1], dtype="int64")
        label = layers.data("label", [1], dtype="int64")
        emb = layers.sparse_embedding(ids, [-1, 4])
        loss = layers.mean(
            layers.softmax_with_cross_entropy(layers.fc(layers.reshape(emb, [-1, 12]), 2), label)
        )
        optimizer.SGD(0.5).minimize(loss)
    return main, startup, loss


def test_a_pservers_and_a_trainers_metrics_count_steps_gradients_and_table_rows():
    main, startup, loss = ctr_model()
    endpoint = f"inproc://metrics-{uuid.uuid4().hex[:8]}"
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig())
    t.transpile(0, main, endpoint, 1, startup_program=startup)
    metrics = JobMetrics(0)
    servers = PserverThreads(t, [endpoint], SETTINGS, metrics=metrics)
    exe = servers.trainer_executor()

    def value(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(name, labels)

    try:
        exe.run(t.get_trainer_startup_program())
        program = t.get_trainer_program()
        rng = np.random.default_rng(0)
        seen: set[int] = set()
        for step in (1, 2, 3):
            ids = rng.integers(0, 2**40, (8, 3, 1)).astype(np.int64)
            seen |= set(ids.reshape(-1).tolist())
            exe.run(program, feed={"ids": ids, "label": np.zeros((8, 1), np.int64)}, fetch_list=[loss])
            wait_for(
                f"step {step} shown", lambda s=step: value("fluidps_pserver_steps_total", pserver="0") == s
            )
        assert value("fluidps_trainer_steps_total", trainer="0") == 3
        ps = servers.server(endpoint)
        name = next(n for n in sorted(ps.served) if isinstance(ps.env.get(n), SparseTable))
        wait_for("the rows shown", lambda: value("fluidps_table_rows", pserver="0", table=name) == len(seen))
        assert ps.env[name].stats()["rows"] == len(seen)
        assert value("fluidps_table_rows_created_total", pserver="0", table=name) == len(seen)
        assert value("fluidps_table_rows_evicted_total", pserver="0", table=name) == 0
        assert value("fluidps_pserver_gradients_applied_total", pserver="0") >= 3  # (every slice, each step)
        assert value("fluidps_pserver_trainers_alive", pserver="0") == 1
        assert value("fluidps_pserver_stream_gradients_dropped_total", pserver="0") == 0
        assert value("fluidps_pserver_checkpoints_written_total", pserver="0") == 0
        # The same over HTTP, where the runtime serves them.
        with urllib.request.urlopen(metrics.url, timeout=WAIT) as reply:
            text = reply.read().decode()
        assert 'fluidps_pserver_steps_total{pserver="0"} 3.0' in text
        assert "process_cpu_seconds_total" in text
    finally:
        assert exe.close() == []
        servers.join()
        metrics.close()


# -- configuration ---------------------------------------------------------------------------


def test_the_environment_says_where_metrics_are_served():
    assert metrics_from_env({}) is None and metrics_from_env({METRICS_PORT_ENV: "0"}) is None
    metrics = metrics_from_env({METRICS_PORT_ENV: "9187", METRICS_HOST_ENV: "0.0.0.0"})
    assert (metrics.port, metrics.host, metrics.url) == (9187, "0.0.0.0", "http://0.0.0.0:9187/metrics")
    assert metrics_from_env({METRICS_PORT_ENV: "9187"}).host == "127.0.0.1"
    with pytest.raises(BuilderError, match="FLUIDPS_METRICS_PORT='http' is invalid"):
        metrics_from_env({METRICS_PORT_ENV: "http"})
    assert {METRICS_PORT_ENV, METRICS_HOST_ENV} <= set(
        CONTRACT_VARS
    )  # (never inherited by a job's processes)


def test_without_prometheus_client_asking_for_metrics_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (its import fails)
    with pytest.raises(BuilderError, match=r"pip install 'fluidps\[metrics\]'"):
        JobMetrics(9187)


def test_a_port_taken_is_a_clear_error():
    first = JobMetrics(0)
    first.start()
    try:
        with pytest.raises(BuilderError, match=f"cannot serve metrics on 127.0.0.1:{first.port}"):
            JobMetrics(first.port).start()
    finally:
        first.close()


def test_the_launcher_gives_each_process_its_port_and_says_which(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("")
    said = io.StringIO()
    launcher = Launcher(str(script), pservers=2, trainers=1, stderr=said, metrics_port=9300)
    launcher._assign_metrics_ports(["pserver.0", "pserver.1", "trainer.0", "coordinator"])
    assert launcher._metrics_environment("trainer.0") == {
        METRICS_PORT_ENV: "9302",
        METRICS_HOST_ENV: "127.0.0.1",
    }
    assert launcher._metrics_environment("coordinator")[METRICS_PORT_ENV] == "9303"
    assert "pserver.0 on 9300, pserver.1 on 9301, trainer.0 on 9302, coordinator on 9303" in said.getvalue()
    quiet = Launcher(str(script), pservers=1, trainers=1, stderr=io.StringIO())
    quiet._assign_metrics_ports(["pserver.0", "trainer.0"])
    assert quiet._metrics_environment("pserver.0") == {}
