"""The parameter server loop: what listen_and_serv runs.

It receives requests, keeps track of the trainers, and hands each event to the
strategy of its mode (fluidps.executor.ps.strategies: sync, async, ssp), which
applies gradients and says when a GET may be answered; GETs that may not be
answered yet wait in `deferred`, and async SENDs whose gradients are not applied
yet in `unapplied` (the optimize thread wakes the loop when it applies one). A
PREFETCH (rows of a distributed table's block, by index) is a pull like a GET:
checked, then answered when a GET would be. In sync mode a distributed table's
update is held once the step's gradients are in: a PREFETCH has the rows it asks
for applied first and the rest is applied once no request waits (rows_first.py);
any other request, a checkpoint and the loop's end apply it first.

Trainers are tracked by `Membership`: a trainer silent (no message, no
keepalive) for the peer timeout is evicted in an elastic job and fails the job,
by name, otherwise. The loop ends when every trainer said it is done (or the
process is told to stop), never because trainers were evicted: an evicted
trainer may come back, and a pserver left with none waits for one, keeping its
state and checkpointing, for `RpcSettings.rejoin_timeout`.

Checkpoints (`checkpoint_dir`, from the program or the job's CheckpointOverrides):
every N steps or seconds, on a CHECKPOINT request, at the end, and on
SIGTERM; at the start the newest ones are restored, resharded if the job's
pservers changed.

Beside the loop, one job each: serve_spec.py reads the op's attributes once;
optimize_blocks.py runs its sub-blocks; pulls.py and set_check.py check what a GET,
PREFETCH or SET may read or write; trainer_watch.py says when to stop waiting for
trainers; sigterm.py saves before dying of SIGTERM; pserver_stats.py reports.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fluidps.errors import CheckpointError, Error, ExecutionError, TransportError
from fluidps.executor.ps import pserver_stats, pulls, sigterm
from fluidps.executor.ps.applied_batches import AppliedBatches, BatchKey, ack_text, parse_tag
from fluidps.executor.ps.checkpointer import Checkpointer
from fluidps.executor.ps.claims import WaitingClaims
from fluidps.executor.ps.gradients import GradientSpec, RowLog
from fluidps.executor.ps.membership import DONE, Claim, Membership
from fluidps.executor.ps.message_limit import message_limit
from fluidps.executor.ps.optimize_blocks import OptimizeBlocks
from fluidps.executor.ps.rows_first import RowsFirst, split_blocks
from fluidps.executor.ps.serve_spec import ServeSpec
from fluidps.executor.ps.set_check import set_problem, stored
from fluidps.executor.ps.strategies import STRATEGIES, StrategyContext
from fluidps.executor.ps.trainer_watch import TrainerWatch
from fluidps.executor.transport.rpc import Request, RpcServer, Waker
from fluidps.executor.transport.wire import Kind, Message
from fluidps.io import checkpoints as ckpt
from fluidps.ir.operator import Operator
from fluidps.ops.selected_rows import SelectedRows

if TYPE_CHECKING:
    from fluidps.executor.ps.host import PserverHost

_FROM_TRAINERS = (Kind.SEND, Kind.SEND_BARRIER, Kind.FETCH_BARRIER, Kind.COMPLETE, Kind.PAUSE)
_PULLS = (Kind.GET, Kind.PREFETCH)  # answered once the trainer's step allows (sync: applied; ssp: in bounds)


# What a pserver remembers for its stats stays bounded however long the job runs.
CLOCK_LOG_LIMIT = 100_000  # clock and grant events
LOG_LIMIT = 10_000  # lines of its log


class ParameterServer:
    def __init__(self, op: Operator, env: dict[str, Any], host: PserverHost):
        self.spec = spec = ServeSpec.of(op)
        self.env = env
        self.host = host
        self.settings = host.settings
        self.name = spec.name
        program = op.block.program
        declared = program.global_block().vars
        self.blocks = OptimizeBlocks(program, spec, host.runner_for)
        self.grad_specs = {g: GradientSpec.of(declared.get(g)) for g in spec.grad_blocks}
        self.served = {n for n, v in declared.items() if v.persistable}
        if self.settings.max_message_bytes is None:  # else set by hand: it wins
            limit = message_limit(declared, self.served | set(spec.grad_blocks))
            self.settings = self.settings.with_(max_message_bytes=limit)
        self.members = Membership(
            spec.trainers, self.settings.elastic, self.log, expected=self.settings.trainer_incarnations
        )
        self.clock_log: deque[dict[str, Any]] = deque(maxlen=CLOCK_LOG_LIMIT)
        self.received_rows: dict[str, RowLog] = {}  # sparse gradients: which rows arrived
        self.deferred: list[Request] = []
        # Connections whose new incarnation claims a trainer id a live one holds (claims.py).
        self.claims = WaitingClaims(
            self.members,
            self.settings,
            refuse=lambda request, why: self.server.error(request, f"{self.name}: {why}"),
            heard=lambda key: self.server.clock(key),
            log=self.log,
        )
        self.applied_batches = AppliedBatches()  # each stream batch's gradients applied once
        # Async: SENDs acknowledged once their gradients are applied, and when that is.
        self.unapplied: list[tuple[Request, Callable[[], bool]]] = []
        self._waker: Waker | None = None
        self.log_lines: deque[str] = deque(maxlen=LOG_LIMIT)
        self.watch = TrainerWatch(self.members, self.settings, self.log, time.monotonic())
        self.checkpoints = Checkpointer(spec.checkpoints, spec.pserver_id, self.log, host.checkpoints)
        # Sync with one trainer: a distributed table's update is held, and the rows its PREFETCH
        # asks for applied first. (With several, the step waits for the last trainer's rows,
        # which need most of the update anyway, and each cut adds work: 0.94-0.98x measured
        # with two trainers on one pserver.)
        cut = spec.mode == "sync" and spec.trainers == 1
        splits = split_blocks(program, spec.grad_blocks, spec.tables, spec.copies) if cut else {}
        self.rows_first = RowsFirst(env, splits, lambda grads: self.blocks.run(grads, env))
        self._stop_reason: str | None = None
        # Set when the loop stops taking requests (it then finishes what it acknowledged).
        self.ended = threading.Event()
        self.server: RpcServer | None = None
        self.stall = pserver_stats.Stall(time.monotonic())
        self._handlers: dict[int, Callable[[Request], None]] = {
            Kind.HELLO: lambda r: self.server.reply(r),
            Kind.SEND: self._on_send,
            Kind.GET: self._on_get,
            Kind.PREFETCH: self._on_prefetch,
            Kind.SEND_BARRIER: self._on_send_barrier,
            Kind.FETCH_BARRIER: lambda r: self.server.reply(r),
            Kind.COMPLETE: self._on_complete,
            Kind.PAUSE: self._on_pause,
            Kind.SET: self._on_set,
            Kind.STATS: lambda r: self.server.reply(
                r, Message(Kind.VALUES, text=json.dumps(self.stats(compact=True)))
            ),
            Kind.CHECKPOINT: self._on_checkpoint,
        }
        # Last, of the server now complete: what its strategy works with.
        context = StrategyContext(
            env=env,
            trainers=spec.trainers,
            staleness=spec.staleness,
            copies=spec.copies,
            members=self.members,
            blocks=self.blocks,
            apply=lambda grads: self.blocks.run(self.rows_first.hold(grads), env),  # rows_first.py
            clock_log=self.clock_log,
            log=self.log,
            applied=self.applied,
            wake=self.wake,
        )
        self.strategy = STRATEGIES[spec.mode](context)

    def log(self, message: str) -> None:
        self.log_lines.append(message)
        print(f"{self.name}: {message}", flush=True)

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> None:
        context = self.host.context_for(self.spec.endpoint)
        self.server = RpcServer(context, self.spec.endpoint, self.name, self.settings, self.host.profile)
        self._waker = Waker(context)
        with sigterm.saved_before_dying(self.checkpoints.enabled, self._sigterm):
            try:
                restored = self.checkpoints.restore(self.env, self.spec.pserver_id)
                if self.checkpoints.restored_books is not None:  # (what the restored values hold)
                    self.applied_batches = AppliedBatches.from_manifest(self.checkpoints.restored_books)
                self.strategy.start(restored or 0)
                if self.checkpoints.before_serving and self.checkpoints.enabled and self.spec.mode != "sync":
                    self._checkpoint("restored" if restored is not None else "start")
                while not self.members.done and self._stop_reason is None:
                    self._handle_all(self.server.receive(0.05, wake=self._waker.socket))
                    self._check_trainers()
                    self.claims.retry(self._handle)
                    self._check_rejoin()
                    self._answer_deferred()
                    self._report_stall()
                    self._maybe_checkpoint()
                    self._finish_held()
                    for (
                        tick
                    ) in self.host.ticks:  # (what watches the loop: fluidps.executor.metrics publishes)
                        tick(self)
                    failure = self.strategy.failure
                    if failure is not None:
                        raise ExecutionError(f"{self.name}: an optimize block failed: {failure}") from failure
                    if (idle := self.watch.idle(time.monotonic())) is not None:
                        raise TransportError(f"{self.name}: {idle}")
                self._apply_held()
                self.ended.set()
                self.strategy.stop()  # every acknowledged gradient applied before the last checkpoint
                updates = self.strategy.gradients_applied
                if self.checkpoints.enabled and self.checkpoints.changed_since_last(
                    self.strategy.steps, updates
                ):
                    self._checkpoint(self._stop_reason or "end")
            finally:
                self.ended.set()
                self.strategy.stop()
                self.server.close()
                self._waker.close()

    def _sigterm(self) -> None:
        self._stop_reason = "SIGTERM"  # (a signal handler: the loop sees it within its 50 ms wait)

    def _finish_held(self) -> None:
        """Once a PREFETCH has had its rows of a held table update (rows_first.py), apply the
        rest, after the requests already waiting: the trainer computes meanwhile. Until a
        PREFETCH comes the update stays held (the next step's rows are applied first);
        anything else that reads the tables applies it first."""
        if self.rows_first.pending and self.rows_first.asked and hasattr(os, "sched_yield"):
            # The answer just went to ZeroMQ's I/O thread, which often waits for this
            # thread's core: let it send before the rest's update takes the core.
            os.sched_yield()
        while self.rows_first.pending and self.rows_first.asked:
            waiting = self.server.receive(0)
            if not waiting:
                self._apply_held()
                return
            self._handle_all(waiting)

    def _apply_held(self, asked: dict[str, np.ndarray] | None = None) -> None:
        """Apply the held table updates: the rows `asked` (a PREFETCH's) only, or all."""
        try:
            if asked is None:
                self.rows_first.flush()
            else:
                self.rows_first.first(asked)
        except Error as e:  # the step's gradients were acknowledged: no request to tell
            raise ExecutionError(f"{self.name}: an optimize block failed: {e}") from e

    def _report_stall(self) -> None:
        """Say what the job waits for when requests wait on a step (pserver_stats.Stall)."""
        if self.stall.due(self.strategy.progress, bool(self.deferred), time.monotonic()):
            waiting = sorted({(r.msg.trainer_id, r.msg.kind_name) for r in self.deferred})
            states = {t: m.state for t, m in self.members.members.items()}
            self.log(
                f"{self.stall}: requests waiting {waiting}: {self.strategy.describe_wait()}; trainers {states}"
            )

    def stop(self, reason: str) -> None:
        """Make the loop end (checkpointing first when it has a directory); thread-safe."""
        self._stop_reason = reason
        self.wake()

    def wake(self) -> None:
        """End the loop's wait for requests now (thread-safe): something else is due."""
        if self._waker is not None:
            self._waker.wake()

    def applied(self) -> None:
        """The optimize thread applied gradients (thread-safe): a SEND may be acknowledged.
        (It counted the gradient before this looks at `unapplied`, and the loop appends
        only SENDs it found not yet applied, so none is missed.)"""
        if self.unapplied:
            self.wake()

    def stats(self, compact: bool = False) -> dict[str, Any]:
        """Counters, clocks and logs, as a snapshot (fluidps.executor.ps.pserver_stats)."""
        return pserver_stats.snapshot(self, compact)

    # -- requests ---------------------------------------------------------------------------

    def _handle_all(self, requests: list[Request]) -> None:
        for request in requests:
            self.watch.heard(time.monotonic())
            self._handle(request)

    def _handle(self, request: Request) -> None:
        msg = request.msg
        if msg.kind != Kind.PREFETCH:
            self._apply_held()  # (a PREFETCH reads only the rows it asks for: see _answer)
        # GET and SET also come from observers (trainer id -1): a RemoteExecutor saving or loading.
        observer = (
            msg.kind in (Kind.GET, Kind.PREFETCH, Kind.SET, Kind.STATS, Kind.CHECKPOINT)
            and msg.trainer_id == -1
        )
        if (msg.kind in _FROM_TRAINERS or msg.kind in _PULLS) and not observer:
            if msg.trainer_id not in range(self.spec.trainers):
                self.server.error(
                    request, f"{self.name} serves trainers 0..{self.spec.trainers - 1}, not {msg.trainer_id}"
                )
                return
            if self.claims.queue(request):  # its claim waits: so do its later requests
                return
            try:
                self._admit(request)
            except Claim as claim:
                self.claims.wait(request, claim)
                return
            except TransportError as e:
                self.server.log_rejected(f"refused {msg.kind_name} as trainer {msg.trainer_id}: {e}")
                self.server.error(request, f"{self.name}: {e}")
                return
        handler = self._handlers.get(msg.kind)
        if handler is None:
            self.server.error(request, f"{self.name} does not handle {msg.kind_name} messages")
            return
        try:
            if self.host.profile is None:
                handler(request)
            else:
                with self.host.profile.span(f"handle {msg.kind_name}"):
                    handler(request)
        except Error as e:
            self.server.error(request, f"{self.name}: {e}")

    def _admit(self, request: Request) -> None:
        msg, trainer = request.msg, request.msg.trainer_id
        before = self.members.members[trainer].sender
        self.members.admit(trainer, msg.sender, request.client, msg.replaces)
        member = self.members.members[trainer]
        self.server.track((trainer, member.sender))
        if before and member.sender != before:  # a new incarnation replaced an old one
            self.server.untrack((trainer, before))
            self._forget(trainer)
        if member.state == DONE and msg.kind != Kind.COMPLETE:
            raise TransportError(f"trainer {trainer} already said it is done")
        if msg.kind in (Kind.SEND, Kind.SEND_BARRIER):
            self.members.resume(trainer)

    def _forget(self, trainer: int) -> None:
        """Drop what a trainer's old incarnation started: its barrier and its waiting GETs."""
        self.strategy.forget(trainer)
        self.deferred = [r for r in self.deferred if r.msg.trainer_id != trainer]
        self.unapplied = [(r, a) for r, a in self.unapplied if r.msg.trainer_id != trainer]

    # -- gradients ------------------------------------------------------------------------

    def _on_send(self, request: Request) -> None:
        """Gradients; with `barrier`, also the trainer's send barrier of its step; with
        names, also a GET of them (answered once the step allows, as a GET is)."""
        msg = request.msg
        tag = parse_tag(msg.text)  # (the stream batch it trained on, if a stream reader gave it)
        unknown = [g for g in msg.tensors if g not in self.spec.grad_blocks]
        if unknown:
            self.server.error(request, f"{self.name} owns no gradient named {', '.join(map(repr, unknown))}")
            return
        pulls.check_get(msg.names, self.served, self.env)
        wrong = [p for g, v in msg.tensors.items() if (p := self.grad_specs[g].problem(g, v)) is not None]
        if wrong:  # refused whole: nothing of it is stored or applied, and the step waits
            self.log(f"refused trainer {msg.trainer_id}'s SEND of its step {msg.step}: {'; '.join(wrong)}")
            self.server.error(request, f"{self.name} refused gradients: {'; '.join(wrong)}")
            return
        # (a sync round may leave an evicted trainer's gradients out: there, at least once)
        books = tag is not None and self.spec.mode != "sync"
        tensors = self._fresh(msg, tag) if books else msg.tensors
        for grad, value in tensors.items():
            if isinstance(value, SelectedRows):
                self.received_rows.setdefault(grad, RowLog()).add(value.rows)
        if (silence := self.server.clock((msg.trainer_id, msg.sender))) is not None:
            silence.warm = True  # it sent a step: its kernels are compiled
        applied = self.strategy.on_gradients(msg.trainer_id, msg.step, tensors)
        if books:  # (once accepted: a SEND refused is not counted)
            self.applied_batches.mark(tag, list(msg.tensors))
        if applied is not None and not applied():
            self.unapplied.append((request, applied))  # (async: no barrier rides on it)
            return
        if msg.names:
            if msg.barrier:
                self.strategy.on_barrier(msg.trainer_id, msg.step)
            self._pull(request)
            return
        self._acknowledge(request)
        if msg.barrier:
            self.strategy.on_barrier(msg.trainer_id, msg.step)

    def _acknowledge(self, request: Request) -> None:
        self.server.reply(request, Message(Kind.OK, text=self._ack_text()))

    def _ack_text(self) -> str:
        """What an acknowledgement of gradients says of this pserver's checkpoints when it
        keeps books (applied_batches.ack_text: its newest checkpoint and the books'
        incarnation; a trainer reports them with its window, checkpoint_watch.py)."""
        newest = self.checkpoints.newest_count
        if self.spec.mode == "sync" or newest is None:
            return ""
        return ack_text(self.spec.pserver_id, newest, self.applied_batches.incarnation)

    def _fresh(self, msg: Message, tag: BatchKey) -> dict[str, Any]:
        """The gradients of a SEND of stream batch `tag` not applied before (applied_batches.py)."""
        keep, dropped = self.applied_batches.split(tag, list(msg.tensors))
        if dropped:
            self.log(
                f"trainer {msg.trainer_id}'s gradients of the batch at offset {tag[2]} of the stream window at {tag[1]} "
                f"were applied before (the window went to another trainer): {len(dropped)} dropped"
            )
        return {name: msg.tensors[name] for name in keep}

    def _on_send_barrier(self, request: Request) -> None:
        """A barrier without gradients (a trainer waiting for a task keeps in step): it
        is answered, as a GET of nothing, once its round is done, with the steps done."""
        self.strategy.on_barrier(request.msg.trainer_id, request.msg.step)
        self._pull(request)

    # -- trainers coming and going ------------------------------------------------------------

    def _on_pause(self, request: Request) -> None:
        self.members.pause(request.msg.trainer_id)
        self.server.reply(request)
        self.strategy.on_members_changed()

    def _on_complete(self, request: Request) -> None:
        self.members.complete(request.msg.trainer_id)
        self.server.reply(request)
        self.strategy.on_members_changed()

    def _check_trainers(self) -> None:
        """Evict (elastic) or fail on trainers silent past their allowance (trainer_watch.py)."""
        for trainer, why in self.watch.silent(self.server.clock, time.monotonic()):
            sender = self.members.members[trainer].sender  # (read first: an eviction zeroes it)
            self.members.lose(trainer, why)
            self.server.untrack((trainer, sender))
            if not self.members.elastic:
                error = f"{self.name}: trainer {trainer} was {why}; the job cannot go on without it"
                for waiting in self.deferred:
                    self.server.error(waiting, error)
                self.deferred = []
                raise TransportError(error)
            self._forget(trainer)
            self.strategy.on_members_changed()

    def _check_rejoin(self) -> None:
        """With every trainer not done evicted past the rejoin timeout (trainer_watch.py),
        save what was learned and give the job up, saying why."""
        if not self.watch.given_up(time.monotonic()):
            return
        if self.checkpoints.enabled:
            self._checkpoint("abandoned")
        raise TransportError(
            f"{self.name}: no evicted trainer ({', '.join(map(str, sorted(self.members.lost)))}) came back "
            f"within {self.settings.rejoin_timeout:g} s (RpcSettings.rejoin_timeout); the job is given up"
            + (" after a last checkpoint" if self.checkpoints.enabled else "")
        )

    # -- parameters -----------------------------------------------------------------------

    def _on_get(self, request: Request) -> None:
        pulls.check_get(request.msg.names, self.served, self.env)
        self._pull(request)

    def _on_prefetch(self, request: Request) -> None:
        """Rows of distributed tables, by index: checked whole before anything is read."""
        pulls.check_prefetch(request.msg.tensors, self.spec.tables, self.env)
        self._pull(request)

    def _pull(self, request: Request) -> None:
        if self._may_answer(request.msg):
            self._answer(request)
        else:
            self.deferred.append(request)

    def _may_answer(self, msg: Message) -> bool:
        return msg.trainer_id < 0 or self.strategy.may_answer(msg.trainer_id)  # < 0: an observer

    def _answer(self, request: Request) -> None:
        msg = request.msg
        if msg.kind == Kind.PREFETCH:
            if self.rows_first.pending:
                self._apply_held(msg.tensors)  # the rows asked for now, the rest once nothing waits
            values = {name: self._read(name, rows) for name, rows in msg.tensors.items()}
        else:
            if self.rows_first.holds(msg.names):
                self._apply_held()
            values = {name: self._read(name) for name in msg.names}
            if msg.trainer_id >= 0:
                self.strategy.answered(msg.trainer_id)
        reply = Message(Kind.VALUES, tensors=values, step=self.strategy.steps, text=self._ack_text())
        self.server.reply(request, reply)

    def _read(self, name: str, rows: np.ndarray | None = None) -> Any:
        """What is sent of `name` (or of its `rows`): copied under its lock while the
        strategy's optimize thread may update it."""
        lock = self.blocks.locked(name) if self.strategy.updates_meanwhile else None
        return pulls.read(self.env, name, rows, lock)

    def _answer_deferred(self) -> None:
        sends, self.unapplied = self.unapplied, []
        for request, applied in sends:
            if not applied():
                self.unapplied.append((request, applied))
            elif request.msg.names:
                self._pull(request)
            else:
                self._acknowledge(request)
        waiting, self.deferred = self.deferred, []
        for request in waiting:
            if self._may_answer(request.msg):
                self._answer(request)
            else:
                self.deferred.append(request)

    def _on_set(self, request: Request) -> None:
        """Overwrite persistable variables (loading saved values): each value must be what
        the variable is, checked for all of them before any is stored."""
        for name, value in request.msg.tensors.items():
            problem = set_problem(self.env.get(name) if name in self.served else None, value)
            if problem is not None:
                raise ExecutionError(f"cannot set {name!r}: {problem}")
        own = not self.server.address.startswith("inproc://")  # (inproc: the sender's memory)
        for name, value in request.msg.tensors.items():
            with self.blocks.locked(name):
                self.env[name] = stored(value, own)
        self.server.reply(request)

    # -- checkpoints ------------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        if self.checkpoints.due(self.strategy.steps, self.strategy.gradients_applied):
            self._checkpoint("periodic")

    def _checkpoint(self, reason: str, delta: bool | None = None) -> ckpt.Checkpoint:
        """Save a checkpoint; `delta`: of hashed tables' changes since the last base (None:
        as the checkpoint schedule says)."""
        self._apply_held()
        # Every gradient accepted applied first, so that the books say what the values hold.
        self.strategy.settle()
        if (failure := self.strategy.failure) is not None:  # (the books would hold what failed)
            raise ExecutionError(
                f"{self.name}: no checkpoint: an optimize block failed: {failure}"
            ) from failure
        books = None if self.spec.mode == "sync" else self.applied_batches.to_manifest(self.spec.grad_blocks)
        return self.checkpoints.take(
            self.env,
            self.blocks.locked,
            self.strategy.steps,
            reason,
            delta,
            books,
            self.strategy.gradients_applied,
        )

    def _on_checkpoint(self, request: Request) -> None:
        kinds = {"": None, "base": False, "delta": True}
        if request.msg.text not in kinds:
            raise CheckpointError(f"a checkpoint is a 'base' or a 'delta', not {request.msg.text!r}")
        saved = self._checkpoint("requested", kinds[request.msg.text])
        text = json.dumps(ckpt.describe(saved) | {"path": str(saved.path)})
        self.server.reply(request, Message(Kind.VALUES, text=text))
