"""A trainer's side of a job: its connections to the pservers and its exchanges with them.

The kernels of send / recv / the barriers call it (as fluidps.ops.runtime_api's
TrainerChannel). A step costs each pserver as few round trips as the program allows:

- Gradients are held per pserver until `bucket_bytes` of them are held (then they go,
  without waiting, while backward goes on), or until the step's next exchange with
  that pserver, which they ride along with.
- The send barrier is not a message of its own: it rides on the step's last message
  to each pserver, normally the GET of the parameters. So a sync step's last gradients,
  its barrier and its GET are one SEND (barrier, names), answered with the parameters
  once the step is applied: one round trip. The fetch barrier sends nothing (a
  pserver needs no word that a trainer has its values); it only flushes what is held.
- What was sent without waiting is acknowledged with the next exchange that waits
  (a pserver handles one trainer's messages in order, so that exchange sees it); an
  error in it surfaces there. Held messages go at the end of a step at the latest.
- Distributed tables cost no round trip of their own when the next step's feed is
  known (Executor.run(next_feed=...), exe.run_batches, an executor server with the
  next RUN queued): in sync mode, right behind the message carrying a step's barrier
  goes a PREFETCH of the rows the next step's batch will look up. A pserver answers it
  once the step is applied, as it answers the GET, so the rows are those a prefetch at
  the start of the next step would read (nothing changes them until this trainer sends
  again); that prefetch, asking for exactly those rows, takes them without a message.

It also keeps what async mode keeps between steps (the gradients summed for
`send_interval`, the values pulled for `recv_interval`), so that preparing the
program again does not reset them, starts the trainer's keepalive, and, for async
send ops that ask for it, the trainer's communicator (fluidps.executor.ps.communicator):
their gradients are queued and sent from its thread, and their recv takes the values it
last pulled in the background.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from fluidps.errors import TransportError
from fluidps.executor.ps.applied_batches import Delivered, parse_ack, tag_window
from fluidps.executor.ps.communicator import Communicator
from fluidps.executor.ps.gradients import GradientSum
from fluidps.executor.ps.keepalive import Keepalive
from fluidps.executor.transport.rpc import RpcClient, wait_all
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ops.runtime_api import Communicate, Prefetch, Pull, Push
from fluidps.ops.selected_rows import SelectedRows
from fluidps.profiling import Profile

# What a kernel gives prefetch_next: the rows to ask for, from the next step's feed.
PrefetchPlan = Callable[[Mapping[str, Any]], Sequence[Prefetch] | None]


@dataclass
class _Ahead:
    """A PREFETCH sent behind a step's barrier, for the prefetches of the step after it
    (one per lookup op: each takes its table blocks' rows from the one answer)."""

    step: int  # the step whose prefetches it serves
    client: RpcClient
    rid: int
    rows: dict[str, np.ndarray]  # table block -> the row indices asked for, not taken yet
    reply: Message | None = None  # once waited for

    def serves(self, step: int, asked: dict[str, Any]) -> bool:
        """Whether it holds exactly the rows of `asked` (table block -> row indices) for `step`."""
        return step == self.step and all(
            name in self.rows and np.array_equal(self.rows[name], rows) for name, rows in asked.items()
        )


class TrainerClient:
    def __init__(
        self,
        settings: RpcSettings,
        sender: int,
        context_for: Callable[[str], zmq.Context],
        profile: Profile | None = None,
        replaces: int = 0,
        batch_tag: Callable[[], str | None] | None = None,
    ):
        self.settings = settings
        self.profile = profile
        # Which stream batch this step trains on (fluidps.executor.ps.applied_batches), when a
        # stream reader gave it: its SENDs say so, and a pserver applies each batch's gradients once.
        self._batch_tag = batch_tag
        # Windows (applied_batches.window_key) whose batches' gradients were pushed without
        # naming them (merged over steps, or queued for the communicator) since the last
        # deliver_all: those are applied at least once.
        self._untagged_windows: set[str] = set()
        # Per pserver keeping books, what its latest acknowledgement said of its checkpoints
        # (applied_batches.parse_ack) since the last deliver_all: reported with a window.
        self._acked: dict[int, list] = {}
        self.sender = sender  # this process's incarnation: pservers tell a restarted trainer by it
        self.replaces = replaces  # the incarnation of this trainer id it replaces, if its launcher said
        self._context_for = context_for
        self.step = 0
        self.trainer_id = 0  # learnt from the first pserver client a trainer program opens
        self._clients: dict[str, RpcClient] = {}
        self._keepalive: Keepalive | None = None
        self._unsettled: list[tuple[RpcClient, int]] = []  # requests sent without waiting
        self._held: dict[str, Message] = {}  # per pserver: gradients (and the barrier) not sent yet
        # async send_interval: gradients not yet sent, and whether they go by the communicator
        self._sums: dict[tuple, tuple[GradientSum, Communicate | None]] = {}
        self._communicator: Communicator | None = None
        self._barrier_endpoints: tuple[str, ...] = ()  # sync: the pservers a step's barrier goes to
        self._paused = False  # told the pservers it pauses, and sent nothing since
        self._steps_seen: dict[str, int] = {}  # per pserver: its steps done at this trainer's last idle round
        # The last values pulled by each recv: async recv_interval and the communicator reuse them
        self._downloaded: dict[tuple, list[Any]] = {}
        # Rows of the next step's batch, asked for behind this step's barrier (see the module doc)
        self._next_feed: Callable[[], Mapping[str, Any] | None] | None = None
        self._plans: list[PrefetchPlan] = []
        self._ahead: dict[str, _Ahead] = {}
        # Prefetches (one per pserver) served by rows asked for ahead, and sent as messages
        self.prefetches = {"served_ahead": 0, "sent": 0}

    def client(self, endpoint: str, trainer_id: int = -1) -> RpcClient:
        if endpoint not in self._clients:
            self._clients[endpoint] = RpcClient(
                self._context_for(endpoint),
                endpoint,
                f"pserver {endpoint}",
                self.settings,
                trainer_id,
                self.sender,
                self.profile,
                self.replaces,
            )
            if trainer_id >= 0:
                self.trainer_id = trainer_id
                if self._keepalive is None:
                    self._keepalive = Keepalive(self.settings, trainer_id, self.sender, self._context_for)
                self._keepalive.add(endpoint)
        return self._clients[endpoint]

    def begin_step(self, next_feed: Callable[[], Mapping[str, Any] | None] | None = None) -> None:
        """A step starts: what the last one sent without waiting is acknowledged first, so
        that at most a step's worth of messages is ever unacknowledged. `next_feed` gives
        the feed of the step after this one, when asked (None: not known yet)."""
        self.settle()
        self.step += 1
        self._paused = False  # what this step sends resumes it
        self._next_feed, self._plans = next_feed, []
        for endpoint in [ep for ep, a in self._ahead.items() if a.step < self.step]:
            self._drop_ahead(endpoint)  # asked for a step that did not look them up

    def end_step(self) -> None:
        """The step's program is done: what it still holds goes now (not waited for)."""
        self._flush()

    # -- what the kernels call ----------------------------------------------------------------

    def send(
        self,
        items: Sequence[Push],
        trainer_id: int,
        every: int = 1,
        bucket_bytes: int = 0,
        communicate: Communicate | None = None,
    ) -> None:
        """Push (endpoint, name, value) gradients without waiting. They are held per pserver
        until `bucket_bytes` are (0: none are held), or until the step's next exchange with
        that pserver; or, to `communicate`, queued for the communicator's thread. With
        every=n, the mean of the gradients of n calls is pushed at every n-th call."""
        batch = self._batch_tag() if self._batch_tag is not None else None
        # (gradients of several steps merged into one push, or queued for the communicator,
        # name no single batch: untagged, they are applied at least once)
        tag = batch if every == 1 and communicate is None else None
        if batch is not None and tag is None:
            self._untagged_windows.add(tag_window(batch))
        if every > 1:
            key = tuple((endpoint, name) for endpoint, name, _ in items)
            total, _ = self._sums.setdefault(key, (GradientSum(trainer_id, key), communicate))
            total.add([value for *_, value in items])
            if total.count < every:
                return
            items = total.take_mean()
        self._deliver(items, trainer_id, bucket_bytes, communicate, tag)

    def _deliver(
        self,
        items: Sequence[Push],
        trainer_id: int,
        bucket_bytes: int,
        communicate: Communicate | None,
        tag: str | None = None,
    ) -> None:
        if communicate is None:
            self._push(items, trainer_id, bucket_bytes, tag)
        else:
            self._communicator_for(trainer_id, communicate).put(items, self.step, communicate.merge)

    def _communicator_for(self, trainer_id: int, communicate: Communicate) -> Communicator:
        """The communicator, started by the first send that asks for it (its queue bounds
        and merge size are that send op's: a transpiler gives every send op the same)."""
        if self._communicator is None:
            self._communicator = Communicator(
                self.settings,
                trainer_id,
                self.sender,
                self._context_for,
                replaces=self.replaces,
                queue_size=communicate.queue_size,
                max_merge=communicate.max_merge,
                log_after=self.settings.send_queue_log_after,
                profile=self.profile,
            )
        return self._communicator

    def _push(
        self, items: Sequence[Push], trainer_id: int, bucket_bytes: int = 0, tag: str | None = None
    ) -> None:
        for endpoint, name, value in items:
            msg = self._hold(endpoint, trainer_id)
            if tag is not None:
                msg.text = tag
            if name in msg.tensors:
                raise TransportError(f"gradient {name!r} sent twice to pserver {endpoint} in one step")
            msg.tensors[name] = value
        full = [
            ep for ep, msg in self._held.items() if sum(map(_nbytes, msg.tensors.values())) >= bucket_bytes
        ]
        self._flush(full)

    def get(
        self, items: Sequence[Pull], trainer_id: int, every: int = 1, background: bool = False
    ) -> list[Any]:
        """Pull (endpoint, name) values after this trainer's current step; with every=m,
        only at steps that are multiples of m (and the first time), the last ones otherwise.
        To a pserver holding gradients or a barrier of this step, the GET rides on them.
        In the `background` (a communicator is running): the values of the last pull the
        communicator finished, asking it for a new one every m steps; only the first pull
        is waited for. A pull waited for comes after what the communicator holds is sent
        and applied."""
        key = tuple(items)
        if background and key in self._downloaded and self._communicator is not None:
            if self.step % every == 0:
                self._communicator.ask_pull(key, items)
            latest = self._communicator.pulled(key)
            if latest is not None:
                self._downloaded[key] = latest
            return self._downloaded[key]
        if every > 1 and key in self._downloaded and self.step % every:
            return self._downloaded[key]
        if self._communicator is not None and not background:
            self._communicator.drain()  # a pull waited for sees this trainer's gradients applied
        values = self._pull(items, trainer_id)
        self._downloaded[key] = values  # (the trainer program's recv starts from its startup's)
        return values

    def prefetch(self, items: Sequence[Prefetch], trainer_id: int) -> list[np.ndarray]:
        """The rows (endpoint, table block, row indices) asked for: one PREFETCH per pserver,
        waited for; or, from a pserver asked for exactly these rows behind the last
        step's barrier, its answer to that. Each reply must hold every row asked for."""
        requests: dict[str, Message] = {}
        for endpoint, name, rows in items:
            msg = requests.setdefault(endpoint, Message(Kind.PREFETCH, trainer_id=trainer_id, step=self.step))
            if name in msg.tensors:
                raise TransportError(f"rows of {name!r} asked twice from pserver {endpoint} in one prefetch")
            msg.tensors[name] = rows
        served = {}
        for endpoint in [ep for ep in requests if ep in self._ahead]:
            if self._ahead[endpoint].serves(self.step, requests[endpoint].tensors):
                served[endpoint] = (self._ahead[endpoint], list(requests.pop(endpoint).tensors))
            else:
                self._drop_ahead(endpoint)
        self.prefetches["served_ahead"] += len(served)
        self.prefetches["sent"] += len(requests)
        self._flush([ep for ep in requests if ep in self._held])  # ahead of the prefetch, in order
        replies = self._exchange(requests, trainer_id, wait=True) if requests else {}
        unanswered = {ep: (a.client, a.rid) for ep, (a, _) in served.items() if a.reply is None}
        try:
            for endpoint, reply in wait_all(unanswered).items():
                served[endpoint][0].reply = reply
        except TransportError:
            for endpoint in unanswered:  # given up on (wait_all forgot them): nothing waits for them again
                del self._ahead[endpoint]
            raise
        for endpoint, (ahead, taken) in served.items():
            replies[endpoint] = ahead.reply
            for name in taken:
                del ahead.rows[name]
            if not ahead.rows:
                del self._ahead[endpoint]
        out = []
        for endpoint, name, rows in items:
            value = replies[endpoint].tensors.get(name)
            if not isinstance(value, np.ndarray) or value.ndim != 2 or value.shape[0] != len(rows):
                got = "nothing" if value is None else f"{type(value).__name__} {list(np.shape(value))}"
                raise TransportError(
                    f"pserver {endpoint} answered a prefetch of {len(rows)} rows of {name!r} with {got}; "
                    "its program does not serve this table as this trainer's does (transpile them together)"
                )
            out.append(value)
        return out

    def prefetch_next(self, plan: PrefetchPlan) -> None:
        """Sync mode: behind this step's barrier, ask for the rows `plan(next feed)` names
        (see the module doc); not asked when the next feed is not known by then."""
        self._plans.append(plan)

    def send_barrier(self, endpoints: Sequence[str], trainer_id: int) -> None:
        """This step's gradients are all sent: the barrier rides on the step's next message
        to each pserver (its GET), which is answered once the step is applied."""
        self._barrier_endpoints = tuple(endpoints)
        for endpoint in endpoints:
            self._hold(endpoint, trainer_id).barrier = True

    def in_sync_job(self, endpoints: Sequence[str], trainer_id: int) -> None:
        """A sync program is about to run: from now on this trainer idles in lockstep
        (idle_round), even before its first step sends a barrier."""
        for endpoint in endpoints:
            self.client(endpoint, trainer_id)
        self._barrier_endpoints = tuple(endpoints)

    def fetch_barrier(self, endpoints: Sequence[str], trainer_id: int) -> None:
        """Nothing to tell: what is still held goes now, not waited for. Every pserver of
        the job is known from here on (a trainer's startup ends with this barrier), so
        that each is told when this trainer is done, even one it never sent a message."""
        for endpoint in endpoints:
            self.client(endpoint, trainer_id)
        self._flush()

    # -- what an executor server and readers call ---------------------------------------------

    def skip_step(self) -> None:
        """Take part in a step without gradients (this trainer had no batch), so that no
        pserver waits for it: in sync mode its barrier arrives and the step goes on with
        the others' gradients; otherwise an empty SEND moves its clock (SSP) with theirs."""
        if self._barrier_endpoints:
            self.begin_step()  # a step of its own: its barrier is numbered after the last one
            self.send_barrier(self._barrier_endpoints, self.trainer_id)
            self._flush()
        else:
            self._to_all(Kind.SEND, list(self._clients), self.trainer_id)

    def pause(self) -> None:
        """Tell every pserver this trainer has no data for now: until it sends again, no
        barrier or SSP bound waits for it (its next step resumes it). What the
        communicator holds goes first. Said once until the next step."""
        if self._paused:
            return
        if self._communicator is not None:
            self._communicator.drain()
        self._to_all(Kind.PAUSE, list(self._clients), self.trainer_id)
        self._paused = True

    @property
    def in_lockstep(self) -> bool:
        """Sync mode (its program sends barriers): a trainer waiting for data keeps
        taking part in rounds (idle_round) rather than pausing."""
        return bool(self._barrier_endpoints)

    def idle_round(self) -> bool:
        """Sync mode, no batch for now: take part in the next round with a barrier and
        no gradients, waited for until the round is done. Returns whether another
        trainer trained meanwhile (some pserver's step count moved), so the caller
        knows whether to look for work again at once or to wait a little.

        Pausing instead would change who a pserver waits for, and pservers learn of it
        at different moments: one could count a round without this trainer while
        another waits for it, pairing different barriers into their rounds, which can
        deadlock two trainers. Rounds in lockstep keep every pserver's pairing equal."""
        self.begin_step()
        requests = {
            ep: Message(Kind.SEND_BARRIER, trainer_id=self.trainer_id, step=self.step)
            for ep in self._barrier_endpoints
        }
        replies = self._exchange(requests, self.trainer_id, wait=True)
        moved = False
        for endpoint, reply in replies.items():
            moved |= self._steps_seen.get(endpoint) != reply.step  # (the first round: unknown, moved)
            self._steps_seen[endpoint] = reply.step
        return moved

    def settle(self) -> None:
        """Send what is held, and wait for the acknowledgements of what was sent without waiting."""
        self._flush()
        pending, self._unsettled = self._unsettled, []
        self._note_acks(wait_all(dict(enumerate(pending))).values())

    # -- inside --------------------------------------------------------------------------------

    def _hold(self, endpoint: str, trainer_id: int) -> Message:
        """The message of this step held for `endpoint`: a SEND, gradients and barrier to come."""
        if endpoint not in self._held:
            self._held[endpoint] = Message(Kind.SEND, trainer_id=trainer_id, step=self.step)
        return self._held[endpoint]

    def _flush(self, endpoints: Sequence[str] | None = None) -> None:
        """Send what is held for `endpoints` (None: for every pserver), not waited for."""
        endpoints = list(self._held) if endpoints is None else endpoints
        requests = {ep: self._held.pop(ep) for ep in endpoints}
        if requests:
            self._exchange(requests, next(iter(requests.values())).trainer_id, wait=False)

    def _exchange(self, requests: dict[str, Message], trainer_id: int, wait: bool) -> dict[str, Message]:
        """Send `requests` (one per pserver); with `wait`, what was held for other pservers
        goes too, and the replies come back once those and every earlier request are in."""
        if wait:
            self._flush([ep for ep in self._held if ep not in requests])
        issued = {}
        for endpoint, msg in requests.items():
            client = self.client(endpoint, trainer_id)
            issued[endpoint] = (client, client.request(msg))
        if self._plans and any(msg.barrier for msg in requests.values()):
            # Asked now, while the pservers apply the step: each is answered right after the GET.
            self._ask_ahead([ep for ep, msg in requests.items() if msg.barrier], trainer_id)
        if not wait:
            self._unsettled += issued.values()
            return {}
        settle = {("earlier", i): pending for i, pending in enumerate(self._unsettled)}
        self._unsettled = []
        replies = wait_all({**settle, **issued})
        self._note_acks(replies.values())
        return {endpoint: replies[endpoint] for endpoint in issued}

    def _note_acks(self, replies: Iterable[Message]) -> None:
        for reply in replies:
            if (ack := parse_ack(reply.text)) is not None:
                self._acked[ack[0]] = ack[1]

    def _pull(self, items: Sequence[Pull], trainer_id: int) -> list[Any]:
        requests: dict[str, Message] = {}
        for endpoint, name in items:
            if endpoint not in requests:
                # What is held for this pserver (gradients, the barrier) carries the GET.
                held = self._held.pop(endpoint, None)
                requests[endpoint] = held or Message(Kind.GET, trainer_id=trainer_id, step=self.step)
            requests[endpoint].names.append(name)
        replies = self._exchange(requests, trainer_id, wait=True)
        out = []
        for endpoint, name in items:
            tensors = replies[endpoint].tensors
            if name not in tensors:
                raise TransportError(f"pserver {endpoint} did not return {name!r}")
            out.append(tensors[name])
        return out

    def _ask_ahead(self, endpoints: list[str], trainer_id: int) -> None:
        """Send the PREFETCH of the next step's rows to each of `endpoints` that owns some
        (they were just sent this step's barrier). Once a step: the plans are spent."""
        plans, self._plans = self._plans, []
        feed = self._next_feed() if self._next_feed is not None else None
        if not feed:
            return
        wanted: dict[str, dict[str, np.ndarray]] = {}
        clashes = set()  # two lookups of one table block (not asked ahead: one of them would miss)
        for plan in plans:
            for endpoint, name, rows in plan(feed) or ():
                asked = wanted.setdefault(endpoint, {})
                if name in asked:
                    clashes.add(endpoint)
                asked[name] = rows
        for endpoint in endpoints:
            if wanted.get(endpoint) and endpoint not in clashes:
                self._drop_ahead(endpoint)
                msg = Message(Kind.PREFETCH, trainer_id=trainer_id, step=self.step, tensors=wanted[endpoint])
                client = self.client(endpoint, trainer_id)
                self._ahead[endpoint] = _Ahead(self.step + 1, client, client.request(msg), wanted[endpoint])

    def _drop_ahead(self, endpoint: str) -> None:
        """Rows asked for ahead that no prefetch will take: an answer not received yet is
        still waited for (with the next exchange that waits), so that an error in it surfaces."""
        ahead = self._ahead.pop(endpoint, None)
        if ahead is not None and ahead.reply is None:
            self._unsettled.append((ahead.client, ahead.rid))

    def _to_all(self, kind: int, endpoints: Sequence[str], trainer_id: int, wait: bool = True) -> None:
        """One message of `kind` (no tensors) to each pserver of `endpoints`."""
        requests = {ep: Message(kind, trainer_id=trainer_id, step=self.step) for ep in endpoints}
        self._exchange(requests, trainer_id, wait=wait)

    # -- ending --------------------------------------------------------------------------------

    def flush(self) -> list[str]:
        """Upload the gradients summed since the last send_interval upload; the problems met."""
        problems = []
        for total, communicate in self._sums.values():  # the steps since the last upload count too
            if total.count:
                try:
                    self._deliver(total.take_mean(), total.trainer_id, 0, communicate)
                except TransportError as e:
                    problems.append(f"the last {total.count} step(s) of gradients were not sent: {e}")
        self._sums.clear()
        return problems

    def deliver_all(self) -> Delivered:
        """Everything this trainer computed at the pservers, acknowledged: the gradients
        summed for send_interval, what the communicator holds, every SEND in flight (a
        stream's window counts as done only after this). Returns, since the last call,
        the windows whose batches' gradients were pushed without naming them (applied at
        least once, not exactly once) and what the pservers' acknowledgements said of
        their checkpoints."""
        problems = self.flush()
        if problems:
            raise TransportError("; ".join(problems))
        if self._communicator is not None:
            self._communicator.drain()
            self._acked.update(self._communicator.take_acks())
        self.settle()
        delivered = Delivered(frozenset(self._untagged_windows), dict(self._acked))
        self._untagged_windows, self._acked = set(), {}
        return delivered

    def close(self, leaving: bool = False) -> list[str]:
        """Tell every pserver this trainer is done (or, `leaving` an elastic job before the
        end of its data, that it pauses: a restarted process takes its place), close the
        sockets. Returns the problems met (a pserver already gone). What the
        communicator holds is sent first."""
        problems = []
        if self._communicator is not None:
            problems += self._communicator.close()
            self._communicator = None
        for endpoint in list(self._ahead):  # rows no step will look up: their answers are waited for too
            self._drop_ahead(endpoint)
        try:
            self.settle()
        except TransportError as e:
            problems.append(str(e))
        asked = {}
        for endpoint, client in self._clients.items():
            if client.lost:  # known dead: do not wait for it a second time
                problems.append(f"{endpoint}: not told this trainer is done; it stopped answering earlier")
            else:
                asked[endpoint] = client.request(Message(Kind.PAUSE if leaving else Kind.COMPLETE))
        for endpoint, rid in asked.items():
            try:
                self._clients[endpoint].wait(rid, timeout=self.settings.peer_timeout)
            except TransportError as e:
                problems.append(f"{endpoint}: {e}")
        for client in self._clients.values():
            client.close()
        self._held.clear()
        self._clients.clear()
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        return problems


def _nbytes(value: Any) -> int:
    if isinstance(value, SelectedRows):
        return value.rows.nbytes + value.value.nbytes
    return int(getattr(value, "nbytes", 0))
