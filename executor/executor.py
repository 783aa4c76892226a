"""Executor: run a program's global block op by op on the kernels.

`run` prepares a program once per (program revision, feed names, fetch names)
(kernel runners built, scope reads and feed requirements worked out) and then
each call only moves values in, calls the runners in order, and moves values
out. Programs with communication ops (a trainer's send / recv, a pserver's
listen_and_serv) or a dataset reader run with the executor's Runtime, its part
in a job, made the first time such a program is prepared. A program with none of
them never makes one, so none of a Runtime's pieces (a trainer's client, pserver
loops, dataset readers) is loaded, nor ZeroMQ; the runtime module itself is (it
holds RuntimeConfig, which every Executor takes).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fluidps.errors import EOFException, ExecutionError, FeedError, NoDataYet, ProgramError
from fluidps.executor.block_runner import BlockRunner
from fluidps.executor.runtime import Runtime, RuntimeConfig
from fluidps.executor.scope import Scope, Value
from fluidps.ir.program import Program
from fluidps.ir.types import EMPTY_VAR_NAME, FEED_VAR_NAME, FETCH_VAR_NAME, TENSOR_KINDS, to_numpy_dtype
from fluidps.ir.variable import Variable
from fluidps.ops import verify as verify_program
from fluidps.ops.selected_rows import SelectedRows

if TYPE_CHECKING:
    from fluidps.executor.compiler import Compiler
    from fluidps.executor.pipeline.local import LocalPipeline
    from fluidps.executor.pipeline.process import StageProcess

FetchTarget = Variable | str
# The feed of the step after this one: given, or a function giving it when asked (None: not known)
NextFeed = Mapping[str, Any] | Callable[[], Mapping[str, Any] | None] | None

# Ops whose kernels take part in a job: a program using them needs the Runtime.
RUNTIME_OPS = frozenset(
    {"send", "recv", "send_barrier", "fetch_barrier", "listen_and_serv", "enqueue", "dequeue"}
    | {"distributed_lookup_table"}  # prefetches rows of a table the pservers hold
    | {"create_dataset_reader", "create_stream_reader"}  # readers get their tasks through the runtime
    | {"send_v2", "recv_v2"}  # pipeline stages' exchanges
)
_HOLDERS = (FEED_VAR_NAME, FETCH_VAR_NAME)


def _fetch_name(target: FetchTarget) -> str:
    if isinstance(target, Variable):
        return target.name
    if isinstance(target, str):
        return target
    raise FeedError(f"fetch_list entries are Variables or names, got {type(target).__name__}")


def needs_runtime(program: Program) -> bool:
    """Whether `program` takes part in a job (talks to other processes or reads a dataset)."""
    return any(op.type in RUNTIME_OPS for block in program.blocks for op in block.ops)


class PreparedProgram:
    """A program's global block, ready to run: one runner per op. A program that takes
    part in a job (`needs_runtime`) is prepared with the executor's `runtime`."""

    def __init__(
        self,
        program: Program,
        fetch_names: Sequence[str],
        runtime: Runtime | None = None,
        compiler: Compiler | None = None,
    ):
        self.program = program
        self.runtime = runtime
        block = self.block = program.global_block()
        self.scope_reads: list[str] = []
        self.unfed: dict[str, tuple[int, str, str]] = {}  # name -> (op index, op type, slot)
        self.feed_targets: dict[str, int] = {}
        self.fetch_ops: list[str] = []
        written: set[str] = set()
        for i, op in enumerate(block.ops):
            # listen_and_serv's inputs are the gradients it will receive.
            inputs = {} if op.type == "listen_and_serv" else op.inputs
            for slot, names in inputs.items():
                for name in names:
                    if name == EMPTY_VAR_NAME or name in written:
                        continue
                    var = block.find_var(name)
                    if var is None:
                        raise ProgramError(
                            f"block 0, op #{i} ({op.type}) reads {name!r}, which is not declared"
                        )
                    if var.persistable:
                        self._read_from_scope(name)
                    else:
                        self.unfed.setdefault(name, (i, op.type, slot))
            written.update(n for n in op.output_arg_names if n != EMPTY_VAR_NAME)
            if op.type == "feed":
                self.feed_targets[op.output("Out")[0]] = op.attr("col")
            elif op.type == "fetch":
                self.fetch_ops.append(op.input("X")[0])
        # Sub-blocks (a pserver's optimize blocks) use persistable state too.
        for sub_block in program.blocks[1:]:
            for op in sub_block.ops:
                for name in op.input_arg_names + op.output_arg_names:
                    var = sub_block.find_var(name)
                    if var is not None and var.persistable:
                        self._read_from_scope(name)
        # Without a runtime, a send or a reader refuses to build.
        self.runner = BlockRunner(block, runtime, compiler=compiler, keep=fetch_names)
        # Each run of a trainer program (it sends gradients) is one step of its trainer.
        self.counts_steps = any(op.type == "send" for op in block.ops)
        self.readers = [op.input("Reader")[0] for op in block.ops if op.type == "read"]
        self.persistables = [n for n, v in block.vars.items() if v.persistable and n not in _HOLDERS]
        self.fetch_names = list(fetch_names)
        self.computed = written  # what its ops write: a next step's feed of these tells nothing

    def _read_from_scope(self, name: str) -> None:
        if name not in self.scope_reads:
            self.scope_reads.append(name)

    # -- feeds -------------------------------------------------------------------------

    def check_feed(self, name: str, value: Any) -> Value:
        var = self.block.find_var(name)
        if var is None:
            data = sorted(v.name for v in self.block.vars.values() if v.need_check_feed)
            hint = f"; its data variables are {', '.join(data)}" if data else ""
            raise FeedError(f"feed {name!r} is not a variable of the program{hint}")
        if isinstance(value, SelectedRows) or var.type not in TENSOR_KINDS or var.dtype is None:
            return value
        want = to_numpy_dtype(var.dtype)
        if not isinstance(value, np.ndarray):
            value = np.asarray(value, dtype=want)
        elif value.dtype != want:
            raise FeedError(
                f"feed {name!r} has dtype {value.dtype}; the program declares {want}: pass the array .astype('{want}')"
            )
        if var.need_check_feed and var.shape is not None and not _fits(value.shape, var.shape):
            raise FeedError(
                f"feed {name!r} has shape {list(value.shape)}; the program declares {list(var.shape)} (-1: any size)"
            )
        return value

    def check_feeds(self, feed: Mapping[str, Any]) -> dict[str, Value]:
        """The feed, checked and converted; raises FeedError naming what is wrong or missing."""
        checked = {name: self.check_feed(name, value) for name, value in feed.items()}
        missing = [n for n in self.unfed if n not in checked and n not in self.feed_targets]
        if missing:
            i, op_type, slot = self.unfed[missing[0]]
            raise FeedError(
                f"op #{i} ({op_type}) reads {missing[0]!r} (slot {slot}), which is neither fed nor computed "
                f"by an earlier op; add it to feed (missing: {', '.join(missing)})"
            )
        return checked

    # -- running -----------------------------------------------------------------------

    def run(
        self, scope: Scope, feed: Mapping[str, Any], return_numpy: bool, next_feed: NextFeed = None
    ) -> list[Any]:
        env: dict[str, Any] = {}
        if self.counts_steps and self.runtime is not None:
            self.runtime.trainer.begin_step(self._next_feed(next_feed))
            if self.runtime.profile is not None:
                self.runtime.profile.step()
        for name in self.scope_reads:
            value = scope.find(name)
            if value is None:
                if name in _HOLDERS:
                    continue
                raise ExecutionError(
                    f"variable {name!r} is not initialized in the scope: run the startup program first "
                    "(exe.run(startup_program)) or load saved parameters"
                )
            env[name] = value
        env.update(self.check_feeds(feed))
        if self.feed_targets:
            feeds = [None] * (max(self.feed_targets.values()) + 1)
            for name, col in self.feed_targets.items():
                if name not in env:
                    raise FeedError(f"the program's feed op #{col} needs {name!r}; add it to feed")
                feeds[col] = env[name]
            env[FEED_VAR_NAME] = feeds
        if self.fetch_ops:
            env[FETCH_VAR_NAME] = [None] * len(self.fetch_ops)
        try:
            self.runner.run(env)
            if self.counts_steps and self.runtime is not None:
                self.runtime.trainer.end_step()
        except (EOFException, NoDataYet):
            raise
        except Exception as e:
            for name in self.readers:  # the task whose batch this step used failed with it
                env[name].fail_current(str(e))
            raise
        # Persistable values, including those sub-blocks wrote, go back to their scope.
        for name in self.persistables:
            if name in env:
                owner = scope.owner(name) or scope
                owner._vars[name] = env[name]
        names = self.fetch_names or ([] if not self.fetch_ops else None)
        results = env[FETCH_VAR_NAME] if names is None else [self._fetch(env, n) for n in names]
        for name in self.readers:
            env[name].observe(results)  # the step's loss, reported with its task
        return [_to_numpy(v) if return_numpy else v for v in results]

    def _next_feed(self, next_feed: NextFeed) -> Callable[[], Mapping[str, Any] | None] | None:
        """What the trainer asks for the next step's feed: its variables no op computes."""
        if next_feed is None:
            return None

        def given() -> Mapping[str, Any] | None:
            feed = next_feed() if callable(next_feed) else next_feed
            return None if feed is None else {n: v for n, v in feed.items() if n not in self.computed}

        return given

    def _fetch(self, env: dict[str, Any], name: str) -> Any:
        if name not in env:
            raise ExecutionError(
                f"cannot fetch {name!r}: no op of the program computes it and it was not fed"
            )
        value = env[name]
        var = self.block.find_var(name)
        # Persistable values are updated in place by later runs; hand out a copy.
        if var is not None and var.persistable and isinstance(value, np.ndarray):
            return value.copy()
        return value


def _fits(shape: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    if len(shape) != len(declared):
        return False
    return all(d < 0 or d == s for s, d in zip(shape, declared, strict=True))


def _to_numpy(value: Any) -> Any:
    if isinstance(value, SelectedRows) or value is None:
        return value
    return np.asarray(value)


class Executor:
    """Runs programs locally. `run(startup)` then `run(main, feed, fetch_list)`,
    as in Fluid; values live in `scope` (by default the executor's own).

    `runtime_config` says how programs that take part in a job (a trainer's, a
    pserver's, one reading a dataset through a coordinator) talk to the others. Without
    one, the executor reads the environment contract the first time such a program
    runs (fluidps.executor.env.runtime_config_from_env): that is how the
    processes `fluidps launch` starts learn their timeouts, keys, coordinator and
    checkpoint settings, with scripts that only say `fluidps.Executor()`.

    `compile=True` runs each block's ops that have a compiled form as numba-compiled
    segments (fluidps.executor.compiler), their code kept in `cache_dir` (default
    FLUIDPS_CACHE_DIR, else ~/.cache/fluidps/compiled) for the next process; False
    interprets them op by op, with the same results. None (the default) compiles unless
    FLUIDPS_COMPILE=0. A fluidps.executor.compiler.Compiler sets more.
    """

    def __init__(
        self,
        place: Any = None,
        scope: Scope | None = None,
        runtime_config: RuntimeConfig | None = None,
        compile: bool | Compiler | None = None,
        cache_dir: str | None = None,
    ):
        self.place = place  # accepted for Fluid compatibility; fluidps runs on the CPU
        self.scope = scope if scope is not None else Scope()
        self._cache: weakref.WeakKeyDictionary[Program, dict[tuple, PreparedProgram]] = (
            weakref.WeakKeyDictionary()
        )
        self._runtime_config = runtime_config
        # Per pipeline program: (its revision, its LocalPipeline, the executor of its stages).
        self._pipelines: weakref.WeakKeyDictionary[Program, tuple[int, LocalPipeline, Executor]] = (
            weakref.WeakKeyDictionary()
        )
        # A launched stage's program (PipelineConfig.this_stage), its revision, and its process.
        self._stage: tuple[weakref.ref[Program], int, StageProcess] | None = None
        self._runtime: Runtime | None = None
        if compile is None:
            from fluidps.executor.env import compile_from_env

            compile = compile_from_env()
        if compile is True:
            from fluidps.executor.compiler import Compiler, ModuleCache  # only where it compiles

            compile = Compiler(ModuleCache(Path(cache_dir) if cache_dir else None))
        self.compiler: Compiler | None = compile or None

    @property
    def runtime(self) -> Runtime:
        """This executor's part in a distributed job (made on first use)."""
        if self._runtime is None:
            config = self._runtime_config
            if config is None:
                from fluidps.executor.env import runtime_config_from_env

                config = runtime_config_from_env()
            self._runtime = Runtime(config, self.compiler)
        return self._runtime

    @property
    def has_runtime(self) -> bool:
        """Whether a program that takes part in a job ran here (the runtime exists)."""
        return self._runtime is not None

    def run(
        self,
        program: Program | None = None,
        feed: Mapping[str, Any] | None = None,
        fetch_list: Sequence[FetchTarget] | None = None,
        scope: Scope | None = None,
        return_numpy: bool = True,
        *,
        next_feed: NextFeed = None,
    ) -> list[Any]:
        """Run `program` once. Returns the fetched values in `fetch_list` order
        (or the program's own fetch ops' results when it has them and no
        fetch_list is given).

        `next_feed`, the feed of the step that runs next (or a function giving it when
        asked, None while not known), saves a sync trainer a round trip a step: it
        asks its pservers for the distributed-table rows of that batch together with
        this step's parameters (see exe.run_batches). Results are the same either way."""
        if not isinstance(program, Program):
            raise ProgramError("Executor.run needs a Program (fluidps has no default program)")
        feed = dict(feed or {})
        fetch_names = [_fetch_name(t) for t in (fetch_list or [])]
        if (config := program.pipeline) is not None:  # (PipelineOptimizer's): micro-batch by micro-batch
            # through its stages here, or through this process's stage of a launched pipeline
            pipeline = self._pipeline(program) if config.this_stage is None else self._stage_process(program)
            results = pipeline.step(self.scope if scope is None else scope, feed, fetch_names)
            return [_to_numpy(v) if return_numpy else v for v in results]
        prepared = self.prepare(program, feed.keys(), fetch_names)
        return prepared.run(self.scope if scope is None else scope, feed, return_numpy, next_feed)

    def run_batches(
        self,
        program: Program,
        batches: Iterable[Mapping[str, Any]],
        fetch_list: Sequence[FetchTarget] | None = None,
        scope: Scope | None = None,
        return_numpy: bool = True,
    ) -> Iterator[list[Any]]:
        """Run `program` on each fed batch in turn, yielding each step's fetches, as
        RemoteExecutor.run_batches does. The results are those of run() on each batch;
        a trainer of a sync job with distributed tables is also told each next batch
        (run's `next_feed`: a batch is taken from `batches` one step early), so that
        its rows come with the step before's parameters: one round trip a step."""
        end = object()
        it = iter(batches)
        feed = next(it, end)
        while feed is not end:
            upcoming = next(it, end)
            yield self.run(
                program,
                feed,
                fetch_list,
                scope,
                return_numpy,
                next_feed=None if upcoming is end else upcoming,
            )
            feed = upcoming

    def prepare(self, program: Program, feed_names: Any, fetch_names: Sequence[str]) -> PreparedProgram:
        """The cached PreparedProgram for this program version and feed / fetch names."""
        key = (program.revision, tuple(sorted(feed_names)), tuple(fetch_names))
        per_program = self._cache.setdefault(program, {})
        prepared = per_program.get(key)
        if prepared is None:
            stale = [k for k in per_program if k[0] != program.revision]
            for k in stale:  # an edited program's older versions will not run again
                del per_program[k]
            if not any(k[0] == program.revision for k in per_program):
                # Once per program version, before any kernel is built: a program the
                # kernels would misread (an attribute out of its range, a block that is its
                # own parent) is refused with every problem named, not run.
                verify_program(program)
            runtime = self.runtime if needs_runtime(program) else None
            prepared = per_program[key] = PreparedProgram(program, fetch_names, runtime, self.compiler)
        return prepared

    def _pipeline(self, program: Program) -> LocalPipeline:
        """The LocalPipeline of this program version: its stages' programs, run by an
        Executor of their own whose runtime passes values between them."""
        from fluidps.executor.pipeline.local import LocalChannel, LocalPipeline
        from fluidps.transpiler.pipeline import PipelineTranspiler

        cached = self._pipelines.get(program)
        if cached is None or cached[0] != program.revision:
            verify_program(program)
            plan = PipelineTranspiler().transpile(program)
            channel = LocalChannel()
            stages = Executor(runtime_config=RuntimeConfig(), compile=self.compiler or False)
            stages.runtime.attach_stages(channel)

            def run(
                stage_program: Program, feed: Mapping[str, Any], fetch: Sequence[str], scope: Scope
            ) -> list:
                return stages.run(
                    stage_program, feed=feed, fetch_list=list(fetch), scope=scope, return_numpy=False
                )

            cached = self._pipelines[program] = (program.revision, LocalPipeline(plan, run, channel), stages)
        return cached[1]

    def _stage_process(self, program: Program) -> StageProcess:
        """This process's stage of a launched pipeline (one per Executor: it serves the
        stage's endpoint), made at the first run of its section program (transpile_for_role's)."""
        from fluidps.endpoints import zmq_address
        from fluidps.executor.pipeline.channel import RemoteStageChannel
        from fluidps.executor.pipeline.process import StageProcess, StageServer
        from fluidps.transpiler.pipeline import stage_plan

        if self._stage is not None:
            ref, revision, process = self._stage
            if ref() is program and revision == program.revision:
                return process
            raise ExecutionError(
                f"this Executor runs stage {process.plan.stage} of a launched pipeline already, from another "
                "program (or one changed since its first step): run one stage program per process"
            )
        verify_program(program)
        config = program.pipeline
        this = config.this_stage
        plan = stage_plan(program, this.stage)  # (the program is the stage's section)
        endpoints = [zmq_address(e) for e in this.endpoints]
        runtime = self.runtime
        context = runtime.context_for(endpoints[this.stage])
        channel = RemoteStageChannel(
            this.stage, endpoints, runtime.settings, context, config.num_microbatches
        )
        runtime.attach_stages(channel)
        server = StageServer(context, endpoints[this.stage], channel, runtime.settings)

        def run(stage_program: Program, feed: Mapping[str, Any], fetch: Sequence[str], scope: Scope) -> list:
            return self.run(stage_program, feed=feed, fetch_list=list(fetch), scope=scope, return_numpy=False)

        process = StageProcess(plan, config, run, channel, server)
        self._stage = (weakref.ref(program), program.revision, process)
        return process

    def pipeline_stats(self, program: Program) -> list[dict[str, Any]]:
        """Per stage of a pipeline program this executor ran: the most micro-batches'
        activations it held at once (`peak_live_microbatches`), its parameters' bytes."""
        if self._stage is not None and self._stage[0]() is program:  # a launched stage: its own
            return [self._stage[2].stats()]
        cached = self._pipelines.get(program)
        if cached is None:
            raise ExecutionError("pipeline_stats: this executor has not run that pipeline program")
        pipeline = cached[1]
        return [{**runner.stats(), "steps": pipeline.steps} for runner in pipeline.runners]

    def compiled_ops(self) -> int:
        """How many ops of the programs it ran run inside compiled segments (a block is
        compiled after a few runs: Compiler.compile_after). A pserver loop's stats count its
        optimize blocks'."""
        prepared = [p for versions in list(self._cache.values()) for p in list(versions.values())]
        stages = sum(c[2].compiled_ops() for c in list(self._pipelines.values()))  # a pipeline's stages'
        return stages + sum(p.runner.compiled_ops for p in prepared)  # (copies: a status thread asks)

    def explain(self, program: Program) -> str:
        """Which ops of `program`'s global block run compiled (with `compile=True`), in
        which segments, and why the others run interpreted."""
        from fluidps.executor.compiler import MIN_OPS, explain

        if not isinstance(program, Program):
            raise ProgramError("Executor.explain needs a Program")
        compiler = self.compiler
        return explain(
            program.global_block(), compiler.min_ops if compiler else MIN_OPS, not compiler or compiler.fuse
        )

    def stop_streams(self) -> int:
        """Drain this executor's stream readers (layers.stream_reader): each finishes the
        window in hand (its records applied, the stream's offset committed), then the next
        `run` past it raises EOFException, ending a training loop as a dataset's last
        pass does. Safe to call from a signal handler (SIGTERM). Returns how many readers
        there were."""
        if self._runtime is None or not self._runtime.has_readers:
            return 0
        return self._runtime.readers.stop_streams()

    def close(self) -> list[str]:
        """Release prepared programs and, in a distributed job, tell every pserver this
        trainer is done (Fluid's exe.close()). Returns the problems met on the way (a
        pserver already gone) instead of raising them."""
        self._cache = weakref.WeakKeyDictionary()
        if self._stage is not None:  # (before the runtime's context ends under its sockets)
            self._stage[2].close(self._runtime.settings.peer_timeout)
            self._stage = None
        problems = self._runtime.close() if self._runtime is not None else []
        self._runtime = None
        return problems
