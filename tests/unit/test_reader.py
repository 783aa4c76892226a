"""layers.dataset_reader: a program that reads its own mini-batches from a sharded dataset.

Every test writes a small dataset whose `idx` field is the record's index, so what a
step read is known exactly. The expected batches are worked out here from the reader's
definition: the dataset cut into tasks (ranges of records within one shard), the tasks
in id order or shuffled per pass with numpy's default_rng([seed, pass]), the records of
a task in batches of batch_size (the last one shorter, or dropped with drop_last).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import fluidps
from fluidps import layers, optimizer

CLASSES = 3
WIDTH = 4
MAX_STEPS = 10_000  # a loop bound: the reader must end long before


@pytest.fixture(autouse=True)
def _no_coordinator(monkeypatch):
    # With FLUIDPS_COORDINATOR set the reader would ask a coordinator for its tasks.
    monkeypatch.delenv("FLUIDPS_COORDINATOR", raising=False)


def records(n: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    idx = np.arange(n, dtype=np.int64).reshape(-1, 1)
    return {
        "idx": idx,
        "x": rng.normal(size=(n, WIDTH)).astype(np.float32),
        "label": (idx * 7 + 1) % CLASSES,
    }


def write(tmp_path, n: int, per_shard: int, name: str = "ds", **extra: np.ndarray) -> fluidps.io.Dataset:
    data = {**records(n), **extra}
    return fluidps.io.Dataset.write(tmp_path / name, data, records_per_shard=per_shard)


def task_ranges(n: int, per_shard: int, per_task: int) -> list[range]:
    """Global record indices of each task, in task id order: tasks never span shards."""
    out = []
    for shard_start in range(0, n, per_shard):
        shard_stop = min(shard_start + per_shard, n)
        for start in range(shard_start, shard_stop, per_task):
            out.append(range(start, min(start + per_task, shard_stop)))
    return out


def pass_order(tasks: int, pass_index: int, shuffle: bool, seed: int) -> list[int]:
    ids = list(range(tasks))
    if shuffle:
        rng = np.random.default_rng([seed, pass_index])
        ids = [ids[i] for i in rng.permutation(len(ids))]
    return ids


def expected_batches(
    n: int,
    per_shard: int,
    per_task: int,
    batch_size: int,
    passes: int = 1,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> list[list[int]]:
    tasks = task_ranges(n, per_shard, per_task)
    out = []
    for p in range(passes):
        for t in pass_order(len(tasks), p, shuffle, seed):
            rows = list(tasks[t])
            for start in range(0, len(rows), batch_size):
                batch = rows[start : start + batch_size]
                if drop_last and len(batch) < batch_size:
                    continue
                out.append(batch)
    return out


def reader_program(dataset, batch_size: int, **kwargs):
    """A main program that only reads: idx, x and label."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        feeds = [
            layers.data("idx", [1], "int64"),
            layers.data("x", [WIDTH], "float32"),
            layers.data("label", [1], "int64"),
        ]
        reader = layers.dataset_reader(dataset, feeds, batch_size, **kwargs)
    return main, startup, feeds, reader


def read_all(exe: fluidps.Executor, main: fluidps.Program, fetch: list) -> list[list[np.ndarray]]:
    steps = []
    for _ in range(MAX_STEPS):
        try:
            steps.append(exe.run(main, fetch_list=fetch))
        except fluidps.EOFException:
            return steps
    raise AssertionError(f"no EOFException after {MAX_STEPS} steps")


def idx_batches(steps: list[list[np.ndarray]]) -> list[list[int]]:
    return [s[0][:, 0].tolist() for s in steps]


# -- what is read, in what order -------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_record_once_per_pass_in_the_task_order_then_eof(tmp_path, shuffle):
    n, per_shard, per_task, batch = 50, 20, 8, 3
    dataset = write(tmp_path, n, per_shard)
    tasks = dataset.tasks(per_task)
    assert [range(per_shard * t.shard + t.start, per_shard * t.shard + t.stop) for t in tasks] == task_ranges(
        n, per_shard, per_task
    )
    main, startup, feeds, _ = reader_program(
        dataset.path, batch, passes=3, records_per_task=per_task, shuffle=shuffle, seed=11
    )
    exe = fluidps.Executor()
    exe.run(startup)
    steps = read_all(exe, main, feeds)
    want = expected_batches(n, per_shard, per_task, batch, passes=3, shuffle=shuffle, seed=11)
    assert len(steps) == len(want)
    assert idx_batches(steps) == want
    data = records(n)
    for (idx, x, label), rows in zip(steps, want, strict=True):
        assert idx.dtype == np.int64 and x.dtype == np.float32 and label.dtype == np.int64
        np.testing.assert_array_equal(x, data["x"][rows])
        np.testing.assert_array_equal(label, data["label"][rows])
    # Each pass reads every record exactly once.
    per_pass = sum(len(b) for b in want) // 3
    assert per_pass == n
    flat = [i for b in idx_batches(steps) for i in b]
    for p in range(3):
        assert sorted(flat[p * n : (p + 1) * n]) == list(range(n))
    if shuffle:  # the passes really are in different orders
        assert flat[:n] != flat[n : 2 * n] and flat[:n] != list(range(n))
    else:
        assert flat[:n] == list(range(n))
    # The end of the data stays the end.
    for _ in range(2):
        with pytest.raises(fluidps.EOFException):
            exe.run(main, fetch_list=feeds)


def test_the_seed_picks_the_order(tmp_path):
    n, per_shard, per_task, batch = 40, 40, 5, 5
    dataset = write(tmp_path, n, per_shard)
    orders = []
    for seed in (1, 2):
        main, startup, feeds, _ = reader_program(dataset.path, batch, records_per_task=per_task, seed=seed)
        exe = fluidps.Executor()
        exe.run(startup)
        got = idx_batches(read_all(exe, main, feeds))
        assert got == expected_batches(n, per_shard, per_task, batch, seed=seed)
        orders.append(got)
    assert orders[0] != orders[1]


def test_default_records_per_task_is_four_batches_for_a_small_dataset(tmp_path):
    n, per_shard, batch = 50, 30, 3  # 4 batches = 12 records > ceil(50 / 256)
    dataset = write(tmp_path, n, per_shard)
    main, startup, feeds, _ = reader_program(dataset.path, batch, shuffle=False)
    exe = fluidps.Executor()
    exe.run(startup)
    got = idx_batches(read_all(exe, main, feeds))
    assert got == expected_batches(n, per_shard, 12, batch, shuffle=False)


def test_default_records_per_task_gives_a_large_dataset_at_most_256_tasks(tmp_path):
    n, batch = 1100, 1  # ceil(1100 / 256) = 5 records per task > 4 batches of 1
    dataset = fluidps.io.Dataset.write(
        tmp_path / "ds", {"idx": np.arange(n, dtype=np.int64).reshape(-1, 1)}, records_per_shard=n
    )
    per_task = max(4 * batch, math.ceil(n / 256))
    assert per_task == 5
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        idx = layers.data("idx", [1], "int64")
        layers.dataset_reader(dataset.path, [idx], batch, seed=5)
    exe = fluidps.Executor()
    exe.run(startup)
    got = [b[0] for b in idx_batches(read_all(exe, main, [idx]))]
    want = [b[0] for b in expected_batches(n, n, per_task, batch, seed=5)]
    assert got == want


def test_drop_last_drops_the_short_batch_of_every_task(tmp_path):
    n, per_shard, per_task, batch = 22, 22, 8, 3  # tasks of 8, 8, 6 records
    dataset = write(tmp_path, n, per_shard)
    runs = {}
    for drop_last in (False, True):
        main, startup, feeds, _ = reader_program(
            dataset.path, batch, records_per_task=per_task, shuffle=False, drop_last=drop_last
        )
        exe = fluidps.Executor()
        exe.run(startup)
        runs[drop_last] = idx_batches(read_all(exe, main, feeds))
    assert [len(b) for b in runs[False]] == [3, 3, 2, 3, 3, 2, 3, 3]
    assert runs[True] == [[0, 1, 2], [3, 4, 5], [8, 9, 10], [11, 12, 13], [16, 17, 18], [19, 20, 21]]
    assert runs[True] == [b for b in runs[False] if len(b) == batch]
    assert runs[True] == expected_batches(n, per_shard, per_task, batch, shuffle=False, drop_last=True)


def test_drop_last_skips_a_task_smaller_than_a_batch(tmp_path):
    n, per_shard, per_task, batch = 10, 5, 5, 4  # two tasks of 5: one batch of 4 each
    dataset = write(tmp_path, n, per_shard)
    main, startup, feeds, _ = reader_program(
        dataset.path, batch, records_per_task=per_task, shuffle=False, drop_last=True, passes=2
    )
    exe = fluidps.Executor()
    exe.run(startup)
    assert idx_batches(read_all(exe, main, feeds)) == [[0, 1, 2, 3], [5, 6, 7, 8]] * 2


def test_fields_map_dataset_fields_to_differently_named_variables(tmp_path):
    n = 12
    data = records(n)
    dataset = fluidps.io.Dataset.write(
        tmp_path / "ds",
        {"feature": data["x"], "target": data["label"], "record": data["idx"]},
        records_per_shard=5,
    )
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [WIDTH], "float32")
        y = layers.data("y", [1], "int64")
        i = layers.data("i", [1], "int64")
        layers.dataset_reader(
            dataset, [i, x, y], 2, fields=["record", "feature", "target"], records_per_task=3, seed=4
        )
    exe = fluidps.Executor()
    exe.run(startup)
    steps = read_all(exe, main, [i, x, y])
    want = expected_batches(n, 5, 3, 2, seed=4)
    assert idx_batches(steps) == want
    for (_, got_x, got_y), rows in zip(steps, want, strict=True):
        np.testing.assert_array_equal(got_x, data["x"][rows])
        np.testing.assert_array_equal(got_y, data["label"][rows])


def test_a_reader_of_some_fields_ignores_the_others(tmp_path):
    dataset = write(tmp_path, 9, 9)
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        idx = layers.data("idx", [1], "int64")
        layers.dataset_reader(dataset, [idx], 4, shuffle=False)
    exe = fluidps.Executor()
    exe.run(startup)
    assert idx_batches(read_all(exe, main, [idx])) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


# -- the reader's life: startup, restart --------------------------------------------------------


def test_reading_before_the_startup_program_says_to_run_it(tmp_path):
    dataset = write(tmp_path, 10, 10)
    main, startup, feeds, _ = reader_program(dataset.path, 2)
    exe = fluidps.Executor()
    with pytest.raises(fluidps.ExecutionError, match="startup"):
        exe.run(main, fetch_list=feeds)
    exe.run(startup)  # then it reads from the first batch
    got = idx_batches(read_all(exe, main, feeds))
    assert got == expected_batches(10, 10, 8, 2)


def test_running_the_startup_again_restarts_reading(tmp_path):
    n, per_task, batch = 20, 4, 3
    dataset = write(tmp_path, n, n)
    main, startup, feeds, _ = reader_program(dataset.path, batch, records_per_task=per_task, seed=2)
    want = expected_batches(n, n, per_task, batch, seed=2)
    exe = fluidps.Executor()
    exe.run(startup)
    first = idx_batches([exe.run(main, fetch_list=feeds) for _ in range(3)])  # into the second task
    assert first == want[:3]
    exe.run(startup)
    assert idx_batches(read_all(exe, main, feeds)) == want
    exe.run(startup)  # after the end, too
    assert idx_batches(read_all(exe, main, feeds)) == want
    with pytest.raises(fluidps.EOFException):
        exe.run(main, fetch_list=feeds)


def test_running_the_startup_again_closes_the_reader_it_replaces(tmp_path):
    # The create_dataset_reader kernel closes the scope's previous reader (its half-read
    # task is given back): a replaced reader left open still counts as reading, which
    # makes an elastic trainer's exe.close() say "pause" instead of "complete".
    dataset = write(tmp_path, 20, 20)
    main, startup, feeds, reader = reader_program(dataset.path, 3, records_per_task=4)
    exe = fluidps.Executor()
    exe.run(startup)
    exe.run(main, fetch_list=feeds)
    old = exe.scope[reader.name]
    assert old.reading
    exe.run(startup)
    new = exe.scope[reader.name]
    assert new is not old
    read_all(exe, main, feeds)
    assert not new.reading
    assert not old.reading, "running the startup again left the replaced reader open, holding its task"


def test_two_executors_read_independently(tmp_path):
    dataset = write(tmp_path, 15, 15)
    main, startup, feeds, _ = reader_program(dataset.path, 4, records_per_task=5, seed=3)
    a, b = fluidps.Executor(), fluidps.Executor()
    a.run(startup)
    b.run(startup)
    first = a.run(main, fetch_list=feeds)[0][:, 0].tolist()
    rest_a = idx_batches(read_all(a, main, feeds))
    all_b = idx_batches(read_all(b, main, feeds))
    assert [first, *rest_a] == all_b == expected_batches(15, 15, 5, 4, seed=3)


def test_a_test_program_cloned_before_the_reader_does_not_read(tmp_path):
    dataset = write(tmp_path, 12, 12)
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [WIDTH], "float32")
        label = layers.data("label", [1], "int64")
        logits = layers.fc(x, CLASSES)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        test = main.clone(for_test=True)
        optimizer.SGD(0.1).minimize(loss)
        layers.dataset_reader(dataset, [x, label], 4, records_per_task=4, shuffle=False)
    assert main.global_block().ops[0].type == "read"
    assert "read" not in [op.type for op in test.global_block().ops]
    assert not any(v.type == fluidps.VarType.READER for v in test.global_block().vars.values())
    exe = fluidps.Executor()
    exe.run(startup)
    data = records(12)
    # The test program needs its inputs fed, and running it consumes nothing from the reader.
    with pytest.raises(fluidps.FeedError):
        exe.run(test, fetch_list=[logits])
    feed = {"x": data["x"][:2], "label": data["label"][:2]}
    out, test_loss = exe.run(test, feed=feed, fetch_list=[logits, loss])
    assert out.shape == (2, CLASSES) and np.isfinite(test_loss).all()
    got_x = exe.run(main, fetch_list=[x])[0]
    np.testing.assert_array_equal(got_x, data["x"][0:4])


# -- training through the reader equals training on the same batches fed ------------------


def model(dataset=None, random_seed: int = 7, **reader_kwargs):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = random_seed
    with fluidps.program_guard(main, startup):
        idx = layers.data("idx", [1], "int64")
        x = layers.data("x", [WIDTH], "float32")
        label = layers.data("label", [1], "int64")
        hidden = layers.fc(x, 5, act="tanh")
        logits = layers.fc(hidden, CLASSES)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, label))
        optimizer.SGD(0.2).minimize(loss)
        if dataset is not None:
            layers.dataset_reader(dataset, [idx, x, label], **reader_kwargs)
    return main, startup, idx, loss


def params(exe: fluidps.Executor, main: fluidps.Program) -> dict[str, np.ndarray]:
    return {p.name: np.array(exe.scope[p.name]) for p in main.all_parameters()}


def train_fed(batches: list[list[int]], data: dict[str, np.ndarray]):
    main, startup, _, loss = model()
    exe = fluidps.Executor()
    exe.run(startup)
    losses = []
    for rows in batches:
        feed = {"x": data["x"][rows], "label": data["label"][rows]}
        losses.append(exe.run(main, feed=feed, fetch_list=[loss])[0])
    return params(exe, main), losses


def train_read(exe: fluidps.Executor, main, idx, loss):
    steps = read_all(exe, main, [idx, loss])
    return params(exe, main), idx_batches(steps), [s[1] for s in steps]


def test_training_through_the_reader_equals_feeding_the_same_batches(tmp_path):
    n, per_shard, per_task, batch = 45, 20, 7, 3
    dataset = write(tmp_path, n, per_shard)
    kwargs = dict(batch_size=batch, passes=2, records_per_task=per_task, seed=9)
    main, startup, idx, loss = model(dataset.path, **kwargs)
    exe = fluidps.Executor()
    exe.run(startup)
    initial = params(exe, main)
    got_params, got_batches, got_losses = train_read(exe, main, idx, loss)
    want = expected_batches(n, per_shard, per_task, batch, passes=2, seed=9)
    assert got_batches == want
    fed_params, fed_losses = train_fed(want, records(n))
    assert fed_params.keys() == got_params.keys() == initial.keys()
    for name, value in fed_params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)
        assert not np.array_equal(value, initial[name])  # it did train
    np.testing.assert_array_equal(np.array(got_losses), np.array(fed_losses))


# -- serialization ----------------------------------------------------------------------------


def test_a_reader_program_round_trips_through_its_protobuf_and_still_trains(tmp_path):
    n, per_task, batch = 30, 6, 4
    dataset = write(tmp_path, n, 12)
    kwargs = dict(batch_size=batch, records_per_task=per_task, seed=1, drop_last=True, passes=2)
    main, startup, idx, loss = model(dataset.path, **kwargs)
    fluidps.verify(main)
    fluidps.verify(startup)
    parsed_main = fluidps.Program.parse_from_string(main.serialize_to_string())
    parsed_startup = fluidps.Program.parse_from_string(startup.serialize_to_string())
    fluidps.verify(parsed_main)
    fluidps.verify(parsed_startup)
    assert parsed_main.serialize_to_string() == main.serialize_to_string()
    assert parsed_startup.serialize_to_string() == startup.serialize_to_string()
    assert [op.type for op in parsed_main.global_block().ops] == [op.type for op in main.global_block().ops]
    read = parsed_main.global_block().ops[0]
    assert read.type == "read" and read.output("Out") == ["idx", "x", "label"]
    (create,) = [op for op in parsed_startup.global_block().ops if op.type == "create_dataset_reader"]
    assert create.output("Out") == read.input("Reader")
    assert parsed_main.global_block().var(read.input("Reader")[0]).type == fluidps.VarType.READER
    assert {a: create.attr(a) for a in ("fields", "batch_size", "records_per_task", "passes")} == {
        "fields": ["idx", "x", "label"],
        "batch_size": batch,
        "records_per_task": per_task,
        "passes": 2,
    }
    assert (create.attr("shuffle"), create.attr("seed"), create.attr("drop_last")) == (True, 1, True)

    exe = fluidps.Executor()
    exe.run(startup)
    want_params, want_batches, want_losses = train_read(exe, main, idx, loss)
    assert want_batches == expected_batches(n, 12, per_task, batch, passes=2, seed=1, drop_last=True)

    parsed_startup.random_seed = startup.random_seed  # the seed is not part of the ProgramDesc
    exe = fluidps.Executor()
    exe.run(parsed_startup)
    got_params, got_batches, got_losses = train_read(exe, parsed_main, "idx", loss.name)
    assert got_batches == want_batches
    np.testing.assert_array_equal(np.array(got_losses), np.array(want_losses))
    for name, value in want_params.items():
        np.testing.assert_array_equal(got_params[name], value, err_msg=name)


# -- builder errors -----------------------------------------------------------------------------


def _build(dataset, declare, *, startup=True, **kwargs):
    main = fluidps.Program()
    start = fluidps.Program() if startup else None
    with fluidps.program_guard(main, start):
        feeds = declare()
        before = ([op.type for op in main.global_block().ops], set(main.global_block().vars))
        try:
            layers.dataset_reader(dataset, feeds, kwargs.pop("batch_size", 2), **kwargs)
        finally:
            # A refused reader leaves both programs as they were.
            assert ([op.type for op in main.global_block().ops], set(main.global_block().vars)) == before
            if start is not None:
                assert start.global_block().ops == []


def _elsewhere():
    other = fluidps.Program()
    with fluidps.program_guard(other, fluidps.Program()):
        return [layers.data("idx", [1], "int64")]


@pytest.mark.parametrize(
    ("declare", "kwargs", "message"),
    [
        (lambda: [layers.data("idx", [1], "int64")], {"fields": ["nope"]}, "no field 'nope'"),
        (lambda: [layers.data("idx", [1], "float32")], {}, "does not fit"),
        (lambda: [layers.data("idx", [2], "int64")], {}, "does not fit"),
        (lambda: [layers.data("x", [WIDTH, 1], "float32")], {}, "does not fit"),
        (lambda: [layers.data("idx", [1], "int64")], {"fields": ["idx", "x"]}, "2 fields for 1"),
        (
            lambda: [layers.data("idx", [1], "int64"), layers.data("x", [WIDTH])],
            {"fields": ["x"]},
            "1 fields",
        ),
        (lambda: [], {}, "0 fields for 0"),
        (lambda: [layers.data("idx", [1], "int64")], {"batch_size": 0}, "batch_size"),
        (lambda: [layers.data("idx", [1], "int64")], {"passes": 0}, "passes"),
        (lambda: [layers.data("idx", [1], "int64")], {"records_per_task": -1}, "records_per_task"),
        (_elsewhere, {}, "not a variable of the main program"),
    ],
)
def test_builder_errors(tmp_path, declare, kwargs, message):
    dataset = write(tmp_path, 6, 6)
    with pytest.raises(fluidps.BuilderError, match=message):
        _build(dataset.path, declare, **kwargs)


def test_a_reader_needs_a_startup_program(tmp_path):
    dataset = write(tmp_path, 6, 6)
    with pytest.raises(fluidps.BuilderError, match="startup program"):
        _build(dataset.path, lambda: [layers.data("idx", [1], "int64")], startup=False)


def test_a_missing_dataset_directory_is_a_dataset_error(tmp_path):
    with pytest.raises(fluidps.DatasetError, match="not a directory"):
        _build(tmp_path / "missing", lambda: [layers.data("idx", [1], "int64")])


# -- failing steps: the task goes back, and is discarded after repeated failures -------------


def test_a_task_whose_step_always_fails_is_retried_then_discarded(tmp_path):
    # 24 records in tasks of 4 (ids 0..5), batches of 2. Record 14 (task 3, its second
    # batch) looks up an id outside the embedding table, so task 3 always fails there.
    n, per_task, batch, rows = 24, 4, 2, 10
    ids = np.arange(n, dtype=np.int64).reshape(-1, 1) % rows
    ids[14] = rows
    dataset = write(tmp_path, n, n, ids=ids)
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    with fluidps.program_guard(main, startup):
        idx = layers.data("idx", [1], "int64")
        words = layers.data("ids", [1], "int64")
        label = layers.data("label", [1], "int64")
        emb = layers.embedding(words, [rows, WIDTH])
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(emb, CLASSES), label))
        optimizer.SGD(0.1).minimize(loss)
        layers.dataset_reader(
            dataset, [idx, words, label], batch, records_per_task=per_task, shuffle=False, passes=2
        )
    exe = fluidps.Executor()
    exe.run(startup)
    read, failures = [], []
    for _ in range(MAX_STEPS):
        try:
            read.append(exe.run(main, fetch_list=[idx, loss])[0][:, 0].tolist())
        except fluidps.ExecutionError as e:
            failures.append(str(e))
        except fluidps.EOFException:
            break
    else:
        raise AssertionError("no EOFException")
    # Fails (max_failures = 3) three times, requeued each time; the fourth discards it.
    assert len(failures) == 4
    assert all("lookup_table" in f and "out of range" in f for f in failures)
    task = [list(range(4 * t, 4 * t + 4)) for t in range(6)]

    def batches(t: int) -> list[list[int]]:
        return [task[t][:2], task[t][2:]]

    first_pass = [*batches(0), *batches(1), *batches(2), task[3][:2]]
    first_pass += [*batches(4), *batches(5)] + [task[3][:2]] * 3  # requeued at the end
    second_pass = [b for t in (0, 1, 2, 4, 5) for b in batches(t)]  # task 3 is gone
    assert read == first_pass + second_pass
    # Every record of the other tasks was read once per pass; record 14's batch never ran.
    counts = np.bincount([i for b in read for i in b], minlength=n)
    others = [i for t in (0, 1, 2, 4, 5) for i in task[t]]
    assert counts[others].tolist() == [2] * len(others)
    assert counts[[14, 15]].tolist() == [0, 0]
    with pytest.raises(fluidps.EOFException):
        exe.run(main, fetch_list=[idx])


def test_a_corrupt_shard_fails_its_tasks_and_the_others_are_read(tmp_path):
    n, per_shard, per_task, batch = 12, 6, 3, 3
    dataset = write(tmp_path, n, per_shard)
    shard = dataset.path / dataset.shards[0].file
    body = bytearray(shard.read_bytes())
    body[-10] ^= 0xFF
    shard.write_bytes(bytes(body))
    main, startup, feeds, _ = reader_program(dataset.path, batch, records_per_task=per_task, shuffle=False)
    exe = fluidps.Executor()
    exe.run(startup)
    read, failures = [], []
    for _ in range(MAX_STEPS):
        try:
            read.append(exe.run(main, fetch_list=feeds)[0][:, 0].tolist())
        except fluidps.ExecutionError as e:
            failures.append(str(e))
        except fluidps.EOFException:
            break
    else:
        raise AssertionError("no EOFException")
    assert read == [[6, 7, 8], [9, 10, 11]]  # shard 1's two tasks
    assert len(failures) == 2 * 4  # shard 0's two tasks, four tries each
    assert all("corrupt" in f for f in failures)
