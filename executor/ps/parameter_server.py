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
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from fluidps.errors import CheckpointError, Error, ExecutionError, TransportError
from fluidps.executor.ps import pserver_stats
from fluidps.executor.ps.checkpointer import Checkpointer
from fluidps.executor.ps.claims import WaitingClaims
from fluidps.executor.ps.gradients import GradientSpec, RowLog
from fluidps.executor.ps.joined_blocks import JoinedBlocks
from fluidps.executor.ps.membership import DONE, Claim, Membership
from fluidps.executor.ps.message_limit import message_limit
from fluidps.executor.ps.rows_first import RowsFirst, SplitBlock, split_block
from fluidps.executor.ps.set_check import set_problem
from fluidps.executor.ps.strategies import STRATEGIES
from fluidps.executor.transport.rpc import Request, RpcServer, Waker
from fluidps.executor.transport.wire import Kind, Message
from fluidps.io import checkpoints as ckpt
from fluidps.ir.operator import Operator
from fluidps.ir.types import DISTRIBUTED_MODES
from fluidps.ops.selected_rows import SelectedRows
from fluidps.ops.sparse_table import SparseTable

if TYPE_CHECKING:
    from fluidps.executor.ps.host import PserverHost

IDLE_TIMEOUT = 3600.0  # seconds without any message while trainers are live
_FROM_TRAINERS = (Kind.SEND, Kind.SEND_BARRIER, Kind.FETCH_BARRIER, Kind.COMPLETE, Kind.PAUSE)
_PULLS = (Kind.GET, Kind.PREFETCH)  # answered once the trainer's step allows (sync: applied; ssp: in bounds)


# What a pserver remembers for its stats stays bounded however long the job runs.
CLOCK_LOG_LIMIT = 100_000  # clock and grant events
LOG_LIMIT = 10_000  # lines of its log
STALL_LOG_S = 30.0  # requests waiting this long on a step: the pserver says what for


def _yield_core() -> None:
    """Let another runnable thread of this core run first (a no-op where there is none)."""
    if hasattr(os, "sched_yield"):
        os.sched_yield()


def _pairs(values: list[str]) -> dict[str, int]:
    out = {}
    for item in values:
        name, _, idx = item.rpartition(":")
        out[name] = int(idx)
    return out


class ParameterServer:
    def __init__(self, op: Operator, env: dict[str, Any], host: PserverHost):
        self.env = env
        self.host = host
        self.settings = host.settings
        program = op.block.program
        self.endpoint = op.attr("endpoint")
        self.pserver_id = op.attr("pserver_id")
        self.name = f"pserver {self.pserver_id} ({self.endpoint})"
        self.mode = DISTRIBUTED_MODES[op.attr("distributed_mode")]
        self.fanin = op.attr("Fanin")
        self.staleness = op.attr("staleness")
        self.grad_block = _pairs(op.attr("grad_to_block_id"))
        self.queue_block = _pairs(op.attr("grad_to_queue_block_id"))
        self.blocks = {
            i: host.runner_for(program.block(i))
            for i in set(self.grad_block.values()) | set(self.queue_block.values())
        }
        self.joined = JoinedBlocks(program, self.blocks, host.runner_for)  # a message's blocks, run as one
        lr = op.attr("lr_decay_block_id")
        self.lr_block = host.runner_for(program.block(lr)) if lr >= 0 else None
        self.declared = set(program.global_block().vars)
        self.grad_specs = {g: GradientSpec.of(program.global_block().vars.get(g)) for g in self.grad_block}
        self.served = {n for n, v in program.global_block().vars.items() if v.persistable}
        if self.settings.max_message_bytes is None:  # else set by hand: it wins
            limit = message_limit(program.global_block().vars, self.served | set(self.grad_block))
            self.settings = self.settings.with_(max_message_bytes=limit)
        self.tables = set(op.attr("distributed_tables"))  # whose rows trainers PREFETCH
        unserved = sorted(self.tables - self.served)
        if unserved:
            raise ExecutionError(
                f"{self.name}: distributed tables {unserved} are not persistable variables here"
            )
        self.members = Membership(
            self.fanin, self.settings.elastic, self.log, expected=self.settings.trainer_incarnations
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
        # Async: SENDs acknowledged once their gradients are applied, and when that is.
        self.unapplied: list[tuple[Request, Callable[[], bool]]] = []
        self._waker: Waker | None = None
        self.log_lines: deque[str] = deque(maxlen=LOG_LIMIT)
        self.last_heard = time.monotonic()
        self.locks = {i: threading.Lock() for i in self.blocks}
        self.lock_of = {name: self.locks[i] for i in self.blocks for name in self.blocks[i].writes}
        self.checkpoints = Checkpointer(op, self.log, host.checkpoints)
        self.strategy = STRATEGIES[self.mode](self)
        # Sync with one trainer: a distributed table's update is held, and the rows its PREFETCH
        # asks for applied first. (With several, the step waits for the last trainer's rows,
        # which need most of the update anyway, and each cut adds work: 0.94-0.98x measured
        # with two trainers on one pserver.)
        splits = self._split_blocks(program) if self.mode == "sync" and self.fanin == 1 else {}
        self.rows_first = RowsFirst(
            env, splits, lambda grads: self.joined.run([self.grad_block[g] for g in grads], env)
        )
        self._stop_reason: str | None = None
        # Set when the loop stops taking requests (it then finishes what it acknowledged).
        self.ended = threading.Event()
        self.server: RpcServer | None = None
        self._started = time.monotonic()
        self._alone_since: float | None = None  # when the last trainer not done was evicted
        self._stall = (0, time.monotonic())  # the progress counted, and since when requests wait on it
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

    def _split_blocks(self, program: Any) -> dict[str, SplitBlock]:
        """The optimize blocks whose distributed table update cuts by rows (rows_first.py)."""
        copies = self.strategy.copies
        splits = {
            g: split_block(program.block(i), self.tables, copies[g]) for g, i in self.grad_block.items()
        }
        return {g: split for g, split in splits.items() if split is not None}

    def log(self, message: str) -> None:
        self.log_lines.append(message)
        print(f"{self.name}: {message}", flush=True)

    # -- the loop -------------------------------------------------------------------------

    def serve(self) -> None:
        context = self.host.context_for(self.endpoint)
        self.server = RpcServer(context, self.endpoint, self.name, self.settings, self.host.profile)
        self._waker = Waker(context)
        previous_handler = self._catch_sigterm()
        try:
            restored = self.checkpoints.restore(self.env, self.pserver_id)
            if restored is not None:
                self.strategy.restore(restored)
            self.strategy.start()
            while not self.members.done and self._stop_reason is None:
                self._handle_all(self.server.receive(0.05, wake=self._waker.socket))
                self._check_trainers()
                self.claims.retry(self._handle)
                self._check_rejoin()
                self._answer_deferred()
                self._report_stall()
                self._maybe_checkpoint()
                self._finish_held()
                failure = self.strategy.failure
                if failure is not None:
                    raise ExecutionError(f"{self.name}: an optimize block failed: {failure}") from failure
                if self.members.active and time.monotonic() - self.last_heard > IDLE_TIMEOUT:
                    raise TransportError(
                        f"{self.name}: no message for {IDLE_TIMEOUT:.0f} s from trainers {sorted(self.members.active)}"
                    )
            self._apply_held()
            self.ended.set()
            self.strategy.stop()  # every acknowledged gradient applied before the last checkpoint
            if self.checkpoints.enabled and self.checkpoints.changed_since_last(self.strategy.steps):
                self._checkpoint(self._stop_reason or "end")
        finally:
            self.ended.set()
            self.strategy.stop()
            self.server.close()
            self._waker.close()
            if previous_handler is not None:
                signal.signal(signal.SIGTERM, previous_handler)
        if self._stop_reason == "SIGTERM" and previous_handler is not None:
            os.kill(os.getpid(), signal.SIGTERM)  # die of it, as the sender expects, now that it is saved

    def _finish_held(self) -> None:
        """Once a PREFETCH has had its rows of a held table update (rows_first.py), apply the
        rest, after the requests already waiting: the trainer computes meanwhile. Until a
        PREFETCH comes the update stays held (the next step's rows are applied first);
        anything else that reads the tables applies it first."""
        if self.rows_first.pending and self.rows_first.asked:
            # The answer just went to ZeroMQ's I/O thread, which often waits for this
            # thread's core: let it send before the rest's update takes the core.
            _yield_core()
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
        """Say what the job waits for when requests have waited on a step for STALL_LOG_S
        (again every STALL_LOG_S while it lasts): which trainers, in which state."""
        now = time.monotonic()
        if not self.deferred or self.strategy.progress != self._stall[0]:
            self._stall = (self.strategy.progress, now)
            return
        if now - self._stall[1] < STALL_LOG_S:
            return
        self._stall = (self.strategy.progress, now)
        waiting = sorted({(r.msg.trainer_id, r.msg.kind_name) for r in self.deferred})
        states = {t: m.state for t, m in self.members.members.items()}
        self.log(
            f"no step done for {STALL_LOG_S:.0f} s with requests waiting {waiting}: "
            f"{self.strategy.describe_wait()}; trainers {states}"
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

    def _catch_sigterm(self) -> Any:
        """In a process's main thread with checkpoints on, SIGTERM saves one before dying."""
        if not self.checkpoints.enabled or threading.current_thread() is not threading.main_thread():
            return None

        def on_sigterm(signum: int, frame: object) -> None:
            self._stop_reason = "SIGTERM"

        previous = signal.signal(signal.SIGTERM, on_sigterm)
        return signal.SIG_DFL if previous in (None, signal.SIG_IGN) else previous

    def stats(self, compact: bool = False) -> dict[str, Any]:
        """Counters, clocks and logs, as a snapshot (fluidps.executor.ps.pserver_stats)."""
        return pserver_stats.snapshot(self, compact)

    # -- requests ---------------------------------------------------------------------------

    def _handle_all(self, requests: list[Request]) -> None:
        for request in requests:
            self.last_heard = time.monotonic()
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
            if msg.trainer_id not in range(self.fanin):
                self.server.error(
                    request, f"{self.name} serves trainers 0..{self.fanin - 1}, not {msg.trainer_id}"
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
        unknown = [g for g in msg.tensors if g not in self.grad_block]
        if unknown:
            self.server.error(request, f"{self.name} owns no gradient named {', '.join(map(repr, unknown))}")
            return
        self._check_gettable(msg.names)
        wrong = [p for g, v in msg.tensors.items() if (p := self.grad_specs[g].problem(g, v)) is not None]
        if wrong:  # refused whole: nothing of it is stored or applied, and the step waits
            self.log(f"refused trainer {msg.trainer_id}'s SEND of its step {msg.step}: {'; '.join(wrong)}")
            self.server.error(request, f"{self.name} refused gradients: {'; '.join(wrong)}")
            return
        for grad, value in msg.tensors.items():
            if isinstance(value, SelectedRows):
                self.received_rows.setdefault(grad, RowLog()).add(value.rows)
        if (silence := self.server.clock((msg.trainer_id, msg.sender))) is not None:
            silence.warm = True  # it sent a step: its kernels are compiled
        applied = self.strategy.on_gradients(msg.trainer_id, msg.step, msg.tensors)
        if applied is not None and not applied():
            self.unapplied.append((request, applied))  # (async: no barrier rides on it)
            return
        if msg.names:
            if msg.barrier:
                self.strategy.on_barrier(msg.trainer_id, msg.step)
            self._pull(request)
            return
        self.server.reply(request)
        if msg.barrier:
            self.strategy.on_barrier(msg.trainer_id, msg.step)

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
        """Evict (elastic) or fail on trainers silent for longer than their allowance: the
        peer timeout, stretched by how far apart their messages came lately, or the
        warm-up timeout until their first step is sent (paused trainers count too: one
        waiting for a task keeps sending heartbeats)."""
        now = time.monotonic()
        for trainer in sorted(self.members.active):
            member = self.members.members[trainer]
            silence = self.server.clock((trainer, member.sender)) if member.sender else None
            if silence is None:  # not heard from yet: it may still be importing and transpiling
                silent, allowed = (
                    now - self._started,
                    max(self.settings.warmup_timeout, self.settings.peer_timeout),
                )
            else:
                silent, allowed = silence.silent_for(now), silence.allowance()
                if (report := silence.stretch_report()) is not None:
                    self.log(f"trainer {trainer}: {report}")
            if silent <= allowed:
                continue
            why = f"not heard from for {silent:.1f} s, allowed {allowed:.1f} s (it is down, hung or cut off)"
            self.members.lose(trainer, why)
            self.server.untrack((trainer, member.sender))
            if not self.members.elastic:
                error = f"{self.name}: trainer {trainer} was {why}; the job cannot go on without it"
                for waiting in self.deferred:
                    self.server.error(waiting, error)
                self.deferred = []
                raise TransportError(error)
            self._forget(trainer)
            self.strategy.on_members_changed()

    def _check_rejoin(self) -> None:
        """With every trainer not done evicted, wait for one to come back, up to the rejoin
        timeout; then save what was learned and give the job up, saying why."""
        if self.members.active or not self.members.lost:
            if self._alone_since is not None:
                self._alone_since = None
                self.log(f"trainers {sorted(self.members.active)} are back; the job goes on")
            return
        now, waiting = time.monotonic(), sorted(self.members.lost)
        if self._alone_since is None:
            self._alone_since = now
            self.log(
                f"every trainer not done was evicted ({', '.join(map(str, waiting))}); waiting up to "
                f"{self.settings.rejoin_timeout:g} s for one to rejoin, keeping the parameters and checkpointing"
            )
        elif now - self._alone_since > self.settings.rejoin_timeout:
            if self.checkpoints.enabled:
                self._checkpoint("abandoned")
            raise TransportError(
                f"{self.name}: no evicted trainer ({', '.join(map(str, waiting))}) came back within "
                f"{self.settings.rejoin_timeout:g} s (RpcSettings.rejoin_timeout); the job is given up"
                + (" after a last checkpoint" if self.checkpoints.enabled else "")
            )

    # -- parameters -----------------------------------------------------------------------

    def _on_get(self, request: Request) -> None:
        self._check_gettable(request.msg.names)
        self._pull(request)

    def _check_gettable(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.served or n not in self.env]
        if unknown:
            raise ExecutionError(f"holds no variable {', '.join(map(repr, unknown))}")
        hashed = [n for n in names if isinstance(self.env[n], SparseTable)]
        if hashed:
            raise ExecutionError(f"hashed table {hashed[0]!r} is read by id (PREFETCH), never whole")

    def _on_prefetch(self, request: Request) -> None:
        """Rows of distributed tables: each tensor names a table block here and holds
        int64 row indices into it; checked before anything is read."""
        for name, rows in request.msg.tensors.items():
            if name not in self.tables:
                held = ", ".join(sorted(self.tables)) or "none"
                raise ExecutionError(
                    f"holds no distributed table {name!r} (its tables: {held}); the trainer's program was "
                    "transpiled for another job: transpile trainers and pservers together"
                )
            if isinstance(rows, SelectedRows) or rows.dtype != np.int64 or rows.ndim != 1:
                raise ExecutionError(f"a prefetch of {name!r} must carry 1-D int64 row indices")
            table = self.env[name]
            if isinstance(table, SparseTable):
                table.check_ids(rows, f"a prefetch of {name!r}")  # ids >= 0 that this shard owns
                continue
            height = np.shape(table)[0]
            if rows.size and (rows.min() < 0 or rows.max() >= height):
                bad = int(rows[np.flatnonzero((rows < 0) | (rows >= height))[0]])
                raise ExecutionError(f"row {bad} asked of table block {name!r} is outside its {height} rows")
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
            values = {name: self.strategy.read_rows(name, rows) for name, rows in msg.tensors.items()}
        else:
            if self.rows_first.holds(msg.names):
                self._apply_held()
            values = {name: self.strategy.read(name) for name in msg.names}
            if msg.trainer_id >= 0:
                self.strategy.answered(msg.trainer_id)
        self.server.reply(request, Message(Kind.VALUES, tensors=values, step=self.strategy.steps))

    def _answer_deferred(self) -> None:
        sends, self.unapplied = self.unapplied, []
        for request, applied in sends:
            if not applied():
                self.unapplied.append((request, applied))
            elif request.msg.names:
                self._pull(request)
            else:
                self.server.reply(request)
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
        # A value that came over TCP is this process's own memory (its frame): the pserver
        # keeps it as it is. An inproc frame may be the sender's array itself: copied.
        own = not self.server.address.startswith("inproc://")
        for name, value in request.msg.tensors.items():
            if isinstance(value, SelectedRows):  # (its frames are read-only views)
                value = SelectedRows(np.array(value.rows), np.array(value.value), value.height)
            elif not (own and value.flags.writeable and value.flags.aligned):
                value = np.array(value, copy=True)
            with self.locked(name):
                self.env[name] = value
        self.server.reply(request)

    def locked(self, name: str) -> contextlib.AbstractContextManager:
        """Hold the lock of the optimize block that writes `name` (if one does)."""
        lock = self.lock_of.get(name)
        return lock if lock is not None else contextlib.nullcontext()

    # -- checkpoints ------------------------------------------------------------------------

    def _maybe_checkpoint(self) -> None:
        if self.checkpoints.due(self.strategy.steps):
            self._checkpoint("periodic")

    def _checkpoint(self, reason: str, delta: bool | None = None) -> ckpt.Checkpoint:
        """Save a checkpoint; `delta`: of hashed tables' changes since the last base (None:
        as the checkpoint schedule says)."""
        self._apply_held()
        since = self.checkpoints.delta_since(delta) or {}
        values = {}
        for name in self.checkpoints.placements:
            with self.locked(name):
                value = self.env[name]
                values[name] = (
                    value.snapshot(since.get(name))
                    if isinstance(value, SparseTable)
                    else np.array(value, copy=True)
                )
        return self.checkpoints.save(values, self.strategy.steps, reason)

    def _on_checkpoint(self, request: Request) -> None:
        kinds = {"": None, "base": False, "delta": True}
        if request.msg.text not in kinds:
            raise CheckpointError(f"a checkpoint is a 'base' or a 'delta', not {request.msg.text!r}")
        saved = self._checkpoint("requested", kinds[request.msg.text])
        text = json.dumps(ckpt.describe(saved) | {"path": str(saved.path)})
        self.server.reply(request, Message(Kind.VALUES, text=text))
