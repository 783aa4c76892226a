"""Cluster: the executor servers one RemoteExecutor's job runs on, and every connection to them.

It starts the servers the job asks for (or connects to running ones),
waits until each answers, and at the end closes the job in order: trainers
first (their COMPLETE ends the pserver loops), then pservers; servers it
started exit, servers someone else runs are reset for their next job.
Closing happens once, when the RemoteExecutor closes or, failing that, when
it is collected or the interpreter exits.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

from fluidps.endpoints import format_endpoint
from fluidps.errors import BuilderError, Error, TransportError, UnsupportedError
from fluidps.executor.launch.processes import ServeProcess, coordinator_flags, kill_all, signal_group
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient, wait_all
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message

if TYPE_CHECKING:
    from fluidps.executor.launch.kubernetes_client import KubernetesClient
    from fluidps.executor.remote.job import JobDesc


@dataclass
class Node:
    """One executor server of the cluster."""

    role: str  # "pserver", "trainer" or "coordinator"
    index: int
    client: RpcClient
    process: ServeProcess | None  # None: a server someone else runs


def _serve_flags(job: JobDesc) -> list[str]:
    """`fluidps serve` flags for what the job asks of every executor server."""
    flags = ["--profile"] if job.profile else []
    if job.compile is not None:
        flags.append("--compile" if job.compile else "--no-compile")
    return flags


class Cluster:
    def __init__(self, job: JobDesc, settings: RpcSettings):
        # The job's secret: the one given (secret_file), or a new one when this client starts
        # every server itself; the servers it starts get it in their environment.
        external = bool(job.pserver_servers or job.trainer_servers)
        if job.secret_file is None and not external:
            settings = settings.with_(secret=JobSecret.generate())
        elif job.secret_file is None and settings.security is None and not settings.insecure:
            raise BuilderError(
                "some of the job's servers are run by someone else: give JobDesc(secret_file=...), the job "
                "secret file their `fluidps serve --secret-file` reads (`fluidps secret gen FILE` makes "
                "one), or keys_dir= for CURVE keys"
            )
        self.settings = settings
        self.context = zmq.Context()
        self.own_logs = job.log_dir is None
        self.log_dir = Path(job.log_dir or tempfile.mkdtemp(prefix="fluidps-job-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[ServeProcess] = []
        self.nodes: list[Node] = []
        self.observers: dict[str, RpcClient] = {}  # pserver loop endpoint -> a client reading it
        self.pserver_endpoints: list[str] = list(job.pserver_endpoints)  # where pserver loops listen
        self.kubernetes: KubernetesClient | None = None  # with job.cluster: the pods' objects there
        self.keep_logs = False  # set when the job failed: its logs explain why
        self._stream_coordinator: ServeProcess | None = None  # a streaming job's, once ready
        self._drain_asked = False  # drain_stream was called
        self._drain_sent = False  # its coordinator got the SIGTERM
        self._drain_lock = threading.Lock()
        self._closed = False
        self._job = job
        try:
            self._start(job)
        except BaseException:
            self.keep_logs = True
            self.close()
            raise

    def _start(self, job: JobDesc) -> None:
        if job.cluster is not None:
            self._start_on_kubernetes(job)
            return
        wanted = [("pserver", i, job.pserver_servers) for i in range(job.pservers)]
        wanted += [("trainer", i, job.trainer_servers) for i in range(job.trainers)]
        self._start_servers(job, wanted)

    def start_stages(self, count: int) -> list[Node]:
        """Start `count` executor servers for a pipeline's stages ("stage.k"), on this machine."""
        if self._job.cluster is not None:
            raise BuilderError(
                "pipeline stages run on this machine's processes; not on a Kubernetes cluster yet"
            )
        self._start_servers(self._job, [("stage", i, ()) for i in range(count)])
        return self.role("stage")

    def _start_servers(self, job: JobDesc, wanted: list[tuple[str, int, Any]]) -> None:
        # Start every process first so that they import and compile side by side.
        started = {}
        local = sum(1 for *_, given in wanted if not given)
        threads = max((os.cpu_count() or 1) // max(local, 1), 1)
        for role, i, given in wanted:
            if not given:
                name = f"{role}.{i}"
                started[name] = ServeProcess(
                    name,
                    job.host,
                    self.log_dir / f"{name}.log",
                    job.keys_dir,
                    job.insecure,
                    job.peer_timeout,
                    threads,
                    extra_args=_serve_flags(job),
                    secret=self.settings.secret,
                )
                self.processes.append(started[name])
        deadline = time.monotonic() + job.start_timeout
        for role, i, given in wanted:
            process = started.get(f"{role}.{i}")
            if process is None:
                address = given[i]
            else:
                address = process.wait_ready(max(deadline - time.monotonic(), 1.0))
            client = RpcClient(self.context, address, f"{role} {i}'s executor server", self.settings)
            self.nodes.append(Node(role, i, client, process))
        self.call_all(
            {s.client: Message(Kind.HELLO) for s in self.nodes if s.role in {r for r, *_ in wanted}}
        )

    def _start_on_kubernetes(self, job: JobDesc) -> None:
        """Create the job's server pods, wait until every one is ready, connect to each at
        its pod's address; its pserver loops will listen at the next port."""
        from fluidps.executor.launch.kubernetes_client import KubernetesClient  # the k8s extra

        objects = job.kubernetes_servers(self.settings.secret)
        client = KubernetesClient()
        client.create_all(objects)
        self.kubernetes = client  # from here on, closing deletes them
        replicas = {"pserver": job.pservers, "trainer": job.trainers}
        pods = client.wait_ready(job.name, job.cluster.namespace, replicas, job.start_timeout)
        addresses = self.kubernetes.addresses(pods)
        port = job.cluster.port
        self.pserver_endpoints = [
            format_endpoint(addresses[("pserver", i)], port + 1) for i in range(job.pservers)
        ]
        for role, count in (("pserver", job.pservers), ("trainer", job.trainers)):
            for i in range(count):
                address = f"tcp://{format_endpoint(addresses[(role, i)], port)}"
                name = f"{role} {i}'s executor server (pod {job.name}-{role}-{i} at {address})"
                self.nodes.append(Node(role, i, RpcClient(self.context, address, name, self.settings), None))
        self.call_all({s.client: Message(Kind.HELLO) for s in self.nodes})

    def start_coordinator(self, job: JobDesc, stream: str | None = None) -> str:
        """Start the job's coordinator on this machine (its state in the log directory): of
        a dataset's tasks, or of `stream`'s windows. Its address. Stopped with the job."""
        if job.cluster is not None:
            raise UnsupportedError(
                "a RemoteExecutor on Kubernetes reads no dataset yet: render the script the Fluid way "
                "(fluidps k8s render --dataset ...), whose coordinator runs as a pod"
            )
        process = ServeProcess(
            "coordinator",
            job.host,
            self.log_dir / "coordinator.log",
            job.keys_dir,
            job.insecure,
            job.peer_timeout,
            threads=1,
            role="coordinator",
            extra_args=coordinator_flags(self.log_dir / "coordinator.json", stream),
            secret=self.settings.secret,
        )
        self.processes.append(process)
        address = process.wait_ready(job.start_timeout)
        if stream is not None:  # (its SIGTERM handler is in place once it is ready)
            self._stream_coordinator = process
            if self._drain_asked:
                self._send_drain()
        client = RpcClient(self.context, address, "the coordinator", self.settings)
        self.nodes.append(Node("coordinator", 0, client, process))
        self.call_all({client: Message(Kind.HELLO)})
        return address

    def drain_stream(self) -> int:
        """Drain the job's stream: SIGTERM to its coordinator, which then cuts no more
        windows and tells each trainer "stopped" once its window in hand is done (`fluidps
        serve --role coordinator --stream`; a second SIGTERM would stop it, so it goes
        once). Asked before that coordinator is ready, it goes as soon as it is. Only
        signals: safe in a signal handler. How many streams drain (0: none is served yet)."""
        self._drain_asked = True
        self._send_drain()
        return int(self._stream_coordinator is not None)

    def _send_drain(self) -> None:
        # One SIGTERM only (a second would stop the coordinator instead of draining it). A
        # signal handler may run this in the middle of another call: whoever holds the lock
        # sends it, and the handler, finding it held, leaves it to that call (a blocking
        # acquire there would wait forever on the thread it interrupted).
        if not self._drain_lock.acquire(blocking=False):
            return
        try:
            process = self._stream_coordinator
            if process is None or self._drain_sent:
                return
            self._drain_sent = True
        finally:
            self._drain_lock.release()
        signal_group(process.process, signal.SIGTERM)

    def _delete_pods(self) -> list[str]:
        assert self.kubernetes is not None and self._job.cluster is not None
        try:
            self.kubernetes.delete(self._job.name, self._job.cluster.namespace)
        except Error as e:
            return [f"deleting the job's pods: {e}"]
        return []

    def role(self, role: str) -> list[Node]:
        return [s for s in self.nodes if s.role == role]

    def observe(self, endpoint: str, name: str) -> RpcClient:
        """A client of a pserver loop, for reading and writing its values (trainer id -1)."""
        if endpoint not in self.observers:
            self.observers[endpoint] = RpcClient(self.context, endpoint, name, self.settings)
        return self.observers[endpoint]

    def call_all(self, requests: Mapping[RpcClient, Message], timeout: float | None = None) -> dict:
        """Send every request, then wait for all replies. A failure names the server,
        with the end of its log when its process died."""
        return self.wait_all({c: (c, c.request(m)) for c, m in requests.items()}, timeout)

    def wait_all(self, pending: Mapping[Any, tuple[RpcClient, int]], timeout: float | None = None) -> dict:
        """Wait for requests already sent ({key: (client, request id)}), as call_all does."""
        try:
            return wait_all(dict(pending), timeout)
        except TransportError as e:
            raise type(e)(f"{e}{self.death_notes()}") from None

    def death_notes(self) -> str:
        notes = []
        for s in self.nodes:
            status = s.process.exit_status() if s.process is not None else None
            if status is not None:
                notes.append(f"\n{s.role} {s.index} exited with status {status}{s.process.describe_log()}")
        return "".join(notes)

    def close(self) -> list[str]:
        """End the job; returns the problems met on the way."""
        if self._closed:
            return []
        self._closed = True
        problems: list[str] = []
        for role in ("trainer", "pserver", "coordinator"):
            group = self.role(role)
            ending = {s.client: Message(Kind.SHUTDOWN if s.process else Kind.RESET) for s in group}
            try:
                self.call_all(ending, timeout=self.settings.peer_timeout * 3)
            except Error as e:
                problems.append(str(e))
            for s in group:
                if s.process is not None:
                    status = s.process.stop(timeout=self.settings.peer_timeout)
                    if status is None:
                        problems.append(f"{s.role} {s.index} (pid {s.process.pid}) did not die after SIGKILL")
                    elif status != 0:
                        problems.append(f"{s.role} {s.index} exited with status {status}")
        kill_all(self.processes)  # any that never became a server
        if self.kubernetes is not None:
            problems += self._delete_pods()
        for client in [*self.observers.values(), *(s.client for s in self.nodes)]:
            client.close()
        self.context.term()
        if problems:
            self.keep_logs = True
        if self.own_logs and not self.keep_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        return problems
