"""Process groups, and the executor servers a RemoteExecutor starts on this machine.

Every process fluidps starts leads its own process group (or session), so stopping it
also stops whatever it started. One set of functions does that, for the launcher, the
RemoteExecutor's servers and the tests: signal_group, reap_group, wait_groups,
stop_groups / stop_group. A group is signalled only while its leader is unreaped, so
its id (the leader's pid) cannot belong to an unrelated process; once the leader has
exited, what it left in its group is killed before the leader is reaped.

ServeProcess is one `fluidps serve` process: it writes its output to a log file and
announces where it listens with one "NAME ready on ADDRESS" line. It binds port 0 and
reports the port ZeroMQ picked, so no port is chosen for it ahead of time and none can
be taken in between. (A pserver loop's endpoint is another matter: it is written into
the transpiled programs before the pserver starts, so it is chosen ahead with
fluidps.endpoints.pick_free_ports, and a race remains: see there.) Every wait is
bounded and every process is stopped by its own id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from fluidps.endpoints import format_endpoint
from fluidps.errors import BuilderError, TransportError
from fluidps.executor.env import METRICS_HOST_ENV, METRICS_PORT_ENV, SECRET_ENV, SECRET_FILE_ENV
from fluidps.executor.transport.proof import JobSecret
from fluidps.io.stream import canonical_spec

READY = " ready on "
# After SIGKILL a process is gone within milliseconds unless stuck in the kernel;
# the bound only keeps the caller from hanging on such a one.
KILL_WAIT_S = 5.0
_POLL_S = 0.05


def signal_group(proc: subprocess.Popen, sig: int) -> bool:
    """Send `sig` to the process group `proc` leads; whether it was sent.

    `proc` must lead its group (Popen(process_group=0) or start_new_session=True). The
    group is signalled only while its leader is unreaped (running, or exited and not yet
    waited for): until then the leader's pid, the group's id, cannot be reused.
    """
    if proc.returncode is not None:
        return False  # reaped: the id may name an unrelated group by now
    try:
        # WNOWAIT: look without reaping. ChildProcessError: something else reaped it.
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def reap_group(proc: subprocess.Popen) -> int | None:
    """`proc`'s exit status once it has exited, else None. A leader that exited is
    reaped only after SIGKILL went to what it left running in its group."""
    if proc.returncode is not None:
        return proc.returncode
    try:
        # WNOWAIT: look without reaping, so the group id stays reserved for signal_group.
        exited = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        # Reaped behind our back (a SIGCHLD handler of the caller's, say): its group id
        # may be reused already, so leave the group alone.
        return proc.poll()
    if exited is None:
        return None
    signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(timeout=KILL_WAIT_S)
    except subprocess.TimeoutExpired:  # cannot happen for an exited process; stay bounded anyway
        return None


def wait_groups(
    procs: Sequence[subprocess.Popen], timeout: float, hurry: Callable[[], bool] | None = None
) -> list[subprocess.Popen]:
    """Wait up to `timeout` seconds (less once `hurry()` is true) for the leaders to exit,
    reaping each group as it does (reap_group); those still running."""
    deadline = time.monotonic() + timeout
    live = [p for p in procs if reap_group(p) is None]
    while live and time.monotonic() < deadline and not (hurry is not None and hurry()):
        time.sleep(_POLL_S)
        live = [p for p in live if reap_group(p) is None]
    return live


def stop_groups(
    procs: Sequence[subprocess.Popen],
    term_timeout: float,
    kill_timeout: float = KILL_WAIT_S,
    hurry: Callable[[], bool] | None = None,
    on_kill: Callable[[list[subprocess.Popen]], None] | None = None,
) -> list[subprocess.Popen]:
    """SIGTERM each group, SIGKILL those whose leader is still running `term_timeout`
    seconds later (at once when `hurry()` turns true; `on_kill` hears which, first), and
    reap them all. Returns those that outlived SIGKILL by `kill_timeout` (stuck in the kernel)."""
    live = [p for p in procs if reap_group(p) is None]
    for p in live:
        signal_group(p, signal.SIGTERM)
    live = wait_groups(live, term_timeout, hurry)
    if live and on_kill is not None:
        on_kill(live)
    for p in live:
        signal_group(p, signal.SIGKILL)
    return wait_groups(live, kill_timeout)


def stop_group(
    proc: subprocess.Popen, term_timeout: float = 5.0, kill_timeout: float = KILL_WAIT_S
) -> int | None:
    """Stop one group (stop_groups); the leader's exit status, None if it outlived SIGKILL."""
    stop_groups([proc], term_timeout, kill_timeout)
    return proc.returncode


class ServeProcess:
    def __init__(
        self,
        name: str,
        host: str,
        log_path: Path,
        keys_dir: str | None = None,
        insecure: bool = False,
        peer_timeout: float | None = None,
        threads: int | None = None,
        role: str = "executor",
        extra_args: list[str] | None = None,
        secret: JobSecret | None = None,
    ):
        self.name = name
        self.log_path = log_path
        address = f"tcp://{format_endpoint(host, 0)}"  # port 0: ZeroMQ picks a free one
        command = [sys.executable, "-m", "fluidps", "serve", "--endpoint", address, "--name", name]
        command += ["--role", role, "--parent-pid", str(os.getpid()), *(extra_args or [])]
        if keys_dir:
            command += ["--keys", str(keys_dir)]
        if insecure:
            command.append("--insecure")
        if peer_timeout is not None:
            command += ["--peer-timeout", str(peer_timeout)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop(SECRET_FILE_ENV, None)  # (one of this process's job, if it runs in one)
        env.pop(SECRET_ENV, None)
        env.pop(METRICS_PORT_ENV, None)  # (a port per process: this one's would clash)
        if secret is not None:  # the job's, in its environment: readable by this user only
            env[SECRET_ENV] = secret.hex()
        for name, value in thread_limits(threads).items():
            env.setdefault(name, value)
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=env,
            )
        self.address: str | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float) -> str:
        """The address it listens on, once it says so; raises if it exits or takes too long."""
        deadline = time.monotonic() + timeout
        prefix = f"{self.name}{READY}"
        while time.monotonic() < deadline:
            for line in self._read_log().splitlines():
                if line.startswith(prefix):
                    self.address = line[len(prefix) :].strip()
                    return self.address
            status = reap_group(self.process)
            if status is not None:
                raise TransportError(
                    f"{self.name} exited with status {status} before it was ready{self.describe_log()}"
                )
            time.sleep(0.05)
        raise TransportError(f"{self.name} was not ready within {timeout:.0f} s{self.describe_log()}")

    def _read_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def describe_log(self, lines: int = 15) -> str:
        """The last lines of its output, for an error message."""
        tail = self._read_log().splitlines()[-lines:]
        if not tail:
            return ""
        return f"; the end of its log ({self.log_path}):\n    " + "\n    ".join(tail)

    def exit_status(self) -> int | None:
        return reap_group(self.process)

    def stop(self, timeout: float) -> int | None:
        """Give it `timeout` seconds to exit by itself (it was told to), then stop its group;
        its exit status, None if it outlived SIGKILL."""
        if not wait_groups([self.process], timeout):
            return self.process.returncode
        return stop_group(self.process, term_timeout=3.0)


def coordinator_flags(snapshot: Path, stream: str | None = None) -> list[str]:
    """The `fluidps serve --role coordinator` flags of a job's coordinator, as the launcher
    and a RemoteExecutor start one: the file it keeps its books in and, in a streaming
    job, the stream whose windows it hands out (every process opens the same one)."""
    flags = ["--snapshot", str(snapshot)]
    if stream is not None:
        flags += ["--stream", canonical_spec(stream)]
    return flags


def metrics_ports(base: int, names: Sequence[str]) -> dict[str, int]:
    """Process k of `names` serves its metrics on port base + k ({} for base 0: no metrics)."""
    if not base:
        return {}
    if base + len(names) - 1 > 65535:
        raise BuilderError(f"metrics ports {base}.. run past 65535 for {len(names)} processes")
    return {name: base + k for k, name in enumerate(names)}


def metrics_environment(port: int | None, host: str) -> dict[str, str]:
    """FLUIDPS_METRICS_PORT and _HOST of a process serving its metrics on `port` (None: {})."""
    return {} if port is None else {METRICS_PORT_ENV: str(port), METRICS_HOST_ENV: host}


def thread_limits(threads: int | None) -> dict[str, str]:
    """Environment capping the BLAS / OpenMP / numba threads of a process. Several
    processes on one machine each spinning up a thread per core slow every step
    several times over (BLAS threads busy-wait), so each gets its share of the cores."""
    if threads is None:
        return {}
    value = str(max(threads, 1))
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
    return dict.fromkeys(names, value)


def kill_all(processes: Sequence[ServeProcess]) -> None:
    """Last resort at exit or garbage collection: nothing a job started outlives it."""
    procs = [p.process for p in processes]
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
    wait_groups(procs, KILL_WAIT_S)
