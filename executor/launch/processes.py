"""Executor servers a RemoteExecutor starts on this machine: `fluidps serve` processes.

Each runs in its own session (so stopping it stops whatever it started),
writes its output to a log file, and announces where it listens with one
"NAME ready on ADDRESS" line; it listens on a port ZeroMQ picks, so two jobs
never race for a port. Every wait is bounded and every process is stopped by
its own id.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fluidps.errors import TransportError

READY = " ready on "


class ServerProcess:
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
    ):
        self.name = name
        self.log_path = log_path
        address = f"tcp://[{host}]:0" if ":" in host else f"tcp://{host}:0"
        command = [sys.executable, "-m", "fluidps", "serve", "--endpoint", address, "--name", name]
        command += ["--role", role, "--parent-pid", str(os.getpid()), *(extra_args or [])]
        if keys_dir:
            command += ["--keys", str(keys_dir)]
        if insecure:
            command.append("--insecure")
        if peer_timeout is not None:
            command += ["--peer-timeout", str(peer_timeout)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
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
            if self.process.poll() is not None:
                raise TransportError(
                    f"{self.name} exited with status {self.process.returncode} before it was ready"
                    f"{self.describe_log()}"
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
        return self.process.poll()

    def stop(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for it to exit, then SIGTERM and SIGKILL its session."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
            kill_session(self.process, sig)
            try:
                return self.process.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        return self.process.wait(5.0)


def thread_limits(threads: int | None) -> dict[str, str]:
    """Environment capping the BLAS / OpenMP / numba threads of a process. Several
    processes on one machine each spinning up a thread per core slow every step
    several times over (BLAS threads busy-wait), so each gets its share of the cores."""
    if threads is None:
        return {}
    value = str(max(threads, 1))
    names = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS")
    return dict.fromkeys(names, value)


def kill_session(process: subprocess.Popen, sig: int) -> None:
    """Signal the session `process` leads, if it has not been reaped yet (its id is still its own)."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def kill_all(processes: list[ServerProcess]) -> None:
    """Last resort at exit or garbage collection: nothing a job started outlives it."""
    for p in processes:
        kill_session(p.process, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.process.wait(5.0)
