"""Runtime: what a process needs to take part in a distributed job.

An Executor owns one (created when a program first uses a communication
op) and puts it in the environment under RUNTIME_KEY, where the kernels of
send / recv / barriers / listen_and_serv / enqueue / dequeue find it. It
holds the ZeroMQ context, one client per pserver, the trainer's step count
and the pserver's gradient queues. Nothing here is global: two Executors in
one process are two independent participants (tests run whole jobs so).
"""

from __future__ import annotations

import math
import os
import secrets
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from fluidps.errors import Error, TransportError
from fluidps.executor.ps.gradients import GradientSum
from fluidps.executor.ps.keepalive import Keepalive
from fluidps.executor.tasks.coordinator import CoordinatorClient
from fluidps.executor.tasks.task_reader import TaskReader
from fluidps.executor.transport.rpc import RpcClient, RpcSettings, wait_all, zmq_address
from fluidps.executor.transport.security import Security
from fluidps.executor.transport.wire import Kind, Message
from fluidps.ops.reader import ReaderSpec


def settings_from_env(environ: dict[str, str] | None = None) -> RpcSettings:
    """RpcSettings from FLUIDPS_PEER_TIMEOUT, FLUIDPS_REQUEST_TIMEOUT, FLUIDPS_MAX_MESSAGE_BYTES,
    FLUIDPS_KEYS, FLUIDPS_INSECURE and FLUIDPS_ELASTIC."""
    env = os.environ if environ is None else environ
    settings = RpcSettings()
    if "FLUIDPS_PEER_TIMEOUT" in env:
        settings = settings.with_(peer_timeout=_seconds(env, "FLUIDPS_PEER_TIMEOUT"))
    if "FLUIDPS_REQUEST_TIMEOUT" in env:
        settings = settings.with_(request_timeout=_seconds(env, "FLUIDPS_REQUEST_TIMEOUT"))
    if "FLUIDPS_MAX_MESSAGE_BYTES" in env:
        text = env["FLUIDPS_MAX_MESSAGE_BYTES"]
        if not (text.isascii() and text.isdigit() and 0 < int(text) <= 1 << 40):
            raise TransportError(
                f"FLUIDPS_MAX_MESSAGE_BYTES={text!r} is invalid: it should hold a number of bytes, 1 .. 2**40"
            )
        settings = settings.with_(max_message_bytes=int(text))
    if env.get("FLUIDPS_ELASTIC") == "1":
        settings = settings.with_(elastic=True)
    if env.get("FLUIDPS_KEYS"):
        settings = settings.with_(security=Security.from_dir(env["FLUIDPS_KEYS"]))
    if env.get("FLUIDPS_INSECURE") == "1":
        settings = settings.with_(insecure=True)
    return settings


def _seconds(env: Any, name: str) -> float:
    try:
        value = float(env[name])
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise TransportError(f"{name}={env[name]!r} is invalid: it should hold a positive number of seconds")
    return value


class GradientQueue:
    """A pserver's queue of one gradient (async / SSP modes)."""

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._ready = threading.Condition()

    def put(self, value: Any) -> None:
        with self._ready:
            self._items.append(value)
            self._ready.notify()

    def wait(self, timeout: float) -> bool:
        """True once an item is there (within `timeout` seconds)."""
        with self._ready:
            return self._ready.wait_for(lambda: bool(self._items), timeout)

    def pop(self) -> Any:
        with self._ready:
            if not self._items:
                raise TransportError("dequeue from an empty gradient queue")
            return self._items.popleft()

    def __len__(self) -> int:
        return len(self._items)


class Runtime:
    def __init__(self, settings: RpcSettings | None = None):
        self.settings = settings or settings_from_env()
        # This participant's incarnation: pservers tell a restarted trainer from its old self by it.
        self.sender = secrets.randbits(63) | 1
        self.step = 0
        self._keepalive: Keepalive | None = None
        self.trainer_id = 0  # learnt from the first pserver client a trainer program opens
        # Readers' tasks come from this coordinator; None: from a queue in this process.
        self.coordinator: str | None = os.environ.get("FLUIDPS_COORDINATOR") or None
        # A reader with no task now waits for one, unless a client drives this executor
        # step by step (an executor server): then it says so (NoDataYet) and returns.
        self.wait_for_tasks = True
        self._readers: dict[str, TaskReader] = {}  # by READER variable
        self._context: zmq.Context | None = None
        self._clients: dict[str, RpcClient] = {}
        self._queues: dict[str, GradientQueue] = {}
        self._unsettled: list[tuple[RpcClient, int]] = []  # requests sent without waiting
        self._sums: dict[tuple, GradientSum] = {}  # async send_interval: gradients not yet sent
        self._barrier_endpoints: tuple[str, ...] = ()  # sync: the pservers a step's barrier goes to
        self._downloaded: dict[tuple, list[Any]] = {}  # async recv_interval: the last values pulled
        self.servers: list[Any] = []  # pserver loops this process ran (their stats outlive them)

    @property
    def context(self) -> zmq.Context:
        if self._context is None:
            self._context = zmq.Context(io_threads=2)
        return self._context

    def context_for(self, endpoint: str) -> zmq.Context:
        """The context to open a socket for `endpoint` on. inproc:// addresses only
        reach sockets of the same context, so every participant in a process uses
        pyzmq's process-wide context for them (a whole job in one process)."""
        if zmq_address(endpoint).startswith("inproc://"):
            return zmq.Context.instance()
        return self.context

    def client(self, endpoint: str, trainer_id: int = -1) -> RpcClient:
        if endpoint not in self._clients:
            self._clients[endpoint] = RpcClient(
                self.context_for(endpoint),
                endpoint,
                f"pserver {endpoint}",
                self.settings,
                trainer_id,
                self.sender,
            )
            if trainer_id >= 0:
                self.trainer_id = trainer_id
                if self._keepalive is None:
                    self._keepalive = Keepalive(self.settings, trainer_id, self.sender, self.context_for)
                self._keepalive.add(endpoint)
        return self._clients[endpoint]

    def queue(self, name: str) -> GradientQueue:
        return self._queues.setdefault(name, GradientQueue())

    def begin_step(self) -> None:
        self.step += 1

    # -- trainer side ----------------------------------------------------------------------
    # Each call sends one message per pserver, all at once. Gradients and the fetch
    # barrier are not waited for where they are sent: their acknowledgements are
    # settled with the next call that needs an answer (the send barrier, the recv,
    # close), so that a step costs a round trip per exchange, not per message. A
    # pserver handles one trainer's messages in order, so the GET that follows a
    # SEND sees it; an error in a SEND surfaces at that next call.

    def _exchange(self, requests: dict[str, Message], trainer_id: int, wait: bool) -> dict[str, Message]:
        issued = {}
        for endpoint, msg in requests.items():
            client = self.client(endpoint, trainer_id)
            issued[endpoint] = (client, client.request(msg))
        if not wait:
            self._unsettled += issued.values()
            return {}
        settle = {("earlier", i): pending for i, pending in enumerate(self._unsettled)}
        self._unsettled = []
        replies = wait_all({**settle, **issued})
        return {endpoint: replies[endpoint] for endpoint in issued}

    def send(self, items: Sequence[tuple[str, str, Any]], trainer_id: int, every: int = 1) -> None:
        """Push (endpoint, name, value) gradients, one message per pserver, without
        waiting (at most one step's worth is unacknowledged at a time). With every=n,
        the mean of the gradients of n calls is pushed at every n-th call."""
        if every > 1:
            key = tuple((endpoint, name) for endpoint, name, _ in items)
            total = self._sums.setdefault(key, GradientSum(trainer_id, key))
            total.add([value for *_, value in items])
            if total.count < every:
                return
            items = total.take_mean()
        self._push(items, trainer_id)

    def _push(self, items: Sequence[tuple[str, str, Any]], trainer_id: int) -> None:
        self.settle()
        requests: dict[str, Message] = {}
        for endpoint, name, value in items:
            msg = requests.setdefault(endpoint, Message(Kind.SEND, trainer_id=trainer_id, step=self.step))
            msg.tensors[name] = value
        self._exchange(requests, trainer_id, wait=False)

    def get(self, items: Sequence[tuple[str, str]], trainer_id: int, every: int = 1) -> list[Any]:
        """Pull (endpoint, name) values after this trainer's current step; with every=m,
        only at steps that are multiples of m (and the first time), the last ones otherwise."""
        key = tuple(items)
        if every > 1 and key in self._downloaded and self.step % every:
            return self._downloaded[key]
        values = self._pull(items, trainer_id)
        if every > 1:
            self._downloaded[key] = values
        return values

    def _pull(self, items: Sequence[tuple[str, str]], trainer_id: int) -> list[Any]:
        requests: dict[str, Message] = {}
        for endpoint, name in items:
            msg = requests.setdefault(endpoint, Message(Kind.GET, trainer_id=trainer_id, step=self.step))
            msg.names.append(name)
        replies = self._exchange(requests, trainer_id, wait=True)
        out = []
        for endpoint, name in items:
            tensors = replies[endpoint].tensors
            if name not in tensors:
                raise TransportError(f"pserver {endpoint} did not return {name!r}")
            out.append(tensors[name])
        return out

    def _to_all(self, kind: int, endpoints: Sequence[str], trainer_id: int, wait: bool = True) -> None:
        """One message of `kind` (no tensors) to each pserver of `endpoints`."""
        requests = {ep: Message(kind, trainer_id=trainer_id, step=self.step) for ep in endpoints}
        self._exchange(requests, trainer_id, wait=wait)

    def barrier(self, kind: int, endpoints: Sequence[str], trainer_id: int) -> None:
        """The send barrier waits (for it and the sends before it); the fetch barrier does not."""
        if kind == Kind.SEND_BARRIER:
            self._barrier_endpoints = tuple(endpoints)
        self._to_all(kind, endpoints, trainer_id, wait=kind != Kind.FETCH_BARRIER)

    def skip_step(self) -> None:
        """Take part in a step without gradients (this trainer had no batch), so that no
        pserver waits for it: in sync mode its barrier arrives and the step goes on with
        the others' gradients; otherwise an empty SEND moves its clock (SSP) with theirs."""
        if self._barrier_endpoints:
            self.barrier(Kind.SEND_BARRIER, self._barrier_endpoints, self.trainer_id)
        else:
            self._to_all(Kind.SEND, list(self._clients), self.trainer_id)

    def pause(self) -> None:
        """Tell every pserver this trainer has no data for now: until it sends again, no
        barrier waits for it (its next gradients resume it)."""
        self._to_all(Kind.PAUSE, list(self._clients), self.trainer_id)

    # -- reading ------------------------------------------------------------------------------

    def open_reader(self, name: str, spec: ReaderSpec) -> TaskReader:
        """A new reader for the READER variable `name`, closing the one it replaces."""
        reader = TaskReader(spec)
        previous = self._readers.pop(name, None)
        if previous is not None:
            previous.close()
        self._readers[name] = reader
        return reader

    def samples_read(self) -> int | None:
        """Records the readers handed out in the last step (None: this runtime has no reader)."""
        if not self._readers:
            return None
        return sum(r.last_batch for r in self._readers.values())

    def coordinator_client(self) -> CoordinatorClient:
        if self.coordinator is None:
            raise TransportError("this job has no coordinator (FLUIDPS_COORDINATOR is not set)")
        return CoordinatorClient(self.context, self.coordinator, self.settings, self.trainer_id, self.sender)

    def settle(self) -> None:
        """Wait for the acknowledgements of what was sent without waiting."""
        pending, self._unsettled = self._unsettled, []
        wait_all(dict(enumerate(pending)))

    def serve(self, op: Any, env: dict[str, Any]) -> None:
        """Run a pserver loop (listen_and_serv) until every trainer is done."""
        from fluidps.executor.ps.parameter_server import ParameterServer

        server = ParameterServer(op, env, self)
        self.servers.append(server)
        server.serve()

    # -- ending ---------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Tell every pserver this trainer is done, close the sockets. Returns the
        problems met (a pserver already gone), which must not hide the caller's own.

        In an elastic job a trainer leaving before its reader saw the end of the data
        (it failed) says it pauses instead: the pservers go on without it, and a
        restarted process takes its place."""
        leaving = self.settings.elastic and any(r.reading for r in self._readers.values())
        problems = []
        for total in self._sums.values():  # the steps since the last upload count too
            if total.count:
                try:
                    self._push(total.take_mean(), total.trainer_id)
                except TransportError as e:
                    problems.append(f"the last {total.count} step(s) of gradients were not sent: {e}")
        self._sums.clear()
        for reader in self._readers.values():  # its last task: done, or given back
            try:
                reader.close()
            except Error as e:
                problems.append(f"reader of {reader.spec.dataset}: {e}")
        self._readers.clear()
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
        self._clients.clear()
        if self._keepalive is not None:
            self._keepalive.close()
            self._keepalive = None
        if self._context is not None:
            self._context.term()
            self._context = None
        return problems
