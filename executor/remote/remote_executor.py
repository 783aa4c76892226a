"""RemoteExecutor: Executor's API, with the training running as a parameter-server job.

    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=2)) as exe:
        exe.run(startup)
        for x, y in batches:
            (loss,) = exe.run(main, feed={"x": x, "y": y}, fetch_list=[loss])
        # or, sending batches while the steps before them run (JobDesc.prefetch_batches):
        for (loss,) in exe.run_batches(main, ({"x": x, "y": y} for x, y in batches), [loss]):
            ...

Programs without optimizer ops (the startup program, a test program) run in
the client against the job's values (`exe.scope`). The first program with
optimizer ops deploys the job: it is transpiled for every trainer, each
pserver server runs its startup and then its listen_and_serv loop in the
background, the pservers receive the client's current values (so the job
starts exactly where the client's startup or a loaded checkpoint left it),
and the trainers pull them. Each later run of that program is one step:
the fed batch is split along dim 0 across the trainers, which run
concurrently; a scalar fetch comes back as the batch-weighted mean over
trainers, a per-example fetch (leading dim -1) concatenated, anything else
as trainer 0 computed it. `run_batches` runs a sequence of fed batches the
same way, step after step with the same results, but keeps up to
`prefetch_batches` steps in flight, several to a RUN message (`batches_per_run`):
each trainer goes from one step to the next without waiting for this client,
which only collects the fetches, and both pay for a message every few steps.

A training program with a dataset reader (layers.dataset_reader) is not fed:
deploying it also starts a coordinator, and each run is a step of every
trainer that has a batch of its tasks; a trainer waiting for a task at the end
of a pass takes part without gradients, and once every pass is done, run
raises EOFException. A program with a stream reader (layers.stream_reader, or
JobDesc.stream) runs the same way on the stream's windows, each window to one trainer:
with follow=False, run raises EOFException once the stream, as it was when reading
started, is trained on; a followed stream waits for records without end, until
stop_streams() drains it. When the pservers start from checkpoints in the job's
checkpoint_dir, the job resumes from those instead of the client's values.
"""

from __future__ import annotations

import contextlib
import json
import time
import weakref
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fluidps.endpoints import free_endpoints
from fluidps.errors import EOFException, Error, ExecutionError, UnsupportedError
from fluidps.executor.env import new_incarnation
from fluidps.executor.executor import Executor, FetchTarget, _fetch_name
from fluidps.executor.remote.batches import batch_size, combine_fetches, split_feed
from fluidps.executor.remote.cluster import Cluster
from fluidps.executor.remote.executor_server import REFRESH
from fluidps.executor.remote.job import JobDesc
from fluidps.executor.remote.pipeline_job import PipelineJob
from fluidps.executor.remote.programs import (
    ProgramReads,
    persistables,
    program_reads,
    trains,
    without_readers,
)
from fluidps.executor.remote.remote_scope import RemoteScope
from fluidps.executor.scope import Scope
from fluidps.executor.transport.rpc import RpcClient, RpcSettings, wait_all
from fluidps.executor.transport.wire import Kind, Message, json_fields
from fluidps.ir.program import Program
from fluidps.ops.selected_rows import SelectedRows
from fluidps.ops.sparse_table import SparseTable
from fluidps.profiling import Profile
from fluidps.transpiler.distribute import DistributeTranspiler
from fluidps.transpiler.plan import DistributedPlan

# While a followed stream has no records for any trainer, a step asks again after
# WAIT_POLL_S, then twice as long each time up to WAIT_POLL_MAX_S (as a stream reader does).
WAIT_POLL_S = 0.05
WAIT_POLL_MAX_S = 1.0


@dataclass
class _Flight:
    """Steps sent to the trainers in one RUN each, and not collected yet."""

    requests: dict[RpcClient, tuple[RpcClient, int]]  # trainer -> (its client, the RUN's id)
    steps: int  # the batches each RUN carries
    started: float  # perf_counter when it was sent
    sizes: list[list[int]] = field(default_factory=list)  # each fed step's: each trainer's share


@dataclass
class Deployment:
    """A deployed training program and the connections to its job."""

    program: Program
    plan: DistributedPlan  # trainer 0's; every trainer's pserver programs are the same
    settings: RpcSettings
    pservers: dict[str, RpcClient]  # pserver loop endpoint -> a client observing it
    trainers: list[RpcClient]  # trainer i's executor server
    trainer_persistables: frozenset[str]
    steps: int = 0
    reads: ProgramReads | None = None  # what the trainers read through the coordinator (None: fed)
    finished: set[RpcClient] = field(default_factory=set)  # trainers whose reader is done


class RemoteExecutor:
    def __init__(self, job: JobDesc | None = None, place: Any = None):
        self.job = job or JobDesc()
        self.place = place  # accepted for Fluid compatibility
        self._local = Executor(compile=self.job.compile)  # runs startup and test programs
        self.scope = RemoteScope(self._local.scope)
        self._startup: Program | None = None
        self._deployment: Deployment | None = None
        self._pipeline: PipelineJob | None = None  # a pipeline program's stages, once deployed
        self._failed: str | None = None
        self._cluster = Cluster(self.job, self.job.rpc_settings())
        self._profile = Profile() if self.job.profile else None
        # Closed once: by close(), or when this object is collected or Python exits.
        self._finalizer = weakref.finalize(self, self._cluster.close)

    @property
    def log_dir(self) -> Path:
        """Where the servers this executor started write their output."""
        return self._cluster.log_dir

    # -- running ---------------------------------------------------------------------------

    def run(
        self,
        program: Program | None = None,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Sequence[FetchTarget] | None = None,
        scope: Scope | None = None,
        return_numpy: bool = True,
    ) -> list[Any]:
        """Run `program` as Executor.run does; a training program runs as one step of the job."""
        self._check_usable()
        if not isinstance(program, Program):
            raise ExecutionError("RemoteExecutor.run needs a Program (fluidps has no default program)")
        if scope is not None:
            raise UnsupportedError("a RemoteExecutor keeps its values in the job: read and write exe.scope")
        feed = dict(feed or {})
        fetch_names = [_fetch_name(t) for t in (fetch_list or [])]
        if program.pipeline is not None:  # (PipelineOptimizer's): one process per stage
            return self._pipeline_job(program).step(feed, fetch_names)
        if trains(program):
            return self._train(program, feed, fetch_names)
        return self._run_here(program, feed, fetch_names, return_numpy)

    def _pipeline_job(self, program: Program) -> PipelineJob:
        """The job running pipeline program `program`: deployed at its first step."""
        if self._deployment is not None:
            raise UnsupportedError("this job trains a parameter-server program; one RemoteExecutor runs one")
        if self._pipeline is None:
            try:
                self._pipeline = PipelineJob.deploy(
                    self._cluster, program, self._startup, self._local.scope, self.job
                )
            except Error as e:
                self._failed = f"deploying the pipeline: {e}"
                raise ExecutionError(f"the pipeline could not be deployed: {e}") from None
            self.scope.pipeline = self._pipeline  # exe.scope reads and writes the stages' values from now on
        if self._pipeline.program is not program:
            raise UnsupportedError(
                "this job already trains another program; one RemoteExecutor runs one training program"
            )
        return self._pipeline

    def _run_here(
        self, program: Program, feed: dict[str, Any], fetch_names: list[str], return_numpy: bool
    ) -> list[Any]:
        """A program without optimizer ops runs in the client, against the job's values."""
        reads, writes = persistables(program)
        if self._deployment is None and self._pipeline is None:
            if writes and not reads and not feed:
                self._startup = program  # what the pservers will initialize their slices with
            return self._local.run(program, feed, fetch_names, return_numpy=return_numpy)
        scope = Scope()
        tables = self.scope.hashed_rows(program, feed)
        for name, value in self.scope.gather((reads | writes) - set(tables)).items():
            scope[name] = value.copy()
        for name, table in tables.items():
            scope[name] = table
        results = self._local.run(program, feed, fetch_names, scope=scope, return_numpy=return_numpy)
        changed = {n: scope[n] for n in writes if n in scope}
        if changed:
            self.scope.scatter(changed)
        return results

    def run_batches(
        self,
        program: Program,
        batches: Iterable[Mapping[str, Any]],
        fetch_list: Sequence[FetchTarget] | None = None,
    ) -> Iterator[list[Any]]:
        """Train `program` on each fed batch in turn, as run() would, yielding each step's
        fetches in order. Up to JobDesc.prefetch_batches steps are in flight: the next
        batches go to the trainers while the current steps run, so a trainer starts its
        next step at once. They go `per_run` (JobDesc.batches_per_run, at most half of
        prefetch_batches) to a RUN message, which a trainer runs as so many steps and
        answers once. The steps, and in sync mode their results, are those of calling
        run() on each batch. Leaving the loop early waits for the steps already sent
        (batches gathered for a message not sent yet are not run); a failed step fails
        the job, as in run()."""
        fetch_names = [_fetch_name(t) for t in (fetch_list or [])]
        if not trains(program):
            raise ExecutionError(
                "run_batches trains: give it a program with optimizer ops (run() runs others)"
            )
        job = self.job
        # Two messages fit in flight: a trainer ending one message's steps holds the next.
        per_run = min(job.batches_per_run, max(job.prefetch_batches // 2, 1))
        in_flight: deque[_Flight] = deque()
        gathered: list[dict[str, Any]] = []  # batches for the next message
        try:
            for feed in batches:
                self._check_usable()
                d = self._training_deployment(program)
                if d is None or d.reads is not None:  # deploys with this batch, or reads: one at a time
                    yield self.run(program, feed=feed, fetch_list=fetch_names)
                    continue
                gathered.append(dict(feed))
                if len(gathered) < per_run:
                    continue
                in_flight.append(self._send_steps(d, program, gathered, fetch_names))
                gathered = []
                while sum(f.steps for f in in_flight) + per_run > job.prefetch_batches:
                    yield from self._collect(d, program, in_flight.popleft(), fetch_names)
            if gathered:
                in_flight.append(self._send_steps(self._deployment, program, gathered, fetch_names))
            while in_flight:
                yield from self._collect(self._deployment, program, in_flight.popleft(), fetch_names)
        finally:
            self._abandon(in_flight)

    def _check_usable(self) -> None:
        if not self._finalizer.alive:
            raise ExecutionError("this RemoteExecutor is closed")
        if self._failed is not None:
            raise ExecutionError(f"the job failed earlier and cannot go on: {self._failed}")

    def _training_deployment(self, program: Program) -> Deployment | None:
        """The job training `program` (None: not deployed yet)."""
        d = self._deployment
        if d is not None and program is not d.program:
            raise UnsupportedError(
                "this job already trains another program; one RemoteExecutor runs one training program"
            )
        return d

    def _train(self, program: Program, feed: dict[str, Any], fetch_names: list[str]) -> list[Any]:
        d = self._training_deployment(program)
        if d is None:
            d = self._deploy(program)
        if d.reads is not None:
            checked = self._local.prepare(program, feed.keys(), fetch_names).check_feeds(feed)
            return self._read_step(program, d, checked, fetch_names)
        (fetched,) = self._collect(d, program, self._send_steps(d, program, [feed], fetch_names), fetch_names)
        return fetched

    def _send_steps(
        self, d: Deployment, program: Program, feeds: list[dict[str, Any]], fetch_names: list[str]
    ) -> _Flight:
        """Check fed batches, split each across the trainers and send them as their next
        steps, in one RUN to each trainer."""
        parts = []  # each step's: each trainer's piece of its batch
        for feed in feeds:
            checked = self._local.prepare(program, feed.keys(), fetch_names).check_feeds(feed)
            parts.append(split_feed(checked, len(d.trainers)))
            if self._profile is not None:
                self._profile.step()
        flight = self._send({t: [step[i] for step in parts] for i, t in enumerate(d.trainers)}, fetch_names)
        flight.sizes = [[batch_size(piece) for piece in step] for step in parts]
        return flight

    def _collect(
        self, d: Deployment, program: Program, flight: _Flight, fetch_names: list[str]
    ) -> list[list[Any]]:
        """Wait for the steps of a flight; each step's fetches combined over the trainers."""
        try:
            replies = self._wait(d, flight)
        finally:
            if self._profile is not None:
                self._profile.add("client step", time.perf_counter() - flight.started)
        fetched = [_fetches_of(replies[t], flight.steps, fetch_names, t.peer) for t in d.trainers]
        return [
            combine_fetches(program, fetch_names, [each[i] for each in fetched], sizes)
            for i, sizes in enumerate(flight.sizes)
        ]

    def _abandon(self, in_flight: deque[_Flight]) -> None:
        """Steps sent but no longer wanted (the loop was left, or a step failed): a job still
        healthy waits for them, so that what follows sees every step that was sent."""
        while in_flight:
            flight = in_flight.popleft()
            if self._failed is None:
                with contextlib.suppress(ExecutionError):
                    self._wait(self._deployment, flight)
            else:
                for client, rid in flight.requests.values():
                    client.forget(rid)

    def _send(self, feeds: dict[RpcClient, list[dict]], fetch_names: list[str]) -> _Flight:
        """Send steps to the given trainers (each its feed of every step), one RUN to each,
        without waiting."""
        self.scope.invalidate()
        flight = _Flight({}, len(next(iter(feeds.values()))), time.perf_counter())
        for trainer, steps in feeds.items():
            if len(steps) == 1:
                msg = Message(Kind.RUN, text="trainer", tensors=steps[0], names=fetch_names)
            else:
                msg = Message(Kind.RUN, text="trainer", batches=steps, names=fetch_names)
            flight.requests[trainer] = (trainer, trainer.request(msg))
        return flight

    def _wait(self, d: Deployment, flight: _Flight) -> dict[RpcClient, Message]:
        """Each trainer's reply to steps sent by _send; a failure fails the job."""
        first, last = d.steps + 1, d.steps + flight.steps
        steps = f"step {first}" if first == last else f"steps {first}-{last}"
        try:
            replies = self._cluster.wait_all(flight.requests)
        except Error as e:
            self._failed = f"{steps}: {e}"
            raise ExecutionError(f"the job failed at {steps}: {e}") from None
        d.steps = last
        return replies

    def _read_step(self, program: Program, d: Deployment, feed: dict, fetch_names: list[str]) -> list[Any]:
        """A step of a job whose trainers read their batches from the coordinator's tasks
        (or a stream's windows): every trainer with data steps; one with no task for now
        (the end of a pass) skips it; once every pass is done (the stream drained),
        EOFException. While no trainer has data, a followed stream waits for records
        without end, asking less often the longer it waits; anything else fails after a
        while: nobody holds a task, so none comes."""
        assert d.reads is not None
        follows = d.reads.follow
        deadline = time.monotonic() + self.job.peer_timeout * 6
        poll = WAIT_POLL_S
        while True:
            active = [t for t in d.trainers if t not in d.finished]
            if not active:
                if d.reads.stream is not None:
                    raise EOFException(f"stream {d.reads.stream} is drained")
                raise EOFException("every pass over the dataset is done")
            replies = self._wait(d, self._send({t: [dict(feed)] for t in active}, fetch_names))
            ran = [t for t in active if replies[t].kind == Kind.VALUES]
            d.finished |= {
                t for t in active if replies[t].kind == Kind.NO_TASK and replies[t].text == "finished"
            }
            if ran:
                break
            if not follows and time.monotonic() > deadline:  # everyone waits for a task nobody holds
                raise ExecutionError(
                    "no trainer got a task for a long while: the coordinator holds none for them"
                )
            time.sleep(poll)
            if follows:
                poll = min(poll * 2, WAIT_POLL_MAX_S)
        sizes = [
            json_fields(replies[t].text, {"samples": int})["samples"] if replies[t].text else 1 for t in ran
        ]
        return combine_fetches(program, fetch_names, [replies[t].tensors for t in ran], sizes)

    # -- deploying -------------------------------------------------------------------------

    def _deploy(self, program: Program) -> Deployment:
        if self._startup is None:
            raise ExecutionError(
                "run the startup program before training (exe.run(startup_program)): "
                "the pservers initialize their slices from it"
            )
        job, trainers = self.job, self._cluster.role("trainer")
        # A program this job cannot serve is refused before anything starts.
        reads = program_reads(job, program, self._startup)
        # The pserver loops' endpoints go into the transpiled programs, so they are picked before
        # the loops start; pick_free_ports says where a race remains.
        endpoints = self._cluster.pserver_endpoints or free_endpoints(job.host, job.pservers)
        transpiler = DistributeTranspiler(job.transpiler_config())
        plans = [
            transpiler.transpile(i, program, endpoints, len(trainers), startup_program=self._startup)
            for i in range(len(trainers))
        ]
        plan = plans[0]
        try:
            pservers = self._cluster.role("pserver")
            # Each trainer's incarnation, known to the pservers before any trainer speaks: no
            # other process can take a trainer's id (fluidps.executor.ps.membership).
            incarnations = [new_incarnation() for _ in trainers]
            self._cluster.call_all(
                {t.client: _configure("incarnation", i) for t, i in zip(trainers, incarnations, strict=True)}
            )
            self._cluster.call_all(
                {s.client: _configure("trainer_incarnations", ",".join(incarnations)) for s in pservers}
            )
            self._cluster.call_all(
                {
                    s.client: _load("startup", plan.pserver_startups[ep])
                    for s, ep in zip(pservers, plan.endpoints, strict=True)
                }
            )
            self._cluster.call_all({s.client: Message(Kind.RUN, text="startup") for s in pservers})
            self._cluster.call_all(
                {
                    s.client: _load("pserver", plan.pserver_programs[ep])
                    for s, ep in zip(pservers, plan.endpoints, strict=True)
                }
            )
            self._cluster.call_all({s.client: Message(Kind.START, text="pserver") for s in pservers})
            observers = {
                ep: self._cluster.observe(ep, f"pserver {i} ({ep})") for i, ep in enumerate(plan.endpoints)
            }
            if reads is not None:  # the trainers read their batches from a coordinator's tasks or windows
                coordinator = self._cluster.start_coordinator(job, reads.stream)
                self._cluster.call_all({t.client: _configure("coordinator", coordinator) for t in trainers})
            trainer_vars = frozenset(
                n for n, v in plan.trainer_program.global_block().vars.items() if v.persistable
            )
            d = Deployment(
                program,
                plan,
                self._cluster.settings,
                observers,
                [t.client for t in trainers],
                trainer_vars,
                reads=reads,
            )
            # The job starts from the client's values (its startup's or what was loaded),
            # unless the pservers resumed from checkpoints in the job's checkpoint_dir.
            staged = self.scope.staging
            self.scope.deployment = d
            placed = {p.var for p in plan.placements}
            stats = _ask_all(observers, Kind.STATS)
            resumed = {s["restored_step"] for s in stats.values()} - {None}
            trained = [n for n in placed if isinstance(v := staged.find(n), SparseTable) and len(v)]
            if trained:
                raise UnsupportedError(
                    f"hashed table {trained[0]!r} holds rows trained in this client; a job starts its hashed "
                    "tables empty (or from its checkpoints): run the startup program again before training"
                )
            if not resumed:
                # The trainers' startup programs pull them next.
                values = {n: v for n in placed if _is_value(v := staged.find(n))}
                self.scope.scatter(values, trainers_pull=False)
            for s, p in zip(trainers, plans, strict=True):
                self._cluster.call_all({s.client: _load("startup", p.trainer_startup)})
                self._cluster.call_all({s.client: _load("trainer", p.trainer_program)})
                # What a trainer runs to pull the parameters anew: after exe.scope changed them on the
                # pservers, or after skipping a step (no batch of a dataset's tasks).
                self._cluster.call_all({s.client: _load(REFRESH, without_readers(p.trainer_startup))})
            self._cluster.call_all({t.client: Message(Kind.RUN, text="startup") for t in trainers})
            own = {n: v for n in trainer_vars - placed if _is_value(v := staged.find(n))}  # not readers
            if own:
                self.scope.scatter(own)
        except Error as e:
            self._failed = f"deploying: {e}"
            raise ExecutionError(f"deploying the job failed: {e}") from None
        self._deployment = d
        return d

    @property
    def server_addresses(self) -> dict[str, str]:
        """Where the job's executor servers listen, by name (pserver.0, trainer.1, ...)."""
        return {f"{s.role}.{s.index}": s.client.endpoint for s in self._cluster.nodes}

    @property
    def server_pids(self) -> dict[str, int]:
        """Process ids of the executor servers this executor started, by name (pserver.0, ...)."""
        return {p.name: p.pid for p in self._cluster.processes}

    @property
    def plan(self) -> DistributedPlan | None:
        """Trainer 0's plan once a training program is deployed."""
        return self._deployment.plan if self._deployment else None

    def pserver_stats(self) -> dict[str, dict[str, Any]]:
        """Each pserver's counters (steps, clocks, received rows), by endpoint."""
        d = self._deployment
        if d is None:
            return {}
        return _ask_all(d.pservers, Kind.STATS)

    def stage_stats(self) -> list[dict[str, Any]]:
        """Each pipeline stage's state, by stage (as trainer_stats, plus `pipeline`: its
        parameters and their bytes, and the most micro-batches' activations it held at once)."""
        return self._pipeline.stats() if self._pipeline is not None else []

    def trainer_stats(self) -> list[dict[str, Any]]:
        """Each trainer's state, by trainer id: the programs it holds, its background
        run, the RUN messages it ran through and their batches, by program (ran: {name:
        {runs, batches}}), its process's resident memory (rss_bytes) and, once it
        trained, how many of its distributed-table prefetches were served by rows asked
        for ahead (prefetches: served_ahead) and how many went as messages (sent)."""
        d = self._deployment
        if d is None:
            return []
        replies = wait_all({i: (c, c.request(Message(Kind.STATUS))) for i, c in enumerate(d.trainers)})
        return [json.loads(replies[i].text) for i in range(len(d.trainers))]

    def profile(self) -> dict[str, Any]:
        """Where the job's time went so far (JobDesc(profile=True)): {"client": this
        process's report, "trainers": [each trainer's], "pservers": {endpoint: each
        pserver's}}, each fluidps.profiling.Profile.report() totals (per_step turns two
        of them into a per-step breakdown). Servers not started by this executor report
        only when they were started with --profile."""
        if self._profile is None:
            raise ExecutionError("this job is not profiled: give JobDesc(profile=True)")
        trainers = self.trainer_stats()
        return {
            "client": self._profile.report(),
            "trainers": [t.get("profile") for t in trainers],
            "pservers": {ep: s.get("profile") for ep, s in self.pserver_stats().items()},
        }

    def checkpoint(self, kind: str | None = None) -> dict[str, str]:
        """Every pserver saves a checkpoint now (into the job's checkpoint_dir, set in
        its DistributeTranspilerConfig); {pserver endpoint: its checkpoint manifest}.
        `kind`: "base", or "delta" (hashed tables save only the rows updated since the
        pserver's last base; a base when it has none yet); None: as the job's
        checkpoint_base_every says."""
        d = self._deployment
        if d is None:
            raise ExecutionError(
                "the job has not started: run the training program once before checkpointing"
            )
        if kind not in (None, "base", "delta"):
            raise ExecutionError(f"checkpoint kind must be 'base', 'delta' or None, got {kind!r}")
        replies = _ask_all(d.pservers, Kind.CHECKPOINT, text=kind or "")
        return {ep: saved["path"] for ep, saved in replies.items()}

    def stop_streams(self) -> int:
        """Drain the job's stream, as Executor.stop_streams() drains a process's: its
        coordinator cuts no more windows, each trainer finishes the window in hand (its
        records applied, the stream's offset committed), then run() raises EOFException.
        Safe to call from a signal handler (SIGTERM) or another thread while run() waits
        for records: it only signals the coordinator. Called before the program reading
        the stream is deployed, that job drains as it starts. Returns how many streams
        drain (0: the job serves none yet)."""
        return self._cluster.drain_stream()

    # -- ending ----------------------------------------------------------------------------

    def close(self) -> list[str]:
        """End the job: trainers tell the pservers they are done, the pserver loops end,
        servers this executor started exit (or are stopped by their pid). Returns the
        problems met, as Executor.close does."""
        if self._failed is not None:
            self._cluster.keep_logs = True
        return self._finalizer() or []

    def __enter__(self) -> RemoteExecutor:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        problems = self.close()
        if problems and exc_type is None:
            raise ExecutionError(f"the job did not end cleanly: {'; '.join(problems)}")


# -- helpers ---------------------------------------------------------------------------------


def _ask_all(pservers: Mapping[str, RpcClient], kind: int, text: str = "") -> dict[str, Any]:
    """Every pserver's JSON answer to a `kind` request (STATS, CHECKPOINT), asked at once."""
    replies = wait_all({ep: (c, c.request(Message(kind, text=text))) for ep, c in pservers.items()})
    return {ep: json.loads(r.text) for ep, r in replies.items()}


def _fetches_of(reply: Message, steps: int, fetch_names: list[str], trainer: str) -> list[Mapping[str, Any]]:
    """Each step's fetches in a trainer's reply to a RUN of `steps` batches, checked."""
    fetched = reply.batches if steps > 1 else [reply.tensors]
    missing = [n for each in fetched for n in fetch_names if n not in each]
    if len(fetched) != steps or missing:
        raise ExecutionError(
            f"{trainer} answered a RUN of {steps} batch(es) with the fetches of {len(fetched)}"
            + (f", without fetch {missing[0]!r}" if missing else "")
            + ": it runs another version of fluidps; run the same one everywhere"
        )
    return fetched


def _configure(setting: str, value: str) -> Message:
    """A CONFIGURE of one setting of the job (ExecutorServer._configure)."""
    return Message(Kind.CONFIGURE, text=json.dumps({setting: value}))


def _load(name: str, program: Program) -> Message:
    return Message(Kind.LOAD, text=name, blobs=[program.serialize_to_string()])


def _is_value(value: Any) -> bool:
    """A tensor that can travel (a reader object, say, cannot)."""
    return isinstance(value, (np.ndarray, SelectedRows))
