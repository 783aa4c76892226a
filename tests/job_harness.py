"""Test harness for whole jobs in one process: pservers on threads, each with its own
Executor, as `listen_and_serv` runs in a pserver process.

Every participant of the job shares one ZeroMQ context (`config`), which inproc://
endpoints need. Every wait is bounded; `join` checks that every pserver stopped
without an error.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref

import zmq

import fluidps
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message


class PserverThreads:
    """One thread per endpoint running `transpiler.get_pserver_programs(endpoint)`
    (startup, then main: it serves until every trainer sends COMPLETE). `wait` bounds
    `drain` and `join` unless they are given their own timeout."""

    def __init__(
        self,
        transpiler,
        endpoints: list[str],
        settings: RpcSettings,
        wait: float = 30.0,
        compile=None,
        metrics=None,
    ):
        """`compile`: the pservers' Executors' (None: as FLUIDPS_COMPILE says); `metrics`: a
        JobMetrics every participant reports to (fluidps.executor.metrics.job_metrics)."""
        self.transpiler, self.endpoints, self.wait = transpiler, list(endpoints), wait
        self.errors: list[BaseException] = []
        self.context = zmq.Context()
        # Closed (with any socket a failed test left open) once the job is collected.
        weakref.finalize(self, self.context.destroy, 0)
        self.config = RuntimeConfig(rpc=settings, context=self.context, metrics=metrics)
        self.executors = {
            ep: fluidps.Executor(runtime_config=self.config, compile=compile) for ep in self.endpoints
        }
        self.final_stats: dict[str, dict] = {}  # per endpoint, when its loop ended
        self.threads = [
            threading.Thread(target=self._serve, args=(ep,), daemon=True) for ep in self.endpoints
        ]
        for thread in self.threads:
            thread.start()

    def _serve(self, endpoint: str) -> None:
        exe = self.executors[endpoint]
        try:
            main, startup = self.transpiler.get_pserver_programs(endpoint)
            exe.run(startup)
            exe.run(main)  # serves until every trainer sends COMPLETE
        except BaseException as e:
            self.errors.append(e)
        finally:
            if exe.has_runtime and exe.runtime.pserver_loops:
                self.final_stats[endpoint] = exe.runtime.pserver_loops[0].stats()
            exe.close()

    def wait_serving(self, timeout: float | None = None) -> None:
        """Wait until every pserver loop answers: it has restored its checkpoints."""
        for endpoint in self.endpoints:
            client = RpcClient(self.context, endpoint, f"pserver {endpoint}", self.config.rpc)
            try:
                client.call(Message(Kind.HELLO), timeout=self.wait if timeout is None else timeout)
            finally:
                client.close()

    def trainer_executor(self, settings: RpcSettings | None = None) -> fluidps.Executor:
        """An Executor for a trainer of this job (its settings unless given)."""
        rpc = settings if settings is not None else self.config.rpc
        return fluidps.Executor(runtime_config=dataclasses.replace(self.config, rpc=rpc))

    def server(self, endpoint: str):
        """The ParameterServer loop of `endpoint` (there once it answered a request)."""
        return self.executors[endpoint].runtime.pserver_loops[0]

    def drain(self, endpoint: str, timeout: float | None = None) -> None:
        """Wait until the pserver has applied every gradient it queued."""
        timeout = self.wait if timeout is None else timeout
        server = self.server(endpoint)
        host = self.executors[endpoint].runtime.pserver
        deadline = time.monotonic() + timeout
        for grad in server.spec.grad_blocks:
            while len(host.queue(grad)) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(host.queue(grad)) == 0, f"{endpoint} did not apply its queued {grad} in {timeout} s"
        for (
            lock
        ) in server.blocks.locks.values():  # a worker that popped a gradient holds its lock while applying it
            assert lock.acquire(timeout=timeout)
            lock.release()

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.wait if timeout is None else timeout)
        for thread in self.threads:
            thread.join(timeout=max(deadline - time.monotonic(), 0.1))
        assert not any(t.is_alive() for t in self.threads), "a pserver did not stop"
        assert not self.errors, self.errors
