"""Run a parameter-server job on one machine: N pservers and M trainers of one script.

Every process runs `python script.py args` with the environment contract of
`fluidps.executor.roles` and lives in its own process group, so stopping it also
stops whatever it started. Its output comes back line by line, prefixed with
"[pserver.0] " / "[trainer.1] ". The job ends when

- every trainer exited 0 and then every pserver exited (or was stopped after `grace`
  seconds): status 0;
- any process exited non-zero: the rest are stopped, status is the failed one's
  (128 + signal number for a process killed by a signal);
- the launcher gets SIGINT / SIGTERM / SIGHUP: the processes are stopped, status 128 + signal.

With a dataset the job is fault tolerant: a coordinator process hands the
trainers its tasks (FLUIDPS_COORDINATOR, FLUIDPS_DATASET), the pservers evict
silent trainers and checkpoint into a directory (FLUIDPS_ELASTIC,
FLUIDPS_CHECKPOINT_DIR), and a process that dies is started again, up to
`max_restarts` times each: a pserver restores its last checkpoint, the
coordinator its snapshot, a trainer rejoins while its task goes to another.
The job is done when the coordinator has finished every pass and the trainers
have exited; a progress bar shows the pass, tasks, samples/s and loss.

Whatever happens, every process is stopped and reaped before `run()` returns.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from fluidps.errors import BuilderError, DatasetError
from fluidps.executor.coordinator import DEFAULT_MAX_FAILURES, DEFAULT_TASK_TIMEOUT
from fluidps.executor.progress import CoordinatorWatch, ProgressBar
from fluidps.executor.roles import CONTRACT_VARS, format_endpoint
from fluidps.executor.rpc import RpcSettings
from fluidps.executor.server_process import thread_limits
from fluidps.io.dataset import Dataset
from fluidps.transpiler.config import MODES

POLL_S = 0.05
# After SIGKILL a process is gone within milliseconds unless stuck in the kernel;
# the bound only keeps the launcher from hanging on such a one.
KILL_WAIT_S = 5.0
# How long the output of finished processes may take to drain once they are reaped.
DRAIN_WAIT_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_status(returncode: int) -> int:
    """A shell's view of a status: Popen's -N (killed by signal N) becomes 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name} (status {exit_status(returncode)})"
    return f"exited with status {returncode}"


def pick_ports(host: str, count: int, start: int | None = None) -> list[int]:
    """`count` TCP ports free on `host`: start, start + 1, ... when given, else any.

    The ports are checked by binding them all at once (so they are distinct) and
    released right away, for the pservers to bind; another program could take one
    in between, which the pserver would then report.
    """
    if start is not None and not 1 <= start <= 65536 - count:
        raise BuilderError(
            f"start port {start} is invalid: ports {start}..{start + count - 1} must be 1..65535"
        )
    socks: list[socket.socket] = []
    try:
        try:
            family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
        except (socket.gaierror, UnicodeError) as e:
            raise BuilderError(f"host {host!r} cannot be resolved: {e}") from None
        for i in range(count):
            port = 0 if start is None else start + i
            s = socket.socket(family, socket.SOCK_STREAM)
            socks.append(s)
            # As zmq's listeners do, so a port left in TIME_WAIT by an earlier job counts as free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                where = f"port {port} on {host}" if port else f"a port on {host}"
                raise BuilderError(f"cannot bind {where}: {e.strerror or e}") from None
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def job_environments(
    host: str,
    ports: Sequence[int],
    trainers: int,
    mode: str,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of every process: the pservers, then the trainers. `extra`
    goes to every one of them (a dataset job's coordinator and checkpoint settings)."""
    env = dict(os.environ if base is None else base)
    for var in CONTRACT_VARS:  # a launcher run inside a job must not pass its own role on
        env.pop(var, None)
    env.update(
        PADDLE_TRAINERS_NUM=str(trainers),
        PADDLE_PSERVERS_IP_PORT_LIST=",".join(format_endpoint(host, p) for p in ports),
        FLUIDPS_MODE=mode,
        PYTHONUNBUFFERED="1",  # lines show up as they are printed, not when a buffer fills
        **(extra or {}),
    )
    # Each process gets its share of the cores unless the user set thread counts.
    share = max((os.cpu_count() or 1) // (len(ports) + trainers), 1)
    for name, value in thread_limits(share).items():
        env.setdefault(name, value)
    jobs = [
        (f"pserver.{i}", env | {"TRAINING_ROLE": "PSERVER", "POD_IP": host, "PADDLE_PORT": str(port)})
        for i, port in enumerate(ports)
    ]
    jobs += [
        (f"trainer.{i}", env | {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(i)})
        for i in range(trainers)
    ]
    return jobs


@dataclass(frozen=True)
class DatasetJob:
    """What makes a launched job read a dataset through a coordinator, and survive failures."""

    dataset: str
    task_timeout: float = DEFAULT_TASK_TIMEOUT  # an unrenewed task goes to another trainer after this
    max_task_failures: int = DEFAULT_MAX_FAILURES
    max_restarts: int = 3  # per process
    checkpoint_dir: str | None = None  # default: checkpoints/ in the log (or a temporary) directory
    checkpoint_every_steps: int = 0
    checkpoint_every_seconds: float = 10.0
    progress: bool | None = None  # None: a progress bar when stderr is a terminal

    def __post_init__(self) -> None:
        if self.task_timeout <= 0 or self.max_task_failures < 0 or self.max_restarts < 0:
            raise BuilderError("task_timeout must be > 0, max_task_failures and max_restarts >= 0")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_seconds < 0:
            raise BuilderError("checkpoint intervals must be >= 0")
        try:
            Dataset(self.dataset)
        except DatasetError as e:
            raise BuilderError(f"--dataset: {e}") from None


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen
    command: list[str]
    env: dict[str, str]
    log: BinaryIO | None = None
    log_lock: threading.Lock = field(default_factory=threading.Lock)
    readers: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None  # set once reaped
    restarts: int = 0

    @property
    def role(self) -> str:
        return self.name.split(".")[0]

    @property
    def is_pserver(self) -> bool:
        return self.role == "pserver"


class Launcher:
    """One job on one machine. `run()` starts it, supervises it and returns its exit status."""

    def __init__(
        self,
        script: str,
        args: Sequence[str] = (),
        pservers: int = 1,
        trainers: int = 1,
        mode: str = "sync",
        host: str = "127.0.0.1",
        start_port: int | None = None,
        log_dir: str | os.PathLike | None = None,
        grace: float = 30.0,
        stop_timeout: float = 5.0,
        stdout: IO[str] | None = None,
        stderr: IO[str] | None = None,
        python: str = sys.executable,
        dataset_job: DatasetJob | None = None,
    ):
        if not Path(script).is_file():
            raise BuilderError(f"script {script} not found")
        if pservers < 1:
            raise BuilderError(f"a job needs at least one pserver, got {pservers}")
        if trainers < 1:
            raise BuilderError(f"a job needs at least one trainer, got {trainers}")
        if mode not in MODES:
            raise BuilderError(f"mode {mode!r} is invalid: it should be one of {', '.join(MODES)}")
        if grace < 0 or stop_timeout < 0:
            raise BuilderError("grace and stop_timeout must be >= 0 seconds")
        self.script, self.args = script, list(args)
        self.pservers, self.trainers, self.mode = pservers, trainers, mode
        self.host, self.start_port = host, start_port
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.grace, self.stop_timeout = grace, stop_timeout
        # Resolved at run time so a caller that swaps sys.stdout (pytest, click) is honoured.
        self._stdout, self._stderr = stdout, stderr
        self.python = python
        self.dataset_job = dataset_job
        self.children: list[_Child] = []
        self.endpoints: list[str] = []
        self.coordinator: str | None = None
        self.checkpoint_dir: Path | None = None
        self.state_dir: Path | None = None  # the coordinator's snapshot and default checkpoints
        self._retired: list[_Child] = []  # processes that died and were started again
        self._out_lock = threading.Lock()
        self._signal: int | None = None
        self._hurry = False  # a second signal: skip waiting for SIGTERM to work

    # -- output ----------------------------------------------------------

    def _emit(self, dest: IO[str], text: str) -> None:
        with self._out_lock:
            try:
                dest.write(text)
                dest.flush()
            except (OSError, ValueError):
                pass  # a closed or broken stdout must not stop the pipe from draining

    def _say(self, message: str) -> None:
        self._emit(self._stderr or sys.stderr, f"[launch] {message}\n")

    def _pump(self, child: _Child, pipe: BinaryIO, dest: IO[str]) -> None:
        """Forward one pipe line by line; runs until the process and its group close it."""
        prefix = f"[{child.name}] "
        with pipe:
            for raw in iter(pipe.readline, b""):
                line = raw if raw.endswith(b"\n") else raw + b"\n"
                if child.log is not None:
                    with child.log_lock:
                        try:
                            child.log.write(line)
                            child.log.flush()
                        except (OSError, ValueError):
                            pass
                self._emit(dest, prefix + line.decode("utf-8", "replace"))

    # -- processes -------------------------------------------------------

    def _start(
        self, name: str, env: dict[str, str], command: list[str] | None = None, restarts: int = 0
    ) -> None:
        command = command or [self.python, self.script, *self.args]
        log = None
        if self.log_dir is not None:
            try:
                # A restarted process appends to its log.
                log = open(self.log_dir / f"{name}.log", "ab" if restarts else "wb")  # noqa: SIM115 (closed in run())
            except OSError as e:
                raise BuilderError(f"cannot write the log of {name} into {self.log_dir}: {e}") from None
        try:
            proc = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,  # its own group: stopping it stops its children too
            )
        except OSError as e:
            if log is not None:
                log.close()
            raise BuilderError(f"cannot start {name}: {e}") from None
        child = _Child(name, proc, command, env, log, restarts=restarts)
        if self.dataset_job is not None:  # processes may be restarted: say which is which
            self._say(f"started {name} (pid {proc.pid})")
        old = next((i for i, c in enumerate(self.children) if c.name == name), None)
        if old is None:
            self.children.append(child)
        else:  # a restart: the old process's pipes still drain; run() closes them at the end
            self._retired.append(self.children[old])
            self.children[old] = child
        for pipe, dest in (
            (proc.stdout, self._stdout or sys.stdout),
            (proc.stderr, self._stderr or sys.stderr),
        ):
            t = threading.Thread(target=self._pump, args=(child, pipe, dest), name=f"{name}-out", daemon=True)
            t.start()
            child.readers.append(t)

    def _kill_group(self, child: _Child, sig: int) -> None:
        # Only called while the leader is unreaped (running or a zombie): its pid, and so
        # its group id, cannot have been reused by an unrelated process yet.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.proc.pid, sig)

    def _reap(self, child: _Child) -> bool:
        """Whether `child` has exited; if so, kill what it left in its group and reap it."""
        if child.returncode is not None:
            return True
        try:
            # WNOWAIT: look without reaping, so the group id stays reserved for _kill_group.
            info = os.waitid(os.P_PID, child.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            # Reaped behind our back (a SIGCHLD handler of the caller's, say): its group id
            # may be reused already, so leave the group alone.
            child.returncode = child.proc.poll()
            return child.returncode is not None
        if info is None:
            return False
        self._kill_group(child, signal.SIGKILL)
        try:
            child.returncode = child.proc.wait(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # cannot happen for an exited process; stay bounded anyway
            return False
        return True

    def _live(self) -> list[_Child]:
        return [c for c in self.children if not self._reap(c)]

    def _stop(self, children: Sequence[_Child]) -> None:
        """SIGTERM to each group, SIGKILL to those still there after stop_timeout; reap all."""
        live = [c for c in children if not self._reap(c)]
        for c in live:
            self._kill_group(c, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while live and time.monotonic() < deadline and not self._hurry:
            time.sleep(POLL_S)
            live = [c for c in live if not self._reap(c)]
        if live:
            self._say(f"killing {', '.join(c.name for c in live)}: still running after SIGTERM")
        for c in live:
            self._kill_group(c, signal.SIGKILL)
        deadline = time.monotonic() + KILL_WAIT_S
        while live and time.monotonic() < deadline:
            time.sleep(POLL_S)
            live = [c for c in live if not self._reap(c)]
        for c in live:
            self._say(f"{c.name} (pid {c.proc.pid}) did not die after SIGKILL; giving up on it")

    # -- the job ---------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is None:
            self._signal = signum
        else:
            self._hurry = True

    def _install_signal_handlers(self) -> dict[int, object]:
        # Python only lets the main thread set handlers; from another thread the caller
        # keeps its own handling and run() still cleans up in its finally.
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {sig: signal.signal(sig, self._on_signal) for sig in _STOP_SIGNALS}

    def run(self) -> int:
        """Start the job, wait for it to end, stop and reap everything; the job's status."""
        self.children, self._retired, self._signal, self._hurry = [], [], None, False
        old_handlers = self._install_signal_handlers()
        watch: CoordinatorWatch | None = None
        try:
            if self.log_dir is not None:
                try:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise BuilderError(f"cannot create log directory {self.log_dir}: {e}") from None
            job = self.dataset_job
            ports = pick_ports(self.host, self.pservers + (job is not None), self.start_port)
            self.endpoints = [format_endpoint(self.host, p) for p in ports[: self.pservers]]
            extra: dict[str, str] = {}
            if job is not None:
                extra = self._dataset_environment(job, ports[-1])
                watch = CoordinatorWatch(self.coordinator, RpcSettings(peer_timeout=5.0))
            self._say(
                f"{self.pservers} pserver(s) at {','.join(self.endpoints)}, "
                f"{self.trainers} trainer(s), mode {self.mode}"
                + (f", reading {job.dataset} (coordinator at {self.coordinator})" if job else "")
            )
            if job is not None:
                self._start_coordinator(job, extra)
            for name, env in job_environments(
                self.host, ports[: self.pservers], self.trainers, self.mode, extra=extra
            ):
                if self._signal is not None:
                    break
                self._start(name, env)
            return self._supervise() if job is None else self._supervise_dataset_job(job, watch)
        finally:
            self._stop(self.children)
            if watch is not None:
                watch.close()
            deadline = time.monotonic() + DRAIN_WAIT_S
            for c in [*self._retired, *self.children]:
                for t in c.readers:
                    t.join(timeout=max(0.0, deadline - time.monotonic()))
                if c.log is not None:
                    with c.log_lock:
                        c.log.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def _supervise(self) -> int:
        trainers_done_at: float | None = None
        while True:
            if self._signal is not None:
                self._say(f"got {signal.Signals(self._signal).name}; stopping the job")
                return 128 + self._signal
            for c in self.children:
                if c.returncode is not None or not self._reap(c):
                    continue
                if c.returncode != 0:
                    self._say(f"{c.name} {describe_exit(c.returncode)}; stopping the job")
                    return exit_status(c.returncode)
            trainers = [c for c in self.children if c.role == "trainer"]
            if trainers_done_at is None and all(c.returncode == 0 for c in trainers):
                trainers_done_at = time.monotonic()
            if trainers_done_at is not None:
                live = self._live()
                if not live:
                    self._say("all processes exited with status 0")
                    return 0
                if time.monotonic() - trainers_done_at >= self.grace:
                    names = ", ".join(c.name for c in live)
                    self._say(f"stopping {names}: still running {self.grace:g}s after the trainers finished")
                    self._stop(live)
                    return 0
            time.sleep(POLL_S)

    # -- dataset jobs: a coordinator, restarts, checkpoints -------------------------------

    def _dataset_environment(self, job: DatasetJob, coordinator_port: int) -> dict[str, str]:
        state = self.log_dir if self.log_dir is not None else Path(tempfile.mkdtemp(prefix="fluidps-launch-"))
        self.state_dir = state
        self.coordinator = f"tcp://{format_endpoint(self.host, coordinator_port)}"
        self.checkpoint_dir = Path(job.checkpoint_dir) if job.checkpoint_dir else state / "checkpoints"
        return {
            "FLUIDPS_DATASET": str(Path(job.dataset).resolve()),
            "FLUIDPS_COORDINATOR": self.coordinator,
            "FLUIDPS_ELASTIC": "1",
            "FLUIDPS_CHECKPOINT_DIR": str(self.checkpoint_dir.resolve()),
            "FLUIDPS_CHECKPOINT_EVERY_STEPS": str(job.checkpoint_every_steps),
            "FLUIDPS_CHECKPOINT_EVERY_SECONDS": str(job.checkpoint_every_seconds),
        }

    def _start_coordinator(self, job: DatasetJob, extra: dict[str, str]) -> None:
        assert self.coordinator is not None
        env = dict(os.environ)
        for var in CONTRACT_VARS:
            env.pop(var, None)
        env.update(PYTHONUNBUFFERED="1", **thread_limits(1))
        command = [
            self.python, "-m", "fluidps", "serve", "--role", "coordinator",
            "--endpoint", self.coordinator,
            "--snapshot", str(Path(self.state_dir or ".") / "coordinator.json"),
            "--task-timeout", str(job.task_timeout),
            "--max-task-failures", str(job.max_task_failures),
        ]  # fmt: skip
        if "FLUIDPS_PEER_TIMEOUT" in os.environ:
            command += ["--peer-timeout", os.environ["FLUIDPS_PEER_TIMEOUT"]]
        self._start("coordinator", env, command)

    def _supervise_dataset_job(self, job: DatasetJob, watch: CoordinatorWatch | None) -> int:
        assert watch is not None
        bar = ProgressBar(self._stderr or sys.stderr, job.progress)
        finished_at: float | None = None  # when the coordinator said every pass is done
        trainers_done_at: float | None = None
        next_poll = 0.0
        try:
            while True:
                if self._signal is not None:
                    self._say(f"got {signal.Signals(self._signal).name}; stopping the job")
                    return 128 + self._signal
                now = time.monotonic()
                if now >= next_poll:
                    next_poll = now + 0.5
                    bar.update(watch.poll())
                    if watch.finished and finished_at is None:
                        finished_at = now
                for c in list(self.children):
                    if c.returncode is not None or not self._reap(c):
                        continue
                    if c.returncode == 0 and c.role != "coordinator":
                        continue
                    if c.role == "trainer" and finished_at is not None:
                        self._say(
                            f"{c.name} {describe_exit(c.returncode)} after the last pass; not restarted"
                        )
                        continue
                    if c.restarts >= job.max_restarts:
                        self._say(
                            f"{c.name} {describe_exit(c.returncode)}; it was restarted {c.restarts} time(s), "
                            "the most allowed: stopping the job"
                        )
                        return exit_status(c.returncode) or 1
                    self._say(f"{c.name} {describe_exit(c.returncode)}; {self._recovery(c)}")
                    time.sleep(0.2)  # a crash loop must not spin
                    self._start(c.name, c.env, c.command, c.restarts + 1)
                trainers = [c for c in self.children if c.role == "trainer"]
                if trainers_done_at is None and all(c.returncode is not None for c in trainers):
                    trainers_done_at = now
                if trainers_done_at is not None:
                    pservers = [c for c in self.children if c.is_pserver and not self._reap(c)]
                    if not pservers or now - trainers_done_at >= self.grace:
                        if pservers:
                            names = ", ".join(c.name for c in pservers)
                            self._say(
                                f"stopping {names}: still running {self.grace:g}s after the trainers finished"
                            )
                        bar.update(watch.poll() or watch.last)
                        self._stop([c for c in self.children if c.role != "trainer"])
                        return self._dataset_job_status(watch)
                elif finished_at is not None and now - finished_at >= self.grace:
                    hung = [c for c in trainers if not self._reap(c)]
                    self._say(
                        f"every pass is done; stopping {', '.join(c.name for c in hung)}: still running "
                        f"{self.grace:g}s later"
                    )
                    self._stop(hung)
                time.sleep(POLL_S)
        finally:
            bar.close()

    def _recovery(self, child: _Child) -> str:
        n = f"restart {child.restarts + 1} of {self.dataset_job.max_restarts if self.dataset_job else 0}"
        if child.role == "trainer":
            return f"restarting it ({n}); its task goes back to the queue and it rejoins the job"
        if child.role == "pserver":
            return (
                f"restarting it ({n}); it restores its newest checkpoint in {self.checkpoint_dir} (what it "
                "learned since is lost) and the trainers reconnect"
            )
        return f"restarting it ({n}) from its snapshot; the trainers reconnect and no task is lost"

    def _dataset_job_status(self, watch: CoordinatorWatch) -> int:
        status = watch.last or {}
        if not status.get("finished"):
            self._say("the trainers exited before the coordinator finished every pass")
            return 1
        history = status.get("history", [])
        for summary in history:
            discarded = summary.get("discarded", [])
            self._say(
                f"pass {summary['pass'] + 1}: {len(summary['done'])} tasks done, {summary['samples']:,} samples"
                + (f", discarded tasks {discarded}" if discarded else "")
            )
        if status.get("discarded"):
            reasons = "; ".join(f"task {t}: {why}" for t, why in status["discarded"].items())
            self._say(f"discarded {len(status['discarded'])} task(s) that kept failing: {reasons}")
        self._say("the job finished every pass")
        return 0


def launch(
    script: str,
    args: Sequence[str] = (),
    pservers: int = 1,
    trainers: int = 1,
    mode: str = "sync",
    host: str = "127.0.0.1",
    start_port: int | None = None,
    log_dir: str | os.PathLike | None = None,
    grace: float = 30.0,
    stop_timeout: float = 5.0,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
    dataset_job: DatasetJob | None = None,
) -> int:
    """Run `script` as a job of `pservers` pservers and `trainers` trainers; its exit status.
    With `dataset_job`, the trainers read its dataset through a coordinator and the job
    survives processes dying (see the module doc).

    Raises BuilderError for bad arguments, a port that is taken, or a process that
    cannot be started (after stopping any already started).
    """
    return Launcher(
        script,
        args,
        pservers,
        trainers,
        mode,
        host,
        start_port,
        log_dir,
        grace,
        stop_timeout,
        stdout,
        stderr,
        dataset_job=dataset_job,
    ).run()
