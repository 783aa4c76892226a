"""`fluidps launch`: real jobs of small scripts on 127.0.0.1.

Every process a test starts is found again through the pid files its script
writes, and the `reaper` fixture SIGKILLs any that a failing test left behind.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fluidps.endpoints import pick_free_ports
from fluidps.errors import BuilderError
from fluidps.executor.launch.launcher import describe_exit, exit_status, job_environments, launch

pytestmark = pytest.mark.timeout(120)

LAUNCH_TIMEOUT = 60

# One script for every behaviour: argv is OUTDIR then NAME=ACTION pairs, where NAME is
# "pserver.0", "trainer.1" or just "pserver" / "trainer", and ACTION is one of
#   ok               exit 0 at once
#   exit:N           wait until every process has written its pid file, then exit N
#   sleep            sleep (practically) forever
#   ignore-term      ignore SIGTERM, then sleep
#   spawn            start a grandchild that sleeps, record its pid (NAME.cpid), then sleep
#   wait-trainers    exit 0 once every trainer has finished (what a real pserver does)
#   lines:N          print N numbered lines, alternating stdout and stderr, then exit 0
#   kill-self        die of SIGKILL
BEHAVE = r"""
import os, signal, subprocess, sys, time
from pathlib import Path

out = Path(sys.argv[1])
actions = dict(a.split("=", 1) for a in sys.argv[2:])
env = os.environ
eps = env["PADDLE_PSERVERS_IP_PORT_LIST"].split(",")
trainers = int(env["PADDLE_TRAINERS_NUM"])
if env["TRAINING_ROLE"] == "PSERVER":
    role, rank = "pserver", eps.index(env["POD_IP"] + ":" + env["PADDLE_PORT"])
else:
    role, rank = "trainer", int(env["PADDLE_TRAINER_ID"])
name = f"{role}.{rank}"
action = actions.get(name, actions.get(role, "ok"))

def record(path, text):
    tmp = path.parent / (path.name + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)

def wait_for(pattern, count):
    deadline = time.monotonic() + 60
    while len(list(out.glob(pattern))) < count:
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)

def sleep_forever():
    time.sleep(600)
    sys.exit(98)

if action == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if action == "spawn":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    record(out / f"{name}.cpid", str(child.pid))
record(out / f"{name}.pid", str(os.getpid()))
print(f"{name} started", flush=True)
if action.startswith("exit:"):
    wait_for("*.pid", len(eps) + trainers)
    print(f"{name} fails", file=sys.stderr, flush=True)
    sys.exit(int(action[5:]))
elif action == "wait-trainers":
    wait_for("trainer.*.done", trainers)
elif action in ("sleep", "ignore-term", "spawn"):
    sleep_forever()
elif action.startswith("lines:"):
    for i in range(int(action[6:])):
        print(f"line {i}", file=sys.stderr if i % 2 else sys.stdout)
elif action == "kill-self":
    os.kill(os.getpid(), signal.SIGKILL)
if role == "trainer":
    record(out / f"{name}.done", "")
"""

# Reads the contract through the real API and reports what it saw as one JSON line.
SHOW_ROLE = r"""
import dataclasses, json, os, sys, time
from pathlib import Path
import fluidps

info = fluidps.role_from_env()
out = Path(sys.argv[1])
print(json.dumps(dataclasses.asdict(info) | {"argv": sys.argv[2:]}), flush=True)
print(f"stderr of {info.role.lower()}", file=sys.stderr, flush=True)
if info.is_trainer:
    (out / f"trainer.{info.trainer_id}.done").write_text("")
else:
    deadline = time.monotonic() + 60
    while len(list(out.glob("trainer.*.done"))) < info.trainers:
        if time.monotonic() > deadline:
            sys.exit(99)
        time.sleep(0.02)
"""


def alive(pid: int) -> bool:
    """Whether `pid` is a process that is not a zombie (an orphaned zombie is as good as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def recorded_pids(out: Path) -> list[int]:
    """Every process's pid, and its grandchild's (*.cpid) for a script that spawned one."""
    return [int(p.read_text()) for pattern in ("*.pid", "*.cpid") for p in out.glob(pattern)]


def wait_for_pids(out: Path, count: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := recorded_pids(out)) < count:
        assert time.monotonic() < deadline, f"only {len(pids)} of {count} processes started"
        time.sleep(0.05)
    return pids


@pytest.fixture
def job(tmp_path: Path):
    """(behave script, output dir); kills whatever the test's processes left behind."""
    script = tmp_path / "behave.py"
    script.write_text(BEHAVE)
    out = tmp_path / "out"
    out.mkdir()
    yield script, out
    for pid in recorded_pids(out):
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def fluidps_launch(*args: str, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", "launch", *args], capture_output=True, text=True, timeout=timeout
    )


def prefixed(text: str, name: str) -> list[str]:
    tag = f"[{name}] "
    return [line[len(tag) :] for line in text.splitlines() if line.startswith(tag)]


# -- the environment contract -------------------------------------------------


def test_every_process_sees_its_role(tmp_path):
    script = tmp_path / "show_role.py"
    script.write_text(SHOW_ROLE)
    out = tmp_path / "out"
    out.mkdir()
    args = ["--pservers", "2", "--trainers", "3", "--mode", "async", str(script), str(out), "--flag", "x"]
    result = fluidps_launch(*args)
    assert result.returncode == 0, result.stderr

    seen = {}
    for line in result.stdout.splitlines():
        m = re.fullmatch(r"\[(pserver|trainer)\.(\d+)\] (\{.*\})", line)
        assert m, f"unprefixed line {line!r}"
        seen[f"{m[1]}.{m[2]}"] = json.loads(m[3])
    assert sorted(seen) == ["pserver.0", "pserver.1", "trainer.0", "trainer.1", "trainer.2"]

    endpoints = seen["pserver.0"]["pserver_endpoints"]
    assert len(endpoints) == 2 and len({ep.rpartition(":")[2] for ep in endpoints}) == 2
    assert all(ep.startswith("127.0.0.1:") for ep in endpoints)
    for name, info in seen.items():
        role, rank = name.split(".")
        assert info["role"] == role.upper()
        assert info["pserver_endpoints"] == endpoints and info["trainers"] == 3
        assert info["mode"] == "async" and info["argv"] == ["--flag", "x"]
        if role == "pserver":
            assert info["current_endpoint"] == endpoints[int(rank)]
        else:
            assert info["trainer_id"] == int(rank) and info["current_endpoint"] is None
    for name in seen:
        assert prefixed(result.stderr, name) == [f"stderr of {name.split('.')[0]}"]
    # The pservers exited by themselves once the trainers were done: none had to be stopped.
    assert "all processes exited with status 0" in result.stderr and "stopping" not in result.stderr


SHOW_CORES = r"""
import json, os
import fluidps
import zmq

info = fluidps.role_from_env()
context = zmq.Context(io_threads=2)  # its I/O threads inherit the process's binding
socket = context.socket(zmq.DEALER)
threads = sorted(int(t) for t in os.listdir("/proc/self/task"))
cores = {t: sorted(os.sched_getaffinity(t)) for t in threads}
print(json.dumps({"role": info.role, "trainer_id": info.trainer_id, "cores": cores}), flush=True)
socket.close()
context.term()
"""


def test_bind_cores_puts_each_process_and_its_threads_on_one_core_in_turn(tmp_path):
    script = tmp_path / "show_cores.py"
    script.write_text(SHOW_CORES)
    result = fluidps_launch("--pservers", "2", "--trainers", "3", "--bind-cores", str(script))
    assert result.returncode == 0, result.stderr
    mine = sorted(os.sched_getaffinity(0))
    seen = {}
    for line in result.stdout.splitlines():
        m = re.fullmatch(r"\[(pserver|trainer)\.(\d+)\] (\{.*\})", line)
        assert m, f"unprefixed line {line!r}"
        seen[f"{m[1]}.{m[2]}"] = json.loads(m[3])["cores"]
    order = ["pserver.0", "pserver.1", "trainer.0", "trainer.1", "trainer.2"]  # pservers first, in turn
    assert sorted(seen) == sorted(order)
    for position, name in enumerate(order):
        threads = seen[name]
        assert len(threads) >= 3  # the main thread and ZeroMQ's: every one on the process's core
        assert {tuple(c) for c in threads.values()} == {(mine[position % len(mine)],)}, name
    assert f"trainer.0 on core {mine[2 % len(mine)]}" in result.stderr


def test_without_bind_cores_processes_may_run_anywhere(tmp_path):
    script = tmp_path / "show_cores.py"
    script.write_text(SHOW_CORES)
    result = fluidps_launch("--pservers", "1", "--trainers", "1", str(script))
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        cores = json.loads(line.partition("] ")[2])["cores"]
        assert {tuple(c) for c in cores.values()} == {tuple(sorted(os.sched_getaffinity(0)))}
    assert "bound" not in result.stderr


def test_start_port_is_honoured(tmp_path):
    script = tmp_path / "show_role.py"
    script.write_text(SHOW_ROLE)
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(20):  # find two free neighbouring ports
        start = pick_free_ports("127.0.0.1", 1)[0]
        if start < 65535:
            try:
                pick_free_ports("127.0.0.1", 2, start)
                break
            except BuilderError:
                continue
    result = fluidps_launch(
        "--pservers", "2", "--trainers", "1", "--start-port", str(start), str(script), str(out)
    )
    assert result.returncode == 0, result.stderr
    info = json.loads(prefixed(result.stdout, "trainer.0")[0])
    assert info["pserver_endpoints"] == [f"127.0.0.1:{start}", f"127.0.0.1:{start + 1}"]


def test_job_environments_replace_inherited_contract():
    base = {"PATH": "/bin", "TRAINING_ROLE": "PSERVER", "PADDLE_PORT": "1", "POD_IP": "10.0.0.1"}
    jobs = dict(job_environments("127.0.0.1", [5000, 5001], 2, "ssp", base))
    assert list(jobs) == ["pserver.0", "pserver.1", "trainer.0", "trainer.1"]
    trainer = jobs["trainer.1"]
    assert trainer["PATH"] == "/bin" and "PADDLE_PORT" not in trainer and "POD_IP" not in trainer
    assert trainer["TRAINING_ROLE"] == "TRAINER" and trainer["PADDLE_TRAINER_ID"] == "1"
    assert trainer["PADDLE_PSERVERS_IP_PORT_LIST"] == "127.0.0.1:5000,127.0.0.1:5001"
    ps = jobs["pserver.1"]
    assert (ps["TRAINING_ROLE"], ps["POD_IP"], ps["PADDLE_PORT"]) == ("PSERVER", "127.0.0.1", "5001")
    assert "PADDLE_TRAINER_ID" not in ps and ps["FLUIDPS_MODE"] == "ssp" and ps["PADDLE_TRAINERS_NUM"] == "2"
    assert all(env["FLUIDPS_STACKS_ON_SIGUSR1"] == "1" for env in jobs.values())


WAITS = """
import sys, time
import fluidps
fluidps.role_from_env()
print("waiting", flush=True)
time.sleep(60)
"""


def test_a_launched_process_prints_its_stacks_on_sigusr1(tmp_path):
    """Where a hung process waits: SIGUSR1 prints every thread's stack and it goes on."""
    (_, env), *_ = job_environments("127.0.0.1", [5000], 1, "sync")[1:]
    proc = subprocess.Popen(
        [sys.executable, "-c", WAITS], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "waiting\n"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        assert proc.poll() is None  # it goes on
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "Current thread" in err and re.search(r'File "<string>", line \d+ in <module>', err)  # where it is


# -- output --------------------------------------------------------------------


def test_output_is_prefixed_in_order_and_logged(job, tmp_path):
    script, out = job
    logs = tmp_path / "logs"
    result = fluidps_launch(
        "--pservers", "1", "--trainers", "2", "--log-dir", str(logs),
        str(script), str(out), "trainer.1=lines:400", "pserver=wait-trainers",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    n = 400
    assert prefixed(result.stdout, "trainer.1")[1:] == [f"line {i}" for i in range(0, n, 2)]
    assert prefixed(result.stderr, "trainer.1") == [f"line {i}" for i in range(1, n, 2)]
    assert prefixed(result.stdout, "trainer.0") == ["trainer.0 started"]
    assert prefixed(result.stdout, "pserver.0") == ["pserver.0 started"]
    for line in result.stdout.splitlines():
        assert re.match(r"\[(pserver\.0|trainer\.[01])\] ", line), line
    assert sorted(p.name for p in logs.iterdir()) == ["pserver.0.log", "trainer.0.log", "trainer.1.log"]
    # A log holds both streams as their lines arrived: each stream's own order is kept.
    log = (logs / "trainer.1.log").read_text().splitlines()
    assert sorted(log) == sorted(["trainer.1 started"] + [f"line {i}" for i in range(n)])
    numbers = [int(line[5:]) for line in log if line.startswith("line ")]
    assert [i for i in numbers if i % 2 == 0] == list(range(0, n, 2))
    assert [i for i in numbers if i % 2] == list(range(1, n, 2))


# -- failures and teardown ------------------------------------------------------


def test_failing_trainer_stops_the_job_with_its_status(job):
    script, out = job
    # The others sleep 600 s: a launcher that waited for them (or for --grace 600) would
    # outlast fluidps_launch's LAUNCH_TIMEOUT, which fails the test.
    result = fluidps_launch(
        "--pservers", "2", "--trainers", "2", "--grace", "600",
        str(script), str(out), "trainer.0=exit:3", "trainer.1=sleep", "pserver=spawn",
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    assert "[launch] trainer.0 exited with status 3; stopping the job" in result.stderr
    assert prefixed(result.stderr, "trainer.0") == ["trainer.0 fails"]
    pids = recorded_pids(out)
    assert len(pids) == 6  # 4 processes and the 2 pservers' grandchildren
    assert all_gone(pids)


def test_process_killed_by_a_signal_gives_128_plus_signal(job):
    script, out = job
    err = io.StringIO()
    status = launch(
        str(script), [str(out), "trainer=kill-self", "pserver=sleep"], stdout=io.StringIO(), stderr=err
    )
    assert status == 128 + signal.SIGKILL
    assert "trainer.0 was killed by SIGKILL (status 137); stopping the job" in err.getvalue()
    assert all_gone(recorded_pids(out))


@pytest.mark.parametrize(("sig", "status"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_every_process(job, tmp_path, sig, status):
    script, out = job
    with open(tmp_path / "stdout", "w") as so, open(tmp_path / "stderr", "w") as se:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "fluidps", "launch", "--pservers", "2", "--trainers", "2",
             str(script), str(out), "pserver=spawn", "trainer=sleep"],
            stdout=so, stderr=se,
        )  # fmt: skip
        try:
            pids = wait_for_pids(out, 6)
            launcher.send_signal(sig)
            assert launcher.wait(timeout=30) == status
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait(timeout=10)
    assert all_gone(pids), [p for p in pids if alive(p)]
    assert f"got {sig.name}; stopping the job" in (tmp_path / "stderr").read_text()


def test_pservers_exiting_by_themselves_give_status_0(job):
    script, out = job
    result = fluidps_launch(
        "--pservers", "2", "--trainers", "2", str(script), str(out), "pserver=wait-trainers"
    )
    assert result.returncode == 0, result.stderr
    assert "[launch] all processes exited with status 0" in result.stderr
    assert "stopping" not in result.stderr


def test_pserver_that_never_exits_is_stopped_after_grace(job):
    script, out = job
    started = time.monotonic()
    result = fluidps_launch(
        "--pservers", "2", "--trainers", "2", "--grace", "1",
        str(script), str(out), "pserver.0=wait-trainers", "pserver.1=sleep",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # not before the grace; pserver.1 sleeps 600 s, so LAUNCH_TIMEOUT fails a launcher that waits for it
    assert time.monotonic() - started >= 1
    assert "[launch] stopping pserver.1: still running 1s after the trainers finished" in result.stderr
    assert all_gone(recorded_pids(out))


def test_pserver_ignoring_sigterm_is_killed(job):
    script, out = job
    err = io.StringIO()
    status = launch(
        str(script),
        [str(out), "pserver=ignore-term", "trainer=exit:0"],
        grace=0.2,
        stop_timeout=0.5,
        stdout=io.StringIO(),
        stderr=err,
    )
    assert status == 0
    assert "killing pserver.0: still running after SIGTERM" in err.getvalue()
    assert all_gone(recorded_pids(out))


def test_failing_pserver_fails_the_job(job):
    script, out = job
    result = fluidps_launch(
        "--pservers", "1", "--trainers", "1", str(script), str(out), "pserver=exit:5", "trainer=sleep"
    )
    assert result.returncode == 5 and "pserver.0 exited with status 5" in result.stderr
    assert all_gone(recorded_pids(out))


# -- bad input --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pservers", "1", "--trainers", "1", "missing.py"], "script missing.py not found"),
        (["--pservers", "0", "--trainers", "1", "x.py"], "--pservers"),
        (["--pservers", "1", "--trainers", "nan", "x.py"], "--trainers"),
        (["--pservers", "1", "--trainers", "1", "--mode", "fast", "x.py"], "--mode"),
        (["--pservers", "1", "--trainers", "1", "--grace", "-1", "x.py"], "--grace"),
        (["--trainers", "1", "x.py"], "--pservers"),
        (["--pservers", "1", "--trainers", "1"], "SCRIPT"),
        (["--pservers", "1", "--trainers", "1", "--bogus", "x.py"], "--bogus"),
    ],
)
def test_bad_arguments_are_one_line_and_status_2(args, message):
    result = fluidps_launch(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("fluidps: error: ") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and result.stdout == ""


def test_taken_start_port_is_bad_input(job):
    script, out = job
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = fluidps_launch(
            "--pservers", "1", "--trainers", "1", "--start-port", str(port), str(script), str(out)
        )
    assert result.returncode == 2 and f"cannot bind port {port}" in result.stderr
    assert recorded_pids(out) == []


def test_python_api_rejects_bad_arguments(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("")
    with pytest.raises(BuilderError, match="not found"):
        launch(str(tmp_path / "nope.py"))
    with pytest.raises(BuilderError, match="at least one trainer"):
        launch(str(script), trainers=0)
    with pytest.raises(BuilderError, match="mode"):
        launch(str(script), mode="fast")
    with pytest.raises(BuilderError, match="start port"):
        launch(str(script), pservers=2, start_port=65535)


def test_exit_status_helpers():
    assert exit_status(3) == 3 and exit_status(-signal.SIGTERM) == 143
    assert describe_exit(-9) == "was killed by SIGKILL (status 137)"
    assert describe_exit(2) == "exited with status 2"


@pytest.fixture
def tiny_dataset(tmp_path: Path) -> Path:
    import numpy as np

    from fluidps.io.dataset import Dataset

    path = tmp_path / "data"
    Dataset.write(path, {"x": np.zeros((8, 1), np.float32)}, records_per_shard=4)
    return path


def test_a_process_that_keeps_crashing_stops_the_job_after_its_restarts_within_the_window(job, tiny_dataset):
    script, out = job
    result = fluidps_launch(
        "--dataset", str(tiny_dataset), "--pservers", "1", "--trainers", "1", "--max-restarts", "2",
        "--restart-window", "600", "--no-progress", str(script), str(out), "trainer=exit:3", "pserver=sleep",
    )  # fmt: skip
    assert result.returncode == 3, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("[launch] trainer.0 exited")]
    assert said == [
        "[launch] trainer.0 exited with status 3; restarting it (in 0.2 s, restart 1 of 2 within 600 s); "
        "its task goes back to the queue and it rejoins the job",
        "[launch] trainer.0 exited with status 3; restarting it (in 0.4 s, restart 2 of 2 within 600 s); "
        "its task goes back to the queue and it rejoins the job",
        "[launch] trainer.0 exited with status 3; it was restarted 2 time(s) within 600 s, the most allowed: "
        "stopping the job",
    ]


def test_a_process_failed_by_its_peers_does_not_spend_its_own_restarts(job, tiny_dataset):
    from fluidps.executor.launch.restarts import PEER_FACTOR
    from fluidps.executor.peer_exit import PEER_FAILURE_STATUS

    script, out = job
    result = fluidps_launch(
        "--dataset", str(tiny_dataset), "--pservers", "1", "--trainers", "1", "--max-restarts", "1",
        "--no-progress", str(script), str(out), f"trainer=exit:{PEER_FAILURE_STATUS}", "pserver=sleep",
    )  # fmt: skip
    assert result.returncode == PEER_FAILURE_STATUS, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("[launch] trainer.0 exited")]
    assert len(said) == PEER_FACTOR + 1
    assert all("a peer's failure, not counted against its 1 restarts" in line for line in said[:-1])
    assert said[-1].endswith(
        f"it was restarted after a peer's failure {PEER_FACTOR} time(s) within 300 s, the most allowed: stopping the job"
    )
