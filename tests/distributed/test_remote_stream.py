"""RemoteExecutor(JobDesc(stream=...)): a training program with layers.stream_reader runs
as a job of `fluidps serve` processes on 127.0.0.1, a coordinator handing each window of
the stream to one trainer; checked against local training from the same stream.

The model is stream_job.py's counter: w [4, 1] from 0, loss = mean(x w), SGD with
learning rate 1, so each step's gradient is its batch's mean of x whatever w is, and the
final w is minus the sum of the batch means of the records applied. With small integer x
and batches of a power of two every sum is exact in float32, in any order: a batch
applied twice, or not at all, shows. Every record's `idx` is its offset, so what each
step trained on is known too.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import fluidps
from fluidps import layers, optimizer
from fluidps.io import StreamLog

sys.path.insert(0, str(Path(__file__).parent))
from stream_job import WIDTH, records

WINDOW, BATCH = 64, 16
MAX_STEPS = 1000  # a loop bound: the stream ends long before


def counter_program(source: str, group: str, follow: bool):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        idx = layers.data("idx", [1], dtype="int64")
        x = layers.data("x", [WIDTH])
        y = layers.data("y", [1])
        weight = fluidps.ParamAttr(name="w", initializer=fluidps.initializer.Constant(0.0))
        loss = layers.mean(layers.fc(x, 1, param_attr=weight, bias_attr=False))
        optimizer.SGD(1.0).minimize(loss)
        layers.stream_reader(
            source, [idx, x, y], BATCH, group=group, window_records=WINDOW, follow=follow
        )  # fmt: skip
    return main, startup, idx, loss


def train_until_eof(exe, main, idx, loss, steps: int = MAX_STEPS) -> tuple[list[int], list[float]]:
    """The offsets trained on, step after step, and each step's loss; until EOFException
    (or `steps` steps)."""
    seen, losses = [], []
    for _ in range(steps):
        try:
            got, value = exe.run(main, fetch_list=[idx, loss])
        except fluidps.EOFException:
            return seen, losses
        seen += np.asarray(got).reshape(-1).tolist()
        losses.append(float(value))
    assert steps < MAX_STEPS, "the stream never ended"
    return seen, losses


def exact_w(x: np.ndarray, batch: int, window: int) -> np.ndarray:
    """Minus the sum of the batch means, batches cut within windows of `window` records."""
    means = [
        x[i : min(i + batch, start + window, len(x))].mean(axis=0, dtype=np.float64)
        for start in range(0, len(x), window)
        for i in range(start, min(start + window, len(x)), batch)
    ]
    return (-np.sum(means, axis=0)).astype(np.float32).reshape(WIDTH, 1)


@pytest.mark.parametrize(
    "mode, trainers", [("sync", 1), ("async", 2)], ids=["sync-1-trainer", "async-2-trainers"]
)
def test_a_remote_job_trains_every_record_of_a_stream_once_as_local_training_does(tmp_path, mode, trainers):
    total = 6 * WINDOW + 24  # (the last window shorter: batches of 16 and 8)
    log = StreamLog(tmp_path / "log")
    log.append(records(0, total, counter=True))
    source = f"log:{log.path}"
    want = exact_w(records(0, total, counter=True)["x"], BATCH, WINDOW)

    main, startup, idx, loss = counter_program(source, group="local", follow=False)
    local = fluidps.Executor()
    local.run(startup)
    local_seen, local_losses = train_until_eof(local, main, idx, loss)
    assert local_seen == list(range(total))
    np.testing.assert_array_equal(local.scope["w"], want)

    main, startup, idx, loss = counter_program(source, group="trainers", follow=False)
    job = fluidps.JobDesc(pservers=1, trainers=trainers, mode=mode, stream=source)
    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        seen, losses = train_until_eof(exe, main, idx, loss)
        with pytest.raises(fluidps.EOFException, match="is drained"):
            exe.run(main, fetch_list=[loss])  # drained stays drained
        w = exe.scope["w"]
    assert sorted(seen) == list(range(total))  # every record once, by one trainer or the other
    assert log.committed("trainers") == log.end_offset() == total
    np.testing.assert_array_equal(w, want)  # every batch's gradient applied once
    if trainers == 1:  # the same steps in the same order as local training
        assert seen == local_seen
        np.testing.assert_allclose(losses, local_losses, rtol=1e-6)


def test_a_followed_stream_trains_records_as_they_arrive_until_stop_streams_drains_it(tmp_path):
    log = StreamLog(tmp_path / "log")
    first, later = records(0, 2 * WINDOW, counter=True), records(2 * WINDOW, WINDOW, counter=True)
    log.append(first)
    source = f"log:{log.path}"
    main, startup, idx, loss = counter_program(source, group="trainers", follow=True)
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=1, stream=source)) as exe:
        exe.run(startup)
        steps = 2 * WINDOW // BATCH
        seen, _ = train_until_eof(exe, main, idx, loss, steps=steps)
        log.append(later)  # arrives while the job runs
        more, _ = train_until_eof(exe, main, idx, loss, steps=WINDOW // BATCH)
        assert seen + more == list(range(3 * WINDOW))
        # No record is left: the next run waits for one, until another thread drains the
        # stream (as a SIGTERM handler would); then it ends as a local reader does.
        drain = threading.Timer(0.5, exe.stop_streams)
        drain.start()
        try:
            with pytest.raises(fluidps.EOFException, match="is drained"):
                exe.run(main, fetch_list=[loss])
        finally:
            drain.cancel()
            drain.join(timeout=30)
        assert exe.stop_streams() == 1  # (again: no second SIGTERM, which would stop the coordinator)
        w = exe.scope["w"]
        coordinator = (exe.log_dir / "coordinator.log").read_text()
    assert "draining" in coordinator, coordinator[-2000:]
    assert log.committed("trainers") == 3 * WINDOW
    np.testing.assert_array_equal(w, exact_w(np.concatenate([first["x"], later["x"]]), BATCH, WINDOW))
