"""Run a parameter-server job on one machine: N pservers and M trainers of one script.

Every process runs `python script.py args` with the environment contract of
`fluidps.executor.env` and lives in its own process group, so stopping it also
stops whatever it started. Its output comes back line by line, prefixed with
"[pserver.0] " / "[trainer.1] ". The job ends when

- every trainer exited 0 and then every pserver exited (or was stopped after `grace`
  seconds): status 0;
- any process exited non-zero: the rest are stopped, status is the failed one's
  (128 + signal number for a process killed by a signal);
- the launcher gets SIGINT / SIGTERM / SIGHUP: the processes are stopped, status 128 + signal.

With `stages=P` the job is a pipeline instead: P processes of the script, "stage.0" ..
"stage.P-1", each told its stage and every stage's endpoint (FLUIDPS_STAGE,
FLUIDPS_STAGE_ENDPOINTS; no pserver): it ends when every stage exited 0. With
`trainers=N` and `pservers=S` too, N replicas of the stages ("stage.k.r") keep each
stage's parameters in step through S pservers of that stage's own ("pserver.k.j").

With a dataset, the job is fault tolerant instead: see DatasetLauncher
(fluidps.executor.launch.dataset_launcher).

Whatever happens, every process is stopped and reaped before `run()` returns.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from fluidps.endpoints import format_endpoint, pick_free_ports
from fluidps.errors import BuilderError
from fluidps.executor.env import (
    CONTRACT_VARS,
    INCARNATION_ENV,
    REPLACES_ENV,
    SECRET_ENV,
    TRAINER_INCARNATIONS_ENV,
    new_incarnation,
)
from fluidps.executor.launch.processes import (
    metrics_environment,
    metrics_ports,
    reap_group,
    stop_groups,
    thread_limits,
)
from fluidps.executor.transport.proof import JobSecret
from fluidps.transpiler.config import MODES

POLL_S = 0.05
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


def job_environments(
    host: str,
    ports: Sequence[int],
    trainers: int,
    mode: str,
    base: Mapping[str, str] | None = None,
    extra: Mapping[str, str] | None = None,
    secret: JobSecret | None = None,
) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of every process: the pservers, then the trainers. `extra`
    goes to every one of them (a dataset job's coordinator and checkpoint settings), and
    so does the job's `secret` (a new one unless given: transport.proof)."""
    env = _common_environment(base, len(ports) + trainers, trainers, mode, secret, extra)
    env["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(format_endpoint(host, p) for p in ports)
    # Every trainer's incarnation, known to the pservers before any trainer speaks: no
    # other process can claim a trainer id (fluidps.executor.ps.membership).
    incarnations = [new_incarnation() for _ in range(trainers)]
    pserver = {"TRAINING_ROLE": "PSERVER", "POD_IP": host, TRAINER_INCARNATIONS_ENV: ",".join(incarnations)}
    jobs = [(f"pserver.{i}", env | pserver | {"PADDLE_PORT": str(port)}) for i, port in enumerate(ports)]
    jobs += [
        (
            f"trainer.{i}",
            env | {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(i), INCARNATION_ENV: incarnations[i]},
        )
        for i in range(trainers)
    ]
    return jobs


def _common_environment(
    base: Mapping[str, str] | None,
    processes: int,
    trainers: int,
    mode: str,
    secret: JobSecret | None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """What every process of a job of `processes` gets, whatever its role."""
    env = dict(os.environ if base is None else base)
    for var in CONTRACT_VARS:  # a launcher run inside a job must not pass its own role on
        env.pop(var, None)
    env.update(
        PADDLE_TRAINERS_NUM=str(trainers),
        FLUIDPS_MODE=mode,
        PYTHONUNBUFFERED="1",  # lines show up as they are printed, not when a buffer fills
        FLUIDPS_STACKS_ON_SIGUSR1="1",  # kill -USR1 shows where a process waits
        **{SECRET_ENV: (secret or JobSecret.generate()).hex()},
        **(extra or {}),
    )
    # Each process gets its share of the cores unless the user set thread counts.
    share = max((os.cpu_count() or 1) // processes, 1)
    for name, value in thread_limits(share).items():
        env.setdefault(name, value)
    return env


def stage_environments(
    host: str,
    ports: Sequence[int],
    mode: str,
    base: Mapping[str, str] | None = None,
    secret: JobSecret | None = None,
    replicas: int = 1,
    pserver_ports: Sequence[int] = (),
) -> list[tuple[str, dict[str, str]]]:
    """(name, environment) of every process of a launched pipeline: `replicas` replicas of
    its stages, replica r's stage k listening for its peers' values at
    ports[r * stages + k] ("stage.k", or "stage.k.r" with several replicas: trainer r of
    `replicas`, FLUIDPS_STAGE=k); and, with `pserver_ports` (stage-major, the same number
    per stage), each stage's pservers ("pserver.k.j", FLUIDPS_STAGE=k), whose trainers are
    the replicas' processes of that stage."""
    if replicas < 1 or len(ports) % replicas or len(pserver_ports) % (len(ports) // replicas):
        raise BuilderError(
            f"{len(ports)} stage ports and {len(pserver_ports)} pserver ports do not make {replicas} replicas"
        )
    stages = len(ports) // replicas
    per_stage = len(pserver_ports) // stages
    env = _common_environment(base, len(ports) + len(pserver_ports), replicas, mode, secret)
    incarnations = [[new_incarnation() for _ in range(stages)] for _ in range(replicas)]
    jobs = []
    for k in range(stages):
        mine = pserver_ports[k * per_stage : (k + 1) * per_stage]
        servers = ",".join(format_endpoint(host, p) for p in mine)
        for j, port in enumerate(mine):
            jobs.append(
                (
                    f"pserver.{k}.{j}",
                    env
                    | {
                        "TRAINING_ROLE": "PSERVER",
                        "FLUIDPS_STAGE": str(k),
                        "PADDLE_PSERVERS_IP_PORT_LIST": servers,
                        "POD_IP": host,
                        "PADDLE_PORT": str(port),
                        TRAINER_INCARNATIONS_ENV: ",".join(incarnations[r][k] for r in range(replicas)),
                    },
                )
            )
    for r in range(replicas):
        endpoints = ",".join(format_endpoint(host, p) for p in ports[r * stages : (r + 1) * stages])
        for k in range(stages):
            stage_env = env | {
                "TRAINING_ROLE": "TRAINER",
                "PADDLE_TRAINER_ID": str(r),
                "FLUIDPS_STAGE": str(k),
                "FLUIDPS_STAGE_ENDPOINTS": endpoints,
                INCARNATION_ENV: incarnations[r][k],
            }
            if per_stage:
                mine = pserver_ports[k * per_stage : (k + 1) * per_stage]
                stage_env["PADDLE_PSERVERS_IP_PORT_LIST"] = ",".join(format_endpoint(host, p) for p in mine)
            jobs.append((f"stage.{k}" if replicas == 1 else f"stage.{k}.{r}", stage_env))
    return jobs


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    command: list[str]
    env: dict[str, str]
    log: BinaryIO | None = None
    log_lock: threading.Lock = field(default_factory=threading.Lock)
    readers: list[threading.Thread] = field(default_factory=list)
    restarts: int = 0

    @property
    def returncode(self) -> int | None:
        """Its exit status once reaped (Launcher._reap), else None."""
        return self.proc.returncode

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
        bind_cores: bool = False,
        stages: int = 0,
        metrics_port: int = 0,
    ):
        if not Path(script).is_file():
            raise BuilderError(f"script {script} not found")
        if stages < 0:
            raise BuilderError(f"stages must be >= 1 for a pipeline (0: none), got {stages}")
        if stages and trainers > 1 and pservers < 1:
            raise BuilderError(
                f"{trainers} replicas of a pipeline keep their parameters in step through pservers: give "
                "--pservers too (each stage gets that many)"
            )
        if pservers < 1 and not stages:
            raise BuilderError(f"a job needs at least one pserver, got {pservers}")
        if trainers < 1:
            raise BuilderError(f"a job needs at least one trainer, got {trainers}")
        if mode not in MODES:
            raise BuilderError(f"mode {mode!r} is invalid: it should be one of {', '.join(MODES)}")
        if grace < 0 or stop_timeout < 0:
            raise BuilderError("grace and stop_timeout must be >= 0 seconds")
        if not 0 <= metrics_port <= 65535:
            raise BuilderError(f"metrics_port must be a TCP port (0: no metrics), got {metrics_port}")
        self.script, self.args = script, list(args)
        self.pservers, self.trainers, self.mode = pservers, trainers, mode
        self.stages = stages
        self.host, self.start_port = host, start_port
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.grace, self.stop_timeout = grace, stop_timeout
        # Resolved at run time so a caller that swaps sys.stdout (pytest, click) is honoured.
        self._stdout, self._stderr = stdout, stderr
        self.python = python
        # Process k of the job serves its metrics on metrics_port + k (0: none are served).
        self.metrics_port = metrics_port
        self.metrics_ports: dict[str, int] = {}
        # Each process bound to one core of the launcher's (see core_of), or left to the scheduler.
        self.cores: list[int] | None = None
        if bind_cores:
            if not hasattr(os, "sched_setaffinity"):
                raise BuilderError("binding processes to cores needs Linux (os.sched_setaffinity)")
            self.cores = sorted(os.sched_getaffinity(0))
        self.children: list[Child] = []
        self.endpoints: list[str] = []
        # Each run is a job with a secret of its own, in the environment of every process it
        # starts: nothing outside the job is heard (fluidps.executor.transport.proof).
        self.secret: JobSecret | None = None
        self.announce_pids = False  # say each process's pid as it starts (restarts make it useful)
        self._retired: list[Child] = []  # processes that died and were started again
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

    def _pump(self, child: Child, pipe: BinaryIO, dest: IO[str]) -> None:
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
        old = next((i for i, c in enumerate(self.children) if c.name == name), None)
        env = {k: v for k, v in env.items() if k != REPLACES_ENV}
        if old is not None:
            # A restarted process is a new incarnation naming the one it replaces, so that
            # its pservers hand its trainer id over at once; a restarted pserver learns the
            # trainers' incarnations of now.
            env[REPLACES_ENV] = self.children[old].env.get(INCARNATION_ENV, "")
            env[INCARNATION_ENV] = new_incarnation()
            if TRAINER_INCARNATIONS_ENV in env:
                env[TRAINER_INCARNATIONS_ENV] = self._trainer_incarnations()
        env.setdefault(INCARNATION_ENV, new_incarnation())
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
        if self.cores is not None and (core := core_of(name, self.pservers, self.cores)) is not None:
            # Before the process starts any thread (Popen returns once it runs Python's
            # startup): its threads, ZeroMQ's I/O threads too, inherit the binding.
            try:
                os.sched_setaffinity(proc.pid, {core})
            except OSError as e:
                self._say(f"could not bind {name} to core {core}: {e}; it runs unbound")
        child = Child(name, proc, command, env, log, restarts=restarts)
        if self.announce_pids:
            self._say(f"started {name} (pid {proc.pid})")
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

    def _trainer_incarnations(self) -> str:
        """The incarnations of the trainers running now, in trainer id order."""
        trainers = {c.name: c.env.get(INCARNATION_ENV, "") for c in self.children}
        return ",".join(trainers[f"trainer.{i}"] for i in range(self.trainers))

    def _reap(self, child: Child) -> bool:
        """Whether `child` has exited; if so, what it left in its group is killed and it is reaped."""
        return reap_group(child.proc) is not None

    def _live(self) -> list[Child]:
        return [c for c in self.children if not self._reap(c)]

    def _stop(self, children: Sequence[Child]) -> None:
        """SIGTERM to each group, SIGKILL to those still there after stop_timeout; reap all."""
        by_proc = {c.proc: c for c in children}

        def say_killing(procs: list[subprocess.Popen]) -> None:
            self._say(f"killing {', '.join(by_proc[p].name for p in procs)}: still running after SIGTERM")

        stuck = stop_groups(list(by_proc), self.stop_timeout, hurry=lambda: self._hurry, on_kill=say_killing)
        for p in stuck:
            self._say(f"{by_proc[p].name} (pid {p.pid}) did not die after SIGKILL; giving up on it")

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
        try:
            if self.log_dir is not None:
                try:
                    self.log_dir.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise BuilderError(f"cannot create log directory {self.log_dir}: {e}") from None
            # A pipeline's stages listen (each replica's), and its pservers (each stage's); or a job's pservers.
            listening = self.stages * (self.trainers + self.pservers) if self.stages else self.pservers
            ports = pick_free_ports(self.host, listening + self.extra_ports, self.start_port)
            self.endpoints = [format_endpoint(self.host, p) for p in ports[:listening]]
            self.secret = JobSecret.generate()
            extra = self._job_environment(ports[listening:])
            self._say(self._describe())
            if self.stages:
                cut = self.stages * self.trainers
                processes = stage_environments(
                    self.host,
                    ports[:cut],
                    self.mode,
                    secret=self.secret,
                    replicas=self.trainers,
                    pserver_ports=ports[cut:listening],
                )
            else:
                processes = job_environments(
                    self.host, ports[:listening], self.trainers, self.mode, extra=extra, secret=self.secret
                )
            self._assign_metrics_ports([*(name for name, _ in processes), *self.helpers])
            self._start_helpers()
            for name, env in processes:
                if self._signal is not None:
                    break
                self._start(name, env | self._metrics_environment(name))
            return self._supervise()
        finally:
            self._stop(self.children)
            self._finish()
            deadline = time.monotonic() + DRAIN_WAIT_S
            for c in [*self._retired, *self.children]:
                for t in c.readers:
                    t.join(timeout=max(0.0, deadline - time.monotonic()))
                if c.log is not None:
                    with c.log_lock:
                        c.log.close()
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    # -- what a kind of job adds (DatasetLauncher) ---------------------------------------

    extra_ports = 0  # ports the job needs besides the pservers'
    helpers: tuple[str, ...] = ()  # the processes _start_helpers starts (DatasetLauncher: "coordinator")

    def _job_environment(self, extra_ports: Sequence[int]) -> dict[str, str]:
        """Environment every process of the job gets on top of the contract."""
        return {}

    def _describe(self) -> str:
        if self.stages:
            text = f"a pipeline of {self.stages} stages at {','.join(self.endpoints[: self.stages * self.trainers])}"
            if self.pservers:
                text += (
                    f", {self.trainers} replica(s), {self.pservers} pserver(s) per stage at "
                    f"{','.join(self.endpoints[self.stages * self.trainers :])}"
                )
        else:
            text = (
                f"{self.pservers} pserver(s) at {','.join(self.endpoints)}, "
                f"{self.trainers} trainer(s), mode {self.mode}"
            )
        if self.cores is not None:
            if self.stages:
                names = [f"stage.{k}" for k in range(self.stages)]
            else:
                names = [f"pserver.{k}" for k in range(self.pservers)] + [
                    f"trainer.{i}" for i in range(self.trainers)
                ]
            bound = ", ".join(f"{n} on core {core_of(n, self.pservers, self.cores)}" for n in names)
            shared = " (more processes than cores: some share one)" if len(names) > len(self.cores) else ""
            text += f"; bound: {bound}{shared}"
        return text

    def _start_helpers(self) -> None:
        """Start processes the job needs before its pservers and trainers."""

    # -- metrics -----------------------------------------------------------

    def _assign_metrics_ports(self, names: Sequence[str]) -> None:
        """Process k of `names` serves its metrics on metrics_port + k; said in the log."""
        self.metrics_ports = metrics_ports(self.metrics_port, names)
        if self.metrics_ports:
            host = f"[{self.host}]" if ":" in self.host else self.host
            where = ", ".join(f"{name} on {port}" for name, port in self.metrics_ports.items())
            self._say(f"metrics at http://{host}:PORT/metrics: {where}")

    def _metrics_environment(self, name: str) -> dict[str, str]:
        return metrics_environment(self.metrics_ports.get(name), self.host)

    def _finish(self) -> None:
        """Release what the job held, once every process is stopped."""

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
            trainers = [c for c in self.children if c.role in ("trainer", "stage")]
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


def core_of(name: str, pservers: int, cores: Sequence[int]) -> int | None:
    """The core process `name` is bound to: the job's pservers, then its trainers (or a
    pipeline's stages, "stage.k"), take `cores` in turn (round-robin past the last). Other
    processes (a coordinator, a replicated pipeline's "stage.k.r") are not bound."""
    role, _, index = name.partition(".")
    if role not in ("pserver", "trainer", "stage") or not index.isdigit():
        return None
    position = int(index) + (pservers if role == "trainer" else 0)
    return cores[position % len(cores)]


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
    bind_cores: bool = False,
    metrics_port: int = 0,
) -> int:
    """Run `script` as a job of `pservers` pservers and `trainers` trainers; its exit status.
    `bind_cores`: each process bound to one core of this one's (core_of). `metrics_port`:
    process k (the pservers, then the trainers) serves its Prometheus metrics on
    metrics_port + k (fluidps.executor.metrics.job_metrics; 0: none).
    (A job reading a dataset through a coordinator: DatasetLauncher.)

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
        bind_cores=bind_cores,
        metrics_port=metrics_port,
    ).run()
