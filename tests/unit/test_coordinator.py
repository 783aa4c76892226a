"""The coordinator over the wire: task requests and reports are checked field by field,
trainers must agree on what they read, and a coordinator restarted from its snapshot
carries on where it stopped."""

from __future__ import annotations

import json
import math
import threading
import time

import numpy as np
import pytest
import stream_books
import zmq
from rpc_harness import SECRET

from fluidps.errors import RemoteError
from fluidps.executor.ps.applied_batches import stream_id
from fluidps.executor.tasks.coordinator import Coordinator
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.io import Dataset, StreamLog

SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=30.0, secret=SECRET)


@pytest.fixture
def dataset(tmp_path) -> Dataset:
    return Dataset.write(tmp_path / "data", {"x": np.arange(100, dtype=np.float32)}, records_per_shard=25)


class Running:
    """A Coordinator serving on a thread, and trainers' clients of it."""

    def __init__(self, snapshot=None, **options):
        options = {"task_timeout": 30} | options
        self.coordinator = Coordinator("tcp://127.0.0.1:0", SETTINGS, snapshot=snapshot, **options)
        self.thread = threading.Thread(target=self.coordinator.serve_forever, daemon=True)
        self.thread.start()
        self.context = zmq.Context()
        self.clients: list[RpcClient] = []

    def client(self, trainer: int, sender: int) -> RpcClient:
        client = RpcClient(self.context, self.coordinator.address, "coordinator", SETTINGS, trainer, sender)
        self.clients.append(client)
        return client

    def stop(self) -> None:
        for client in self.clients:
            client.close()
        self.coordinator.stop()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()
        self.context.term()


@pytest.fixture
def running():
    job = Running()
    yield job
    job.stop()


def ask(dataset: Dataset, **changes) -> str:
    fields = {
        "dataset": str(dataset.path),
        "fingerprint": dataset.fingerprint,
        "records_per_task": 10,
        "passes": 2,
        "shuffle": False,
        "seed": 0,
    }
    return json.dumps(fields | changes)


def test_tasks_are_handed_out_reported_and_counted(running, dataset):
    client = running.client(0, 0xA)
    reply = client.call(Message(Kind.TASK_GET, text=ask(dataset)))
    assert reply.kind == Kind.TASK
    task = json.loads(reply.text)
    assert (task["task"], task["shard"], task["start"], task["stop"], task["pass"]) == (0, 0, 0, 10, 0)
    report = {"lease": task["lease"], "samples": 10, "loss": 0.5}
    assert client.call(Message(Kind.TASK_DONE, text=json.dumps(report))).text == "counted"
    assert client.call(Message(Kind.TASK_DONE, text=json.dumps(report))).text == "stale"  # once only
    status = json.loads(client.call(Message(Kind.STATUS)).text)
    assert status["configured"] and status["done"] == 1 and status["tasks"] == 12  # 4 shards x 3 tasks
    assert status["samples"] == 10 and status["loss"] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "text, message",
    [
        ("not json", "expected a JSON object"),
        (json.dumps([1, 2]), "expected the fields"),
        (json.dumps({"dataset": "x"}), "expected the fields"),
    ],
)
def test_a_malformed_task_request_is_refused(running, text, message):
    with pytest.raises(RemoteError, match=message):
        running.client(0, 0xA).call(Message(Kind.TASK_GET, text=text))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"records_per_task": "10"}, "field 'records_per_task' has a bad value"),
        ({"shuffle": 1}, "field 'shuffle' has a bad value"),
        ({"passes": True}, "field 'passes' has a bad value"),
        ({"fingerprint": "0" * 16}, "do they see the same files"),
        ({"passes": 0}, "passes and records_per_task must be >= 1"),
    ],
)
def test_a_request_with_bad_fields_is_refused(running, dataset, change, message):
    with pytest.raises(RemoteError, match=message):
        running.client(0, 0xA).call(Message(Kind.TASK_GET, text=ask(dataset, **change)))


def test_trainers_must_read_the_same_dataset_the_same_way(running, dataset):
    running.client(0, 0xA).call(Message(Kind.TASK_GET, text=ask(dataset)))
    with pytest.raises(RemoteError, match="every trainer must read the same dataset the same way"):
        running.client(1, 0xB).call(Message(Kind.TASK_GET, text=ask(dataset, records_per_task=5)))


@pytest.mark.parametrize(
    "report, message",
    [
        ({"lease": 1, "samples": -1, "loss": 0.5}, "samples >= 0 and a finite loss"),
        ({"lease": 1, "samples": 3, "loss": math.inf}, "samples >= 0 and a finite loss"),
        ({"lease": 1, "samples": 3}, "expected the fields"),
        ({"lease": "1", "samples": 3, "loss": None}, "field 'lease' has a bad value"),
    ],
)
def test_a_bad_report_is_refused_and_changes_nothing(running, dataset, report, message):
    client = running.client(0, 0xA)
    client.call(Message(Kind.TASK_GET, text=ask(dataset)))
    with pytest.raises(RemoteError, match=message):
        client.call(Message(Kind.TASK_DONE, text=json.dumps(report)))
    status = json.loads(client.call(Message(Kind.STATUS)).text)
    assert status["done"] == 0 and status["pending"] == 1


def test_a_report_before_any_task_is_refused(running):
    with pytest.raises(RemoteError, match="no task was handed out yet"):
        running.client(0, 0xA).call(
            Message(Kind.TASK_DONE, text=json.dumps({"lease": 1, "samples": 1, "loss": None}))
        )


def test_a_restarted_coordinator_resumes_from_its_snapshot(tmp_path, dataset):
    snapshot = tmp_path / "coordinator.json"
    first = Running(snapshot)
    try:
        client = first.client(0, 0xA)
        done = json.loads(client.call(Message(Kind.TASK_GET, text=ask(dataset))).text)
        client.call(
            Message(Kind.TASK_DONE, text=json.dumps({"lease": done["lease"], "samples": 10, "loss": None}))
        )
        held = json.loads(client.call(Message(Kind.TASK_GET, text=ask(dataset))).text)
    finally:
        first.stop()
    second = Running(snapshot)  # what a launcher does after kill -9
    try:
        client = second.client(0, 0xA)
        status = json.loads(client.call(Message(Kind.STATUS)).text)
        assert status["done"] == 1 and status["pending"] == 1
        # The trainer still holds its task: asking again gives the same lease, and its report counts.
        again = json.loads(client.call(Message(Kind.TASK_GET, text=ask(dataset))).text)
        assert again == held
        report = {"lease": held["lease"], "samples": 10, "loss": None}
        assert client.call(Message(Kind.TASK_DONE, text=json.dumps(report))).text == "counted"
    finally:
        second.stop()


# -- a streaming job: windows of a stream -----------------------------------------------------


def window_ask(log_dir, **changes) -> str:
    fields = {"stream": f"log:{log_dir}", "group": "trainers", "window_records": 30, "window_seconds": None,
              "follow": False}  # fmt: skip
    return json.dumps(fields | changes)


def appended(tmp_path, n: int) -> StreamLog:
    log = StreamLog(tmp_path / "log")
    log.append({"x": np.arange(n, dtype=np.float32)})
    return log


def report(
    client: RpcClient,
    window: dict,
    kind: int = Kind.TASK_DONE,
    exact: bool = True,
    checkpoints: dict | None = None,
) -> str:
    body = (
        {
            "lease": window["lease"],
            "samples": window["stop"] - window["start"],
            "loss": None,
            "exact": exact,
            "checkpoints": checkpoints or {},
        }
        if kind == Kind.TASK_DONE
        else {"lease": window["lease"], "reason": "its step failed"}
    )
    return client.call(Message(kind, text=json.dumps(body))).text


def test_windows_are_handed_out_and_the_stream_commits_them_in_order(running, tmp_path):
    log = appended(tmp_path, 100)
    one, two = running.client(0, 0xA), running.client(1, 0xB)
    first = json.loads(one.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    second = json.loads(two.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    assert [(w["window"], w["start"], w["stop"]) for w in (first, second)] == [(0, 0, 30), (1, 30, 60)]
    assert report(two, second) == "counted"
    assert log.committed("trainers") == 0  # window 1 done, but window 0 is not: nothing commits
    assert report(one, first) == "counted"
    assert log.committed("trainers") == 60
    rest = [json.loads(one.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text) for _ in range(2)]
    assert [(w["start"], w["stop"]) for w in rest] == [(60, 90), (60, 90)]  # (it holds one: the same again)
    report(one, rest[0])
    last = json.loads(one.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    assert (last["start"], last["stop"]) == (90, 100)  # what the stream held, the last window short
    report(one, last)
    stopped = one.call(Message(Kind.TASK_GET, text=window_ask(log.path)))
    assert (stopped.kind, stopped.text) == (Kind.NO_TASK, "stopped")
    status = json.loads(one.call(Message(Kind.STATUS)).text)
    assert status["finished"] and status["stream"]["committed"] == 100 == log.committed("trainers")
    assert status["stream"]["records"] == 100


def test_a_failed_window_goes_again_first_and_the_offset_waits_for_it(running, tmp_path):
    log = appended(tmp_path, 90)
    one, two = running.client(0, 0xA), running.client(1, 0xB)
    first = json.loads(one.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    second = json.loads(two.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    assert report(one, first, Kind.TASK_FAILED) == "requeued"
    assert report(two, second) == "counted" and log.committed("trainers") == 0
    again = json.loads(two.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    assert (again["window"], again["start"], again["attempt"]) == (0, 0, 1)  # before window 2
    assert report(one, first) == "stale"  # the old lease cannot finish it now
    assert report(two, again) == "counted" and log.committed("trainers") == 60


def test_a_drained_stream_job_finishes_its_windows_then_says_stopped(running, tmp_path):
    log = appended(tmp_path, 200)
    client = running.client(0, 0xA)
    held = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path, follow=True))).text)
    running.coordinator.drain()  # (what SIGTERM does to a streaming job's coordinator)
    assert report(client, held) == "counted"
    # Only the window in hand is finished: the others cut ahead go back to the stream.
    windows = []
    for _ in range(10):
        reply = client.call(Message(Kind.TASK_GET, text=window_ask(log.path, follow=True)))
        if reply.kind != Kind.TASK:
            break
        windows.append(json.loads(reply.text))
        report(client, windows[-1])
    assert reply.text == "stopped" and windows == []
    assert log.committed("trainers") == 30  # (the rest is the next run's)


def test_a_stream_job_refuses_other_readings(running, tmp_path, dataset):
    log = appended(tmp_path, 40)
    client = running.client(0, 0xA)
    client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))
    with pytest.raises(RemoteError, match="every trainer must read the same stream the same way"):
        client.call(Message(Kind.TASK_GET, text=window_ask(log.path, window_records=10)))
    with pytest.raises(RemoteError, match="asks for a dataset's task, but this job reads a stream"):
        client.call(Message(Kind.TASK_GET, text=ask(dataset)))
    with pytest.raises(RemoteError, match="window_records must be an integer >= 1"):
        running.client(1, 0xB).call(Message(Kind.TASK_GET, text=window_ask(log.path, window_records=0)))


def test_a_restarted_stream_coordinator_resumes_and_commits_again(tmp_path):
    log = appended(tmp_path, 90)
    snapshot = tmp_path / "coordinator.json"
    first = Running(snapshot)
    try:
        client = first.client(0, 0xA)
        done = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
        report(client, done)
        held = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
    finally:
        first.stop()
    log.commit("trainers", 0)  # as if killed after its snapshot, before it told the stream
    second = Running(snapshot)
    try:
        assert log.committed("trainers") == 30  # told again on resuming
        client = second.client(0, 0xA)
        again = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
        assert again == held  # the trainer still holds its window
        assert report(client, again) == "counted" and log.committed("trainers") == 60
    finally:
        second.stop()


def test_sigterm_before_any_window_was_asked_for_still_drains_the_job(tmp_path):
    log = appended(tmp_path, 90)
    job = Running(stream=f"log:{log.path}")
    try:
        job.coordinator.sigterm()  # (as the signal handler does: the loop acts on it)
        client = job.client(0, 0xA)
        deadline = time.monotonic() + 30
        while not job.coordinator._drain_pending:
            assert time.monotonic() < deadline and job.thread.is_alive()
            time.sleep(0.01)
        reply = client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))
        assert (reply.kind, reply.text) == (Kind.NO_TASK, "stopped") and log.committed("trainers") == 0
        with pytest.raises(RemoteError, match="reads stream log:/elsewhere, but this job's stream is log:"):
            client.call(Message(Kind.TASK_GET, text=window_ask("/elsewhere")))
    finally:
        job.stop()


def test_a_job_that_reads_to_the_end_still_drains_on_sigterm(running, tmp_path):
    log = appended(tmp_path, 200)
    client = running.client(0, 0xA)
    held = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path, follow=False))).text)
    running.coordinator.drain()
    assert report(client, held) == "counted"
    reply = client.call(Message(Kind.TASK_GET, text=window_ask(log.path, follow=False)))
    assert reply.text == "stopped" and log.committed("trainers") == 30  # not read to its end


def test_a_window_discarded_by_its_deadline_moves_the_streams_offset(tmp_path):
    log = appended(tmp_path, 60)
    job = Running(task_timeout=0.3, max_failures=0)
    try:
        client = job.client(0, 0xA)
        report(client, json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text))
        client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))  # (warm now) held, never reported
        deadline = time.monotonic() + 30
        while log.committed("trainers") != 60:  # discarded when its lease ran out: committed
            assert time.monotonic() < deadline, log.committed("trainers")
            time.sleep(0.05)
    finally:
        job.stop()


def test_the_books_of_a_finished_or_overtaken_run_are_not_resumed(tmp_path):
    log = appended(tmp_path, 60)
    snapshot = tmp_path / "coordinator.json"
    first = Running(snapshot)
    try:
        client = first.client(0, 0xA)
        for _ in range(2):
            report(client, json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text))
        assert client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text == "stopped"
    finally:
        first.stop()
    log.append({"x": np.arange(60, dtype=np.float32)})
    second = Running(snapshot)  # the next run, with the same books: it reads on from offset 60
    try:
        client = second.client(0, 0xA)
        window = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
        assert (window["start"], window["stop"]) == (60, 90)
    finally:
        second.stop()
    log.commit("trainers", 120)  # another run read the rest meanwhile
    third = Running(snapshot)  # these books are behind the stream: not resumed, nothing read twice
    try:
        client = third.client(0, 0xA)
        assert client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text == "stopped"
        assert log.committed("trainers") == 120
    finally:
        third.stop()


def test_a_window_is_committed_once_the_pservers_checkpoints_hold_it_and_goes_again_when_one_lost_it(
    tmp_path,
):
    log = appended(tmp_path, 60)
    source = f"log:{log.path}"

    def checkpoint(directory, pserver: int, windows: list[int], books=None):
        return stream_books.checkpoint(
            directory, pserver, stream_id(source, "trainers"), windows, books=books
        )

    ckpts = tmp_path / "checkpoints"
    job = Running(stream=source, checkpoints=str(ckpts), pservers=1)
    try:
        client = job.client(0, 0xA)
        books = checkpoint(ckpts, 0, [])  # (as the pserver starts serving)
        deadline = time.monotonic() + 30

        def committed(offset: int) -> None:
            while log.committed("trainers") != offset:
                assert time.monotonic() < deadline, f"offset {offset} was never committed"
                time.sleep(0.05)

        first = json.loads(client.call(Message(Kind.TASK_GET, text=window_ask(log.path))).text)
        # (what the pserver's acknowledgements of the window's gradients said: checkpoint 1)
        assert report(client, first, checkpoints={"0": [1, books.incarnation]}) == "counted"
        assert log.committed("trainers") == 0  # done, but no checkpoint holds it yet
        waiting = client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))
        second = json.loads(waiting.text)
        checkpoint(ckpts, 0, [0], books)  # the pserver checkpoints window 0
        committed(30)
        assert report(client, second, checkpoints={"0": [2, books.incarnation]}) == "counted"
        last = client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))
        assert (last.kind, last.text) == (Kind.NO_TASK, "wait")  # not drained: window 1 may go again

        restored = checkpoint(
            ckpts, 0, [0]
        )  # killed, it came back from that checkpoint (new books) without window 1
        deadline = time.monotonic() + 30
        while (got := client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))).kind != Kind.TASK:
            assert time.monotonic() < deadline, "window 1 never went out again"
            time.sleep(0.05)
        again = json.loads(got.text)
        assert (again["window"], again["start"]) == (1, 30)
        assert report(client, again, checkpoints={"0": [3, restored.incarnation]}) == "counted"
        checkpoint(ckpts, 0, [30], restored)
        committed(60)
        stopped = client.call(Message(Kind.TASK_GET, text=window_ask(log.path)))
        assert (stopped.kind, stopped.text) == (Kind.NO_TASK, "stopped")
        status = json.loads(client.call(Message(Kind.STATUS)).text)["stream"]
        assert status["replayed"] == 1 and status["records"] == 60 and status["awaiting_checkpoints"] == 0
    finally:
        job.stop()
