"""Process-group stopping (fluidps.executor.launch.processes) on real processes.

Each test starts a leader in its own process group; the leader starts a grandchild
that sleeps in the same group and prints its pid. Every wait is bounded, and the
`started` fixture SIGKILLs, by its own id, anything a failing test left behind.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from fluidps.executor.launch.processes import (
    kill_all,
    reap_group,
    signal_group,
    stop_group,
    stop_groups,
    wait_groups,
)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

# argv: "exit" (exit 3 at once, leaving the grandchild behind) or "ignore-term" (leader and
# grandchild ignore SIGTERM); otherwise the leader sleeps and SIGTERM kills both.
LEADER = r"""
import signal, subprocess, sys, time
ignore = "ignore-term" in sys.argv
if ignore:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
grandchild = subprocess.Popen([sys.executable, "-c", (
    "import signal, sys, time\n"
    + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore else "")
    + "print('ready', flush=True)\n"
    + "time.sleep(120)"
)], stdout=subprocess.PIPE)
grandchild.stdout.readline()  # its SIGTERM handling is in place
print(grandchild.pid, flush=True)
if "exit" in sys.argv:
    sys.exit(3)
time.sleep(120)
"""
WAIT_S = 10.0


def _group_of(pid: int) -> int | None:
    """The process group of a live process `pid`, None once it is gone (or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
    return None if fields[0] in "ZX" else int(fields[2])


def _wait_gone(pid: int, group: int, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while _group_of(pid) == group:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def started():
    """start(*args) -> (leader, grandchild pid); whatever is left is SIGKILLed at the end."""
    made: list[tuple[subprocess.Popen, int | None]] = []

    def start(*args: str) -> tuple[subprocess.Popen, int]:
        leader = subprocess.Popen(
            [sys.executable, "-c", LEADER, *args], stdout=subprocess.PIPE, process_group=0
        )
        made.append((leader, None))
        ready, _, _ = select.select([leader.stdout], [], [], WAIT_S)
        line = leader.stdout.readline() if ready else b""
        assert line.strip().isdigit(), f"the leader did not start its grandchild: {line!r}"
        grandchild = int(line)
        made[-1] = (leader, grandchild)
        assert _group_of(grandchild) == leader.pid
        return leader, grandchild

    yield start
    for leader, grandchild in made:
        # Only ids that are still ours: the grandchild is checked to be in the leader's group.
        if grandchild is not None and _group_of(grandchild) == leader.pid:
            os.kill(grandchild, signal.SIGKILL)
        if leader.returncode is None:
            leader.kill()
            leader.wait(WAIT_S)
        leader.stdout.close()


def test_reap_group_kills_what_an_exited_leader_left(started):
    leader, grandchild = started("exit")
    deadline = time.monotonic() + WAIT_S
    while (status := reap_group(leader)) is None:
        assert time.monotonic() < deadline, "the leader did not exit"
        time.sleep(0.02)
    assert status == 3 and leader.returncode == 3
    assert _wait_gone(grandchild, leader.pid), "the grandchild outlived its reaped leader"


def test_stop_group_terminates_the_whole_group(started):
    leader, grandchild = started()
    assert stop_group(leader, term_timeout=WAIT_S) == -signal.SIGTERM
    assert _wait_gone(grandchild, leader.pid)


def test_stop_group_escalates_to_sigkill(started):
    leader, grandchild = started("ignore-term")
    assert stop_group(leader, term_timeout=0.5) == -signal.SIGKILL
    assert _wait_gone(grandchild, leader.pid)


def test_stop_groups_says_whom_it_kills_and_can_hurry(started):
    stubborn, stubborn_child = started("ignore-term")
    polite, polite_child = started()
    killed: list[subprocess.Popen] = []
    t0 = time.monotonic()
    stuck = stop_groups([stubborn, polite], term_timeout=60.0, hurry=lambda: True, on_kill=killed.extend)
    assert time.monotonic() - t0 < 30.0  # hurried: no waiting out the 60 s for SIGTERM
    assert stuck == [] and stubborn.returncode == -signal.SIGKILL
    assert stubborn in killed and polite.returncode in (-signal.SIGTERM, -signal.SIGKILL)
    assert _wait_gone(stubborn_child, stubborn.pid) and _wait_gone(polite_child, polite.pid)


def test_wait_groups_returns_those_still_running(started):
    leader, grandchild = started()
    assert wait_groups([leader], 0.2) == [leader] and leader.returncode is None
    assert _group_of(grandchild) == leader.pid  # waiting signals nothing
    stop_group(leader)


def test_kill_all_leaves_nothing(started):
    leader, grandchild = started("ignore-term")
    kill_all([SimpleNamespace(process=leader)])
    assert leader.returncode == -signal.SIGKILL and _wait_gone(grandchild, leader.pid)


def test_signalling_a_reaped_process_is_a_noop():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], process_group=0)
    assert proc.wait(WAIT_S) == 0
    # Its pid, and so its group id, may belong to someone else now: nothing is sent.
    assert signal_group(proc, signal.SIGKILL) is False
    assert reap_group(proc) == 0 and stop_group(proc) == 0


def test_a_process_reaped_behind_our_back_is_left_alone():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], process_group=0)
    deadline = time.monotonic() + WAIT_S
    while os.waitpid(proc.pid, os.WNOHANG) == (0, 0):  # reaped here, not through Popen
        assert time.monotonic() < deadline, "it did not exit"
        time.sleep(0.02)
    assert signal_group(proc, signal.SIGKILL) is False
    assert reap_group(proc) == 0  # Popen's answer for a child it cannot wait for any more
