"""The executor server `fluidps serve` runs: an Executor driven over the wire.

A RemoteExecutor (or any client) LOADs programs under names, RUNs them with
feeds and gets fetches back, STARTs one in the background (a pserver's
listen_and_serv loop), GETs and SETs values of its scope, asks its STATUS,
and finally SHUTs it DOWN.

Runs execute in order on one worker thread, so that the serving loop keeps
answering heartbeats while a step (or the first numba compilation) takes its
time. A client may send the next RUNs before the current one is answered (a
RemoteExecutor prefetching fed batches): they wait in a queue, and the worker
goes from one to the next without a round trip to the client. A RUN may carry
several batches (Message.batches): they run one after another as so many steps,
and one reply carries each one's fetches, so that the client and this server's
loop pay for one message, not one a step. Once a run fails, the runs queued
behind it are answered with that failure, not run.
"""

from __future__ import annotations

import json
import queue
import threading
import traceback
from collections import deque
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import zmq

from fluidps.errors import BuilderError, EOFException, Error, NoDataYet
from fluidps.executor.block_runner import describe
from fluidps.executor.env import parse_incarnation, parse_incarnations
from fluidps.executor.executor import Executor
from fluidps.executor.pipeline.channel import RemoteStageChannel
from fluidps.executor.pipeline.stage import StageRunner
from fluidps.executor.resources import resident_bytes
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.transport.rpc import Request, RpcServer, Waker
from fluidps.executor.transport.wire import Kind, Message, json_fields
from fluidps.ir.devices import PipelineConfig
from fluidps.ir.program import Program
from fluidps.transpiler.pipeline import stage_plan

# The program a trainer runs after skipping a step: its startup's recv, without readers.
REFRESH = "refresh"
_SETTINGS = ("coordinator", "incarnation", "trainer_incarnations", "pipeline")  # what CONFIGURE sets
STAGE = "stage"  # the program a pipeline stage runs: its section program, one step a RUN
_PIPELINE = {"stage": int, "num_stages": int, "num_microbatches": int, "schedule_mode": str, "endpoints": str}


@dataclass
class _Finished:
    request: Request
    result: dict[str, Any]  # "values" and "samples", or "no_task", or "error"


class ExecutorServer:
    def __init__(
        self,
        endpoint: str,
        config: RuntimeConfig | None = None,
        name: str | None = None,
        compile: bool | None = None,
    ):
        self.config = config or RuntimeConfig()  # what the programs it runs take part in a job with
        self.compile = compile  # its executors' (None: FLUIDPS_COMPILE decides)
        self.settings = self.config.rpc
        self.name = name or f"executor server {endpoint}"
        self.exe = Executor(runtime_config=self.config, compile=self.compile)
        self.programs: dict[str, Program] = {}
        self._context = zmq.Context()
        self.server = RpcServer(self._context, endpoint, self.name, self.settings)
        self._runs: queue.Queue[Request | None] = queue.Queue()  # RUNs for the worker (None: stop)
        self._finished: deque[_Finished] = deque()  # the worker's results, for the loop to answer
        self._unanswered = 0  # RUNs received and not answered yet
        self._most_unanswered = 0  # the most RUNs it ever held at once (a client's prefetch)
        self._ran: dict[str, tuple[int, int]] = {}  # program -> (RUNs run through, their batches)
        self._stale = False  # values changed on the pservers: pull them before the next run
        self._background: threading.Thread | None = None
        self._background_error: str | None = None
        self._stage_channel: RemoteStageChannel | None = None  # a pipeline stage's (CONFIGURE pipeline)
        self._stage_config: PipelineConfig | None = None
        self._stage_runner: StageRunner | None = None
        self._running = True
        # A finished run wakes the serving loop through this socket, so its reply
        # goes out at once rather than at the loop's next poll.
        self._waker = Waker(self._context)
        self._worker = threading.Thread(target=self._work, name="run", daemon=True)
        self._worker.start()

    def serve_forever(self) -> None:
        try:
            while self._running:
                for request in self.server.receive(0.5, wake=self._waker.socket):
                    self._handle(request)
                self._answer_finished()
        finally:
            self.close()

    @property
    def address(self) -> str:
        """The address it serves (with the port ZeroMQ picked when asked for port 0)."""
        return self.server.address

    def stop(self) -> None:
        """Make serve_forever return (safe from a signal handler)."""
        self._running = False

    def close(self) -> None:
        """Tell the pservers this trainer is done and stop serving. A background
        program still running (a pserver whose trainers never finished) is
        abandoned: its sockets stay open, so the runtime is not closed under it."""
        self._runs.put(None)  # the worker stops after the runs queued before this
        busy = [t for t in (self._background, self._worker) if t is not None]
        if self._background is not None and self._background.is_alive() and self.exe.has_runtime:
            self.exe.runtime.pserver.stop("shutdown")  # pserver loops still serving: save, then end
        for thread in busy:
            thread.join(timeout=self.settings.peer_timeout)
        if any(t.is_alive() for t in busy):
            print(f"{self.name}: shutting down while a program still runs", flush=True)
        else:
            problems = self.exe.close()
            if problems:
                print(f"{self.name}: on shutdown: {'; '.join(problems)}", flush=True)
        self.server.close()
        self._waker.close()
        if not self._worker.is_alive():  # else its runs may hold sockets open: term() would wait
            self._context.term()

    # -- requests -------------------------------------------------------------------------

    def _handle(self, request: Request) -> None:
        msg = request.msg
        try:
            if msg.kind == Kind.HELLO:
                self.server.reply(request)
            elif msg.kind == Kind.LOAD:
                if len(msg.blobs) != 1 or not msg.text:
                    raise Error("LOAD needs a program name and one blob holding its bytes")
                self.programs[msg.text] = Program.parse_from_string(msg.blobs[0])
                self.server.reply(request)
            elif msg.kind == Kind.CONFIGURE:
                self._configure(msg.text)
                self.server.reply(request)
            elif msg.kind == Kind.STAGE_SEND:
                if self._stage_channel is None:
                    raise Error("is no pipeline stage: it takes no STAGE_SEND")
                self._stage_channel.deliver(msg)
                self.server.reply(request)
            elif msg.kind == Kind.RUN:
                self._program(msg.text)
                self._unanswered += 1
                self._most_unanswered = max(self._most_unanswered, self._unanswered)
                self._runs.put(request)
            elif msg.kind == Kind.START:
                self._start_background(self._program(msg.text))
                self.server.reply(request)
            elif msg.kind in (Kind.GET, Kind.SET) and self._unanswered:
                raise Error("is running a program; get and set values between runs")
            elif msg.kind == Kind.GET:
                self.server.reply(request, Message(Kind.VALUES, tensors=self._get(msg.names)))
            elif msg.kind == Kind.SET:
                self._set(msg)
                self.server.reply(request)
            elif msg.kind == Kind.STATUS:
                self.server.reply(request, Message(Kind.VALUES, text=json.dumps(self._status())))
            elif msg.kind == Kind.RESET:
                self._reset()
                self.server.reply(request)
            elif msg.kind == Kind.SHUTDOWN:
                self.server.reply(request)
                self._running = False
            else:
                raise Error(f"{self.name} does not handle {msg.kind_name} messages")
        except Error as e:
            self.server.error(request, f"{self.name}: {e}")

    def _configure(self, text: str) -> None:
        """One setting of the job (JSON {name: text}). "coordinator": its address, where this
        executor's readers take their tasks (driven step by step by a client, they return
        NO_TASK rather than wait for one). Before anything of the job runs: "incarnation",
        the one this trainer speaks as, or "trainer_incarnations", those a pserver's trainers
        speak as (comma-separated hex), so that no other process can take a trainer's id."""
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        if not isinstance(body, dict) or len(body) != 1 or next(iter(body)) not in _SETTINGS:
            raise Error(f"CONFIGURE takes one of {', '.join(_SETTINGS)} as JSON, got {text[:200]!r}")
        name = next(iter(body))
        value = json_fields(text, {name: str})[name]
        if name == "coordinator":
            if not value.startswith(("tcp://", "ipc://")):
                raise Error(f"CONFIGURE: the coordinator's address must be tcp:// or ipc://, got {value!r}")
            readers = self.exe.runtime.readers
            readers.coordinator = value
            readers.wait_for_tasks = False
            return
        if self.exe.has_runtime or self.programs:
            raise Error(f"CONFIGURE {name} before the job loads or runs anything here")
        if name == "pipeline":
            self._configure_stage(value)
            return
        try:
            if name == "incarnation":
                config = replace(self.config, incarnation=parse_incarnation(value, name))
            else:
                rpc = self.config.rpc.with_(trainer_incarnations=parse_incarnations(value, name))
                config = replace(self.config, rpc=rpc)
        except BuilderError as e:
            raise Error(f"CONFIGURE: {e}") from None
        self.exe = Executor(runtime_config=config, compile=self.compile)

    def _configure_stage(self, text: str) -> None:
        """Be stage `stage` of a pipeline whose stages' executor servers are `endpoints`
        (comma-separated, in stage order): RUNs of the STAGE program are its steps."""
        try:
            fields = json_fields(text, _PIPELINE)
            config = PipelineConfig(fields["num_microbatches"], fields["schedule_mode"], fields["num_stages"])
        except (Error, BuilderError) as e:
            raise Error(f"CONFIGURE pipeline: {e}") from None
        endpoints = fields["endpoints"].split(",")
        if len(endpoints) != config.num_stages or not 0 <= fields["stage"] < config.num_stages:
            raise Error(f"CONFIGURE pipeline: stage {fields['stage']} of {len(endpoints)} endpoints")
        self._stage_channel = RemoteStageChannel(
            fields["stage"], endpoints, self.settings, self._context, config.num_microbatches
        )
        self._stage_config = config
        self.exe.runtime.attach_stages(self._stage_channel)

    def _stage_step(self, msg: Message) -> dict[str, Any]:
        """One step of this pipeline stage: its schedule on the fed mini-batch."""
        if self._stage_runner is None:
            channel, exe = self._stage_channel, self.exe
            plan = stage_plan(self._program(STAGE), channel.stage)

            def run(program: Program, feed: Any, fetch: Any, scope: Any) -> list[Any]:
                return exe.run(program, feed=feed, fetch_list=list(fetch), scope=scope, return_numpy=False)

            self._stage_runner = StageRunner(plan, self._stage_config, run, channel)
        runner = self._stage_runner
        made = runner.step(self.exe.scope, msg.tensors, [n for n in msg.names if n in runner.plan.made])
        self._stage_channel.flush()  # every value it sent was taken: the step is done here
        self._stage_channel.next_step()
        values = {}
        for name in msg.names:  # what it made, or what it holds after the step (its parameters)
            value = made[name] if name in made else self.exe.scope.find(name)
            if value is None:
                raise Error(f"stage {runner.plan.stage} neither makes nor holds {name!r}")
            values[name] = np.array(value, copy=True) if name not in made else value
        runs, batches = self._ran.get(STAGE, (0, 0))
        self._ran[STAGE] = (runs + 1, batches + 1)
        return {"values": values, "samples": None}

    def _program(self, name: str) -> Program:
        if name not in self.programs:
            raise Error(f"no program named {name!r} was loaded")
        return self.programs[name]

    def _reset(self) -> None:
        """Forget the job so that the next client starts afresh."""
        if self._unanswered:
            raise Error("is running a program; reset once it is done")
        if self._background is not None:
            self._background.join(timeout=self.settings.peer_timeout)
            if self._background.is_alive():
                raise Error("its background program (a pserver loop) still runs: its trainers are not done")
        problems = self.exe.close()
        if problems:
            print(f"{self.name}: on reset: {'; '.join(problems)}", flush=True)
        self.exe = Executor(runtime_config=self.config, compile=self.compile)
        self.programs.clear()
        self._ran = {}
        self._stale = False
        self._background, self._background_error = None, None

    def _set(self, msg: Message) -> None:
        """Values to write, and names of values the pservers now hold anew: those are
        pulled (the REFRESH program) before the next run."""
        if msg.names and REFRESH not in self.programs:
            raise Error(f"cannot pull {msg.names[0]!r} anew: no {REFRESH!r} program was loaded")
        unknown = [n for n in msg.names if n not in self.exe.scope]
        if unknown:
            raise Error(f"its scope holds no variable {', '.join(map(repr, unknown))}")
        for name, value in msg.tensors.items():  # all checked before any is stored
            current = self.exe.scope.find(name)
            if current is None:
                raise Error(
                    f"cannot set {name!r}: its scope holds no such variable (run the startup program)"
                )
            if type(value) is not type(current) or (
                isinstance(value, np.ndarray) and (value.shape, value.dtype) != (current.shape, current.dtype)
            ):
                raise Error(f"cannot set {name!r}: got {describe(value)}, it holds {describe(current)}")
        for name, value in msg.tensors.items():
            self.exe.scope[name] = value
        self._stale = self._stale or bool(msg.names)

    def _get(self, names: list[str]) -> dict[str, Any]:
        missing = [n for n in names if n not in self.exe.scope]
        if missing:
            raise Error(f"its scope holds no variable {', '.join(map(repr, missing))}")
        return {n: self.exe.scope[n] for n in names}

    def _status(self) -> dict[str, Any]:
        background = "none"
        if self._background is not None:
            background = "running" if self._background.is_alive() else "done"
        if self._background_error:
            background = f"failed: {self._background_error}"
        runtime = self.exe.runtime if self.exe.has_runtime else None
        servers = [s.stats(compact=True) for s in runtime.pserver_loops] if runtime is not None else []
        return {
            "background": background,
            "programs": sorted(self.programs),
            "pservers": servers,
            "rss_bytes": resident_bytes(),
            "most_runs_held": self._most_unanswered,
            "ran": {
                name: {"runs": runs, "batches": batches} for name, (runs, batches) in dict(self._ran).items()
            },
            "compiled_ops": self.exe.compiled_ops(),  # 0 when its executor interprets
            # distributed-table prefetches served by rows asked for ahead, and sent as messages
            **(
                {"prefetches": dict(runtime.trainer.prefetches)}
                if runtime is not None and runtime.has_trainer
                else {}
            ),
            **({"profile": runtime.profile.report()} if runtime is not None and runtime.profile else {}),
            **({"pipeline": self._stage_stats()} if self._stage_runner is not None else {}),
        }

    def _stage_stats(self) -> dict[str, Any]:
        return {**self._stage_runner.stats(), "steps": self._stage_channel.step}

    # -- runs on a worker thread ---------------------------------------------------------------

    def _work(self) -> None:
        """The worker thread: runs the RUNs in order, hands each result to the loop."""
        while (request := self._runs.get()) is not None:
            result = self._execute(request.msg)
            self._finished.append(_Finished(request, result))
            if "error" in result:  # what was queued behind a failed run is not run
                while (later := self._queued()) is not None:
                    failure = f"not run: an earlier run failed: {result['error']}"
                    self._finished.append(_Finished(later, {"error": failure}))
            self._waker.wake()

    def _queued(self) -> Request | None:
        """The next RUN already queued, if any (a stop request stays queued)."""
        try:
            request = self._runs.get_nowait()
        except queue.Empty:
            return None
        if request is None:
            self._runs.put(None)
        return request

    def _execute(self, msg: Message) -> dict[str, Any]:
        """Run a RUN's program: its fetches, "no_task" for a reader with no batch, or the error."""
        try:
            return self._run(msg)
        except Error as e:
            return {"error": str(e)}
        except Exception as e:  # a bug: report it with its trace rather than die silently
            return {"error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}

    def _run(self, msg: Message) -> dict[str, Any]:
        if msg.text == STAGE and self._stage_channel is not None:
            if msg.batches:
                raise Error("a pipeline stage runs one mini-batch a RUN")
            return self._stage_step(msg)
        if self._stale and msg.text != REFRESH:
            self.exe.run(self.programs[REFRESH])
            self._stale = False
        program = self.programs[msg.text]
        feeds = msg.batches or [msg.tensors]
        fetched = []
        for i, feed in enumerate(feeds):
            # Each step is told the batch after it: this RUN's next, or the first of the RUN queued next.
            after = feeds[i + 1] if i + 1 < len(feeds) else None
            try:
                values = self.exe.run(
                    program,
                    feed=feed,
                    fetch_list=msg.names,
                    next_feed=(lambda after=after: after)
                    if after is not None
                    else lambda: self._next_feed(msg),
                )
            except (NoDataYet, EOFException) as e:
                if msg.batches:
                    raise Error(
                        f"program {msg.text!r} reads a dataset: run it one batch a RUN, not {len(feeds)}"
                    ) from None
                return self._no_data(e)
            except Error as e:
                if not msg.batches:
                    raise
                raise Error(f"batch {i + 1} of the {len(feeds)} this RUN carried: {e}") from None
            fetched.append(dict(zip(msg.names, values, strict=True)))
        runs, batches = self._ran.get(msg.text, (0, 0))
        self._ran[msg.text] = (runs + 1, batches + len(fetched))
        runtime = self.exe.runtime if self.exe.has_runtime else None
        if runtime is not None and runtime.has_trainer and self._runs.empty():
            # Nothing queued behind this step: what it sent without waiting (a step with
            # no recv to carry its barrier, as one training only distributed tables) is
            # acknowledged before the client hears it is done, so that whatever the
            # client reads from the pservers next includes this step.
            runtime.trainer.settle()
        if msg.batches:
            return {"batches": fetched}
        readers = runtime.readers if runtime is not None and runtime.has_readers else None
        return {"values": fetched[0], "samples": readers.samples_read() if readers is not None else None}

    def _no_data(self, reason: NoDataYet | EOFException) -> dict[str, Any]:
        """A reader with no batch for this step (NoDataYet), or done for good (EOFException)."""
        if isinstance(reason, NoDataYet):
            # No batch for this trainer now: it takes part in the step without gradients
            # (nobody waits for it) and pulls the parameters as the others do.
            self.exe.runtime.trainer.skip_step()
            if REFRESH in self.programs:
                self.exe.run(self.programs[REFRESH])
            return {"no_task": "wait"}
        # Done reading: no barrier or SSP bound of a trainer still in its last step may
        # wait for this one. It pauses (the pservers keep serving the client, who may
        # read the trained values) and says it is done when the job closes.
        self.exe.runtime.trainer.pause()
        return {"no_task": "finished"}

    def _next_feed(self, msg: Message) -> dict[str, Any] | None:
        """The (first) feed of the RUN queued after `msg`, if one is and runs the same
        program (the step's trainer asks its pservers for that batch's table rows ahead)."""
        with self._runs.mutex:  # a peek: the loop thread may be queueing
            after = self._runs.queue[0] if self._runs.queue else None
        if after is None or after.msg.text != msg.text:
            return None
        return after.msg.batches[0] if after.msg.batches else after.msg.tensors

    def _answer_finished(self) -> None:
        while self._finished:
            done = self._finished.popleft()
            self._unanswered -= 1
            result = done.result
            if "error" in result:
                self.server.error(done.request, f"{self.name}: {result['error']}")
            elif "no_task" in result:  # a reader with nothing for this step, or done for good
                self.server.reply(done.request, Message(Kind.NO_TASK, text=result["no_task"]))
            elif "batches" in result:  # a RUN of several batches: each one's fetches
                self.server.reply(done.request, Message(Kind.VALUES, batches=result["batches"]))
            else:
                samples = result.get("samples")
                text = json.dumps({"samples": samples}) if samples is not None else ""
                self.server.reply(done.request, Message(Kind.VALUES, tensors=result["values"], text=text))

    def _start_background(self, program: Program) -> None:
        if self._background is not None and self._background.is_alive():
            raise Error(f"{self.name} already runs a program in the background")

        def work() -> None:
            try:
                self.exe.run(program)
            except Exception as e:
                self._background_error = str(e)

        self._background = threading.Thread(target=work, name="background", daemon=True)
        self._background.start()
