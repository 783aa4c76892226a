"""layers.stream_reader: a program that trains from a stream, window after window.

Every record carries its offset in its `idx` field, so what a step read is known exactly.
A stream is cut into windows of `window_records` records from the consumer group's
committed offset; a window's batches are read in offset order; the group's offset moves
past a window once the step using its last batch has run.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import fluidps
from fluidps import layers, optimizer
from fluidps.errors import BuilderError, StreamError
from fluidps.io import StreamLog
from fluidps.io.stream_log import HEADER

WIDTH = 4
MAX_STEPS = 10_000  # a loop bound: the reader must end long before


@pytest.fixture(autouse=True)
def _no_coordinator(monkeypatch):
    monkeypatch.delenv("FLUIDPS_COORDINATOR", raising=False)


def records(start: int, n: int) -> dict[str, np.ndarray]:
    idx = np.arange(start, start + n, dtype=np.int64)
    rng = np.random.default_rng(start)
    x = rng.normal(size=(n, WIDTH)).astype(np.float32)
    return {"idx": idx[:, None], "x": x, "y": (x.sum(1, keepdims=True) * 0.5 + 1).astype(np.float32)}


def model(source: str | None, batch: int, **reader: object):
    """Linear regression on x -> y; `source`: read from that stream (else fed)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        idx = layers.data("idx", [1], dtype="int64")
        x = layers.data("x", [WIDTH])
        y = layers.data("y", [1])
        if source is not None:
            layers.stream_reader(source, [idx, x, y], batch, **reader)
        loss = layers.mean(layers.square(layers.elementwise_sub(layers.fc(x, 1), y)))
        optimizer.SGD(0.05).minimize(loss)
    return main, startup, idx, loss


def train(exe, main, idx, loss, scope, stop_after: int | None = None) -> list[np.ndarray]:
    """Run until the reader ends; the idx of each step's batch. `stop_after`: drain the
    readers once that many records were read."""
    seen: list[np.ndarray] = []
    for _ in range(MAX_STEPS):
        try:
            got, _ = exe.run(main, fetch_list=[idx, loss], scope=scope)
        except fluidps.EOFException:
            return seen
        seen.append(got.reshape(-1))
        if stop_after is not None and sum(map(len, seen)) >= stop_after:
            exe.stop_streams()
    raise AssertionError("the reader did not end")


def params(scope) -> dict[str, np.ndarray]:
    return {n: np.array(scope.find(n)) for n in ("fc_0.w_0", "fc_0.b_0")}


def test_a_stream_trains_as_its_records_fed_in_windows_and_commits_the_offset(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(records(0, 100))
    main, startup, idx, loss = model(f"log:{tmp_path / 'log'}", 16, window_records=40, follow=False)
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    log.append(records(100, 20))  # after the reader was made, before it read: still in
    seen = train(exe, main, idx, loss, scope)
    exe.close()
    # windows [0, 40), [40, 80), [80, 120) (the last one all that was there), 16 a batch
    want = [
        list(range(a, min(a + 16, b))) for a, b in ((0, 40), (40, 80), (80, 120)) for a in range(a, b, 16)
    ]
    assert [s.tolist() for s in seen] == want
    assert log.committed("trainers") == 120

    fed_main, fed_startup, _, fed_loss = model(None, 16)
    fed = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(fed_startup, scope=fed)
    first, later = records(0, 100), records(100, 20)
    everything = {k: np.concatenate([first[k], later[k]]) for k in first}
    for rows in want:
        exe.run(fed_main, feed={k: v[rows] for k, v in everything.items()}, fetch_list=[fed_loss], scope=fed)
    for name, value in params(scope).items():
        np.testing.assert_array_equal(value, params(fed)[name], err_msg=name)


def test_a_new_reader_of_the_group_goes_on_where_the_last_one_committed(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(records(0, 50))
    source = f"log:{tmp_path / 'log'}"
    main, startup, idx, loss = model(source, 10, window_records=20, follow=False)
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    first = np.concatenate(train(exe, main, idx, loss, scope))
    log.append(records(50, 30))
    exe.run(startup, scope=scope)  # a new reader: from the group's committed offset
    second = np.concatenate(train(exe, main, idx, loss, scope))
    exe.close()
    assert first.tolist() == list(range(50)) and second.tolist() == list(range(50, 80))
    assert log.committed("trainers") == 80 and log.committed("others") == 0  # (per group)


def test_a_followed_stream_trains_as_records_arrive_and_drains_at_a_window_boundary(tmp_path):
    log = StreamLog(tmp_path / "log")
    main, startup, idx, loss = model(f"log:{tmp_path / 'log'}", 8, window_records=32)
    stop_appending = threading.Event()

    def appender() -> None:
        start = 0
        while not stop_appending.is_set() and start < 5000:
            log.append(records(start, 24))
            start += 24
            stop_appending.wait(0.01)

    thread = threading.Thread(target=appender, daemon=True)
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    thread.start()
    try:
        seen = np.concatenate(train(exe, main, idx, loss, scope, stop_after=100))
    finally:
        stop_appending.set()
        thread.join(timeout=60)
    exe.close()
    # Drained: the window in hand was finished (its records all read), and no more.
    assert seen.tolist() == list(range(len(seen))) and len(seen) % 32 == 0 and len(seen) >= 100
    assert log.committed("trainers") == len(seen) and log.end_offset() >= len(seen)


def test_a_window_closes_on_time_when_records_come_slowly(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(records(0, 5))  # far fewer than a window's count
    main, startup, idx, loss = model(f"log:{tmp_path / 'log'}", 4, window_records=1000, window_seconds=0.2)
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    seen = np.concatenate(train(exe, main, idx, loss, scope, stop_after=5))
    exe.close()
    assert seen.tolist() == [0, 1, 2, 3, 4] and log.committed("trainers") == 5


def damaged_log(tmp_path, bad: list[int]) -> tuple[StreamLog, int]:
    """A log of records 0..9 with a bit flipped in the fields of each of `bad`; the log and
    a record's size."""
    log = StreamLog(tmp_path / "log")
    log.append(records(0, 10))
    segment = log.segments()[0][1]
    size = (segment.stat().st_size - HEADER.size) // 10
    data = bytearray(segment.read_bytes())
    for offset in bad:
        data[HEADER.size + offset * size + 20] ^= 0xFF
    segment.write_bytes(bytes(data))
    return log, size


def test_records_that_fail_their_check_are_skipped_and_reported(tmp_path, capfd):
    log, _ = damaged_log(tmp_path, [3])
    main, startup, idx, loss = model(f"log:{tmp_path / 'log'}", 4, window_records=10, follow=False)
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    seen = np.concatenate(train(exe, main, idx, loss, scope))
    exe.close()
    assert seen.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 9]  # never trained on
    assert "1 bad record(s) skipped, the first at offset 3" in capfd.readouterr().err
    assert log.committed("trainers") == 10


def reader_of(source: str, name: str, shape: list[int], **options: object) -> None:
    with fluidps.program_guard(fluidps.Program(), fluidps.Program()):
        layers.stream_reader(source, [layers.data(name, shape)], 4, **options)


def test_bad_readers_are_refused_with_the_reason(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(records(0, 3))
    source = f"log:{tmp_path / 'log'}"
    with pytest.raises(BuilderError, match="has no field 'label'"):
        reader_of(source, "label", [1])
    with pytest.raises(
        BuilderError, match=r"field x float32\[4\] does not fit data variable 'x' float32\[-1, 3\]"
    ):
        reader_of(source, "x", [3])
    with pytest.raises(StreamError, match="consumer group"):
        reader_of(source, "x", [WIDTH], group="no spaces")
    with pytest.raises(BuilderError, match="window_records must be >= 1"):
        reader_of(source, "x", [WIDTH], window_records=0)
    with pytest.raises(StreamError, match="expected log:DIR"):
        reader_of("kafka://x", "x", [WIDTH])


def test_a_stream_with_no_records_yet_is_checked_when_its_records_come(tmp_path):
    """A reader made before the first append: its fields are checked by the read op."""
    source = f"log:{tmp_path / 'log'}"
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [WIDTH], dtype="float64")  # the stream will hold float32
        layers.stream_reader(source, [x], 4, window_records=4, follow=False)
        out = layers.scale(x, 2.0)
    StreamLog(tmp_path / "log").append(records(0, 4))
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    with pytest.raises(fluidps.ExecutionError, match="field 'x' is float32"):
        exe.run(main, fetch_list=[out], scope=scope)


def test_records_that_fail_their_check_go_to_the_dead_letter_file(tmp_path, monkeypatch):
    import base64
    import json

    _, size = damaged_log(tmp_path, [3, 7])
    letters = tmp_path / "letters" / "bad.jsonl"
    monkeypatch.setenv("FLUIDPS_DEAD_LETTERS", str(tmp_path / "elsewhere.jsonl"))  # (the reader's own wins)
    main, startup, idx, loss = model(
        f"log:{tmp_path / 'log'}", 4, window_records=5, follow=False, dead_letters=letters
    )
    scope = fluidps.Scope()
    exe = fluidps.Executor()
    exe.run(startup, scope=scope)
    seen = np.concatenate(train(exe, main, idx, loss, scope))
    exe.close()
    assert seen.tolist() == [0, 1, 2, 4, 5, 6, 8, 9]
    lines = [json.loads(line) for line in letters.read_text().splitlines()]
    assert [(x["offset"], x["window"], x["group"]) for x in lines] == [
        (3, [0, 5], "trainers"),
        (7, [5, 10], "trainers"),
    ]
    assert all(
        "CRC" in x["reason"] and len(base64.b64decode(x["raw"])) == x["raw_bytes"] == size for x in lines
    )
    assert not (tmp_path / "elsewhere.jsonl").exists()
