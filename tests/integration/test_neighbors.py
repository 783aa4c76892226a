"""Busy neighbors, the processes an op profile is timed next to: each runs the program's
steps once it says it is ready, is stopped by its own id however the block ends, and a
neighbor that cannot run its program is an error that says why."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import fluidps
from fluidps import layers
from fluidps.errors import Error
from fluidps.executor.measure.neighbors import busy_neighbors
from fluidps.executor.measure.op_profile import profile_ops
from fluidps.transpiler.cost_model import op_signature


def small_mlp():
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        h = layers.data("x", [16])
        y = layers.data("y", [1], dtype="int64")
        for width in (32, 8):
            h = layers.fc(h, width, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 4), y))
        fluidps.optimizer.SGD(0.1).minimize(loss)
    feed = {"x": np.ones((4, 16), np.float32), "y": np.zeros((4, 1), np.int64)}
    return main, startup, feed


def cpu_ticks(pid: int) -> int:
    """User and system clock ticks process `pid` has run (Linux's /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie not yet reaped by whoever adopted it has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_neighbors_run_steps_while_the_block_runs_and_are_stopped_after_it():
    main, startup, feed = small_mlp()
    with busy_neighbors(main, startup, feed, micro_batches=2, count=2) as pids:
        assert len(pids) == 2 and all(not gone(pid) for pid in pids)
        for pid in pids:  # each is running steps: its CPU time grows
            first, deadline = cpu_ticks(pid), time.monotonic() + 120
            while cpu_ticks(pid) <= first and time.monotonic() < deadline:
                time.sleep(0.05)
            assert cpu_ticks(pid) > first, f"neighbor {pid} is not running"
    assert all(gone(pid) for pid in pids)


def test_neighbors_are_stopped_when_the_block_raises():
    main, startup, feed = small_mlp()
    pids: list[int] = []
    with (
        pytest.raises(RuntimeError, match="the timed work failed"),
        busy_neighbors(main, startup, feed, count=1) as started,
    ):
        pids.extend(started)
        raise RuntimeError("the timed work failed")
    assert pids
    assert all(gone(pid) for pid in pids)


PARENT = """
import sys, time
import numpy as np
from fluidps import Program
from fluidps.executor.measure.neighbors import busy_neighbors
main = Program.parse_from_string(open(sys.argv[1], "rb").read())
startup = Program.parse_from_string(open(sys.argv[2], "rb").read())
feed = {"x": np.ones((4, 16), np.float32), "y": np.zeros((4, 1), np.int64)}
with busy_neighbors(main, startup, feed, count=1) as pids:
    print(pids[0], flush=True)
    time.sleep(600)
"""


def test_a_neighbor_ends_when_the_process_that_started_it_is_killed(tmp_path):
    main, startup, _ = small_mlp()
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())
    (tmp_path / "startup.pb").write_bytes(startup.serialize_to_string())
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "main.pb"), str(tmp_path / "startup.pb")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        neighbor = int(parent.stdout.readline())  # (its neighbor is ready and running)
        assert not gone(neighbor)
    finally:
        parent.kill()  # no finally of its own runs: the neighbor must see its stdin close
        parent.wait(timeout=60)
    deadline = time.monotonic() + 120
    while not gone(neighbor) and time.monotonic() < deadline:
        time.sleep(0.05)
    if not gone(neighbor):
        os.kill(neighbor, signal.SIGKILL)
        pytest.fail(f"neighbor {neighbor} outlived the process that started it")


def test_a_neighbor_that_cannot_run_its_program_is_an_error_that_says_why():
    main, startup, feed = small_mlp()
    missing_y = {"x": feed["x"]}
    with (
        pytest.raises(
            Error,
            match=r"(?s)busy neighbor \(pid \d+\) failed to start: .*FeedError: .*read 'y' from the feed",
        ),
        busy_neighbors(main, startup, missing_y, count=1),
    ):
        pass
    with (
        pytest.raises(Error, match="count must be an int >= 0, got -1"),
        busy_neighbors(main, startup, feed, count=-1),
    ):
        pass


def test_a_profile_timed_next_to_a_neighbor_holds_every_op():
    main, startup, feed = small_mlp()
    profile = profile_ops(main, startup, feed, steps=2, micro_batches=2, neighbors=1)
    block = main.global_block()
    assert {op_signature(block, op, 4) for op in block.ops} == set(profile.seconds)
    assert all(t > 0 for t in profile.seconds.values())
