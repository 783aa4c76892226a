"""`fluidps launch --dataset` / `--stream`: a job that survives any of its processes dying.

A coordinator process hands the trainers the dataset's tasks (FLUIDPS_COORDINATOR,
FLUIDPS_DATASET), or the windows of a stream (FLUIDPS_STREAM), the pservers evict silent trainers and checkpoint into a
directory (FLUIDPS_ELASTIC, FLUIDPS_CHECKPOINT_DIR), and a process that dies is
started again, up to `max_restarts` times each within `restart_window` seconds, after a
backoff (fluidps.executor.launch.restarts): a pserver restores its newest
checkpoint, the coordinator its snapshot, a trainer rejoins while its task goes to
another. The job is done when the coordinator has finished every pass and the
trainers have exited; a progress bar shows the pass, tasks, samples/s and loss.

A streaming job has no last pass: it runs until SIGTERM, which drains it. The launcher
passes it to the coordinator, which cuts no more windows; each trainer finishes the
window in hand, its reader ends (EOFException), the script goes on to what follows its
loop (an export, a save) and exits 0; then the pservers stop (a last checkpoint) and the
launcher exits 0. A second SIGTERM stops everything at once.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fluidps.endpoints import format_endpoint
from fluidps.errors import BuilderError, DatasetError, StreamError
from fluidps.executor import peer_exit
from fluidps.executor.env import CONTRACT_VARS, SECRET_ENV
from fluidps.executor.launch.launcher import POLL_S, Child, Launcher, describe_exit, exit_status
from fluidps.executor.launch.processes import coordinator_flags, thread_limits
from fluidps.executor.launch.progress import CoordinatorWatch, ProgressBar
from fluidps.executor.launch.restarts import RestartBudget
from fluidps.executor.tasks.coordinator import DEFAULT_MAX_FAILURES, DEFAULT_TASK_TIMEOUT
from fluidps.executor.transport.rpc import RpcSettings
from fluidps.io.dataset import Dataset
from fluidps.io.stream import canonical_spec, open_stream


@dataclass(frozen=True)
class DatasetJob:
    """What makes a launched job read a dataset (or a stream: `stream`, open_stream's
    spec, instead) through a coordinator, and survive failures."""

    dataset: str | None
    task_timeout: float = DEFAULT_TASK_TIMEOUT  # an unrenewed task goes to another trainer after this
    max_task_failures: int = DEFAULT_MAX_FAILURES
    max_restarts: int = 3  # per process within restart_window
    restart_window: float = 300.0  # seconds
    checkpoint_dir: str | None = None  # default: checkpoints/ in the log (or a temporary) directory
    checkpoint_every_steps: int = 0
    checkpoint_every_seconds: float = 10.0
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    stream: str | None = None

    def __post_init__(self) -> None:
        if (self.dataset is None) == (self.stream is None):
            raise BuilderError("a coordinated job reads a dataset or a stream: give exactly one")
        if self.task_timeout <= 0 or self.max_task_failures < 0 or self.max_restarts < 0:
            raise BuilderError("task_timeout must be > 0, max_task_failures and max_restarts >= 0")
        if self.restart_window <= 0:
            raise BuilderError(f"restart_window must be > 0 seconds, got {self.restart_window}")
        if self.checkpoint_every_steps < 0 or self.checkpoint_every_seconds < 0:
            raise BuilderError("checkpoint intervals must be >= 0")
        if self.stream is not None and not self.checkpoint_every_seconds > 0:
            raise BuilderError(
                "a streaming job commits a window once the pservers' checkpoints hold it: give "
                "checkpoint_every_seconds > 0 (--checkpoint-every-seconds)"
            )
        try:
            if self.dataset is not None:
                Dataset(self.dataset)
            else:
                open_stream(self.stream).close()
        except (DatasetError, StreamError) as e:
            raise BuilderError(f"--{'dataset' if self.dataset else 'stream'}: {e}") from None

    @property
    def source(self) -> str:
        return self.dataset if self.dataset is not None else str(self.stream)


class DatasetLauncher(Launcher):
    extra_ports = 1  # the coordinator's
    helpers = ("coordinator",)

    def __init__(self, job: DatasetJob, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.dataset_job = job
        self.announce_pids = True  # processes may be restarted: say which is which
        self.coordinator: str | None = None
        self.checkpoint_dir: Path | None = None
        self.state_dir: Path | None = None  # the coordinator's snapshot and default checkpoints
        self._watch: CoordinatorWatch | None = None

    def _describe(self) -> str:
        return f"{super()._describe()}, reading {self.dataset_job.source} (coordinator at {self.coordinator})"

    def _finish(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def _job_environment(self, extra_ports: Sequence[int]) -> dict[str, str]:
        job, (coordinator_port,) = self.dataset_job, extra_ports
        state = self.log_dir if self.log_dir is not None else Path(tempfile.mkdtemp(prefix="fluidps-launch-"))
        self.state_dir = state
        self.coordinator = f"tcp://{format_endpoint(self.host, coordinator_port)}"
        self.checkpoint_dir = Path(job.checkpoint_dir) if job.checkpoint_dir else state / "checkpoints"
        source = (
            {"FLUIDPS_DATASET": str(Path(job.dataset).resolve())}
            if job.dataset is not None
            else {
                "FLUIDPS_STREAM": canonical_spec(str(job.stream)),
                "FLUIDPS_DEAD_LETTERS": str((state / "dead-letters.jsonl").resolve()),
            }
        )
        return {
            **source,
            "FLUIDPS_COORDINATOR": self.coordinator,
            "FLUIDPS_ELASTIC": "1",
            peer_exit.ENV: str(peer_exit.PEER_FAILURE_STATUS),  # a peer's failure is not theirs
            "FLUIDPS_CHECKPOINT_DIR": str(self.checkpoint_dir.resolve()),
            "FLUIDPS_CHECKPOINT_EVERY_STEPS": str(job.checkpoint_every_steps),
            "FLUIDPS_CHECKPOINT_EVERY_SECONDS": str(job.checkpoint_every_seconds),
        }

    def _start_helpers(self) -> None:
        job = self.dataset_job
        assert self.coordinator is not None
        env = dict(os.environ)
        for var in CONTRACT_VARS:
            env.pop(var, None)
        env.update(PYTHONUNBUFFERED="1", **thread_limits(1), **self._metrics_environment("coordinator"))
        env[SECRET_ENV] = self.secret.hex()
        command = [
            self.python, "-m", "fluidps", "serve", "--role", "coordinator",
            "--endpoint", self.coordinator,
            *coordinator_flags(Path(self.state_dir or ".") / "coordinator.json", job.stream),
            "--task-timeout", str(job.task_timeout),
            "--max-task-failures", str(job.max_task_failures),
        ]  # fmt: skip
        if job.stream is not None:
            assert self.checkpoint_dir is not None
            # (a window is committed once the pservers' checkpoints hold it)
            command += ["--checkpoints", str(self.checkpoint_dir.resolve()), "--pservers", str(self.pservers)]
        if "FLUIDPS_PEER_TIMEOUT" in os.environ:
            command += ["--peer-timeout", os.environ["FLUIDPS_PEER_TIMEOUT"]]
        self._start("coordinator", env, command)

    def _supervise(self) -> int:
        job = self.dataset_job
        watch = self._watch = CoordinatorWatch(
            self.coordinator, RpcSettings(peer_timeout=5.0, secret=self.secret)
        )
        bar = ProgressBar(self._stderr or sys.stderr, job.progress)
        budget = RestartBudget(job.max_restarts, job.restart_window)
        due: dict[str, tuple[float, Child]] = {}  # restarts waiting out their backoff
        finished_at: float | None = None  # when the coordinator said every pass is done
        trainers_done_at: float | None = None
        draining = False
        next_poll = 0.0
        try:
            while True:
                if self._signal == signal.SIGTERM and job.stream is not None and not draining:
                    draining, self._signal = True, None  # (a second SIGTERM stops the job)
                    self._drain()
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
                    if not budget.allows(c.name, c.returncode, now):
                        used = budget.used(c.name, now, c.returncode)
                        why = (
                            "restarted after a peer's failure"
                            if budget.peer_caused(c.returncode)
                            else "restarted"
                        )
                        self._say(
                            f"{c.name} {describe_exit(c.returncode)}; it was {why} {used} time(s) within "
                            f"{job.restart_window:g} s, the most allowed: stopping the job"
                        )
                        return exit_status(c.returncode) or 1
                    delay = budget.record(c.name, c.returncode, now)
                    self._say(
                        f"{c.name} {describe_exit(c.returncode)}; {self._recovery(c, budget, delay, now)}"
                    )
                    due[c.name] = (now + delay, c)
                for name, (at, c) in list(due.items()):
                    if now >= at:
                        del due[name]
                        command = c.command
                        if draining and c.role == "coordinator" and "--drain" not in command:
                            command = [*command, "--drain"]  # (it comes back draining)
                        self._start(c.name, c.env, command, c.restarts + 1)
                trainers = [c for c in self.children if c.role == "trainer"]
                if trainers_done_at is None and not due and all(c.returncode is not None for c in trainers):
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
                        if job.stream is not None:
                            return self._stream_job_status(watch)
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

    def _drain(self) -> None:
        """SIGTERM to a streaming job: the coordinator drains (its own SIGTERM handling)."""
        coordinators = [c for c in self.children if c.role == "coordinator" and c.returncode is None]
        for c in coordinators:
            c.proc.send_signal(signal.SIGTERM)
        self._say(
            "got SIGTERM; draining: the trainers finish the windows in hand, then exit (SIGTERM again stops "
            "the job at once)"
        )

    def _stream_job_status(self, watch: CoordinatorWatch) -> int:
        stream = (watch.last or {}).get("stream") or {}
        if not (watch.last or {}).get("finished"):
            self._say("the trainers exited before the stream was drained")
            return 1
        discarded = stream.get("discarded_windows", 0)
        self._say(
            f"drained {self.dataset_job.stream}: {stream.get('records', 0):,} records applied, committed up to "
            f"offset {stream.get('committed')}"
            + (f", {discarded} window(s) discarded after failing" if discarded else "")
        )
        return 0

    def _recovery(self, child: Child, budget: RestartBudget, delay: float, now: float) -> str:
        job = self.dataset_job
        if budget.peer_caused(child.returncode):
            n = f"in {delay:.1f} s; a peer's failure, not counted against its {job.max_restarts} restarts"
        else:
            n = (
                f"in {delay:.1f} s, restart {budget.used(child.name, now)} of {job.max_restarts} "
                f"within {job.restart_window:g} s"
            )
        if child.role == "trainer":
            if job.stream is not None:
                return (
                    f"restarting it ({n}); its window goes to a trainer first, the batches it applied "
                    "are not applied again, and it rejoins the job"
                )
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
