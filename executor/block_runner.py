"""Running one block's ops in order, with failures that name the op and its variables."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import numpy as np
from numba.core.errors import NumbaError

from fluidps.errors import EOFException, Error, ExecutionError, NoDataYet
from fluidps.executor.shape_guard import Refused, ShapeGuard, check_declared, memory_limit
from fluidps.ir.infer import VarInfo
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME, VarType, dtype_name, to_vartype
from fluidps.ops import REGISTRY
from fluidps.ops.kernel import Runner
from fluidps.ops.lowering import ShapesChanged
from fluidps.ops.runtime_api import KernelRuntime
from fluidps.ops.selected_rows import SelectedRows
from fluidps.profiling import COMMUNICATION_OPS, UNTIMED_OPS

if TYPE_CHECKING:  # the compiler room loads only where an Executor compiles
    from fluidps.executor.compiler import Compiler, Segment
    from fluidps.executor.compiler.ahead import CompileAhead


def describe(value: Any) -> str:
    if isinstance(value, VarInfo):  # a value not made yet, as shape inference says it would be
        return f"{dtype_name(value.dtype)}{list(value.shape or [])} (inferred)"
    if isinstance(value, SelectedRows):
        return repr(value)
    if isinstance(value, np.ndarray):
        return f"{value.dtype}{list(value.shape)}"
    if value is None:
        return "missing"
    return type(value).__name__


class BlockRunner:
    """The kernels of a block's ops, ready to run against an environment. Ops that take
    part in a job (send, listen_and_serv, read, ...) need the process's `runtime`. In a
    profiled process each op's time goes to its runtime's profile: communication ops'
    under their type, the others' under `compute`.

    With a `compiler` (fluidps.executor.compiler.Compiler), runs of ops that have a
    compiled form run as numba-compiled segments, one call each; `keep` names what is
    wanted after the block besides persistable state (the fetches). A block is compiled
    at its Compiler.compile_after-th run, or at its second when its code is on disk
    already (a startup program, run once, never is; interpreted runs give the same
    results); with Compiler.background, on a thread of its own, the block running
    interpreted until its code is ready. A segment that fails is run again op by
    op, so that the error names the op; one that writes persistable state in place is
    not, and its error names its ops.

    Before each op's kernel, and each compiled segment, runs, a ShapeGuard
    (fluidps.executor.shape_guard) checks the values it is given with its shape
    inference (once per shape signature): numba's kernels do no bounds checks."""

    def __init__(
        self,
        block: Block,
        runtime: KernelRuntime | None = None,
        compute: str = "compute",
        compiler: Compiler | None = None,
        keep: Collection[str] = (),
    ):
        self.block = block
        self._profile = getattr(runtime, "profile", None)
        self._compute = compute  # the profile category of its compute (a pserver's: optimize)
        self._categories = [
            None if op.type in UNTIMED_OPS else op.type if op.type in COMMUNICATION_OPS else compute
            for op in block.ops
        ]
        self.runners: list[Runner] = []
        self._limit = memory_limit()  # (read once: what one output may take)
        self._guards = [
            ShapeGuard(block, i, i + 1, op.input_arg_names, self._limit) for i, op in enumerate(block.ops)
        ]
        for i, op in enumerate(block.ops):
            # Before its builder runs: a builder may allocate a constant its attributes size.
            if (too_large := check_declared(op, block, self._limit)) is not None:
                raise ExecutionError(
                    f"block {block.idx}, op #{i} ({op.type}): cannot build its kernel: {too_large}"
                )
            try:
                self.runners.append(REGISTRY.build_kernel(op, runtime))
            except Error as e:
                raise type(e)(f"block {block.idx}, op #{i} ({op.type}): {e}") from None
            except (MemoryError, ValueError, OverflowError) as e:  # a constant too large to make
                raise ExecutionError(
                    f"block {block.idx}, op #{i} ({op.type}): cannot build its kernel "
                    f"({type(e).__name__}: {e or 'out of memory'}); check its attributes"
                ) from None
        self._compiler, self._keep = compiler, tuple(keep)
        self.segments: dict[int, Segment] = {}  # by first op, once compiled
        self._segment_guards: dict[int, ShapeGuard] = {}
        self._runs = 0
        self._compiled = False  # compiled (or tried to): see Compiler.compile_after
        self._broken: set[int] = set()  # segments numba could not compile: interpreted
        self._ahead: CompileAhead | None = None  # compiling on a thread of its own (Compiler.background)
        # Persistable variables this block writes (shared state when blocks run on threads).
        self.writes = {
            n
            for op in block.ops
            for n in op.output_arg_names
            if n != EMPTY_VAR_NAME and (v := block.find_var(n)) is not None and v.persistable
        }

    def run(self, env: Any) -> None:
        self._runs += 1
        ahead = False  # compile on a thread of its own once this run is done
        if self._compiler is not None and not self._compiled:
            # Run 2 looks for code on disk (generating the source to name it); if it is not
            # there, nothing is tried again until run compile_after, which compiles.
            if self._ahead is not None:
                if self._ahead.done:
                    self._install(self._ahead.result)
            elif self._runs >= self._compiler.compile_after:
                ahead = self._compiler.background
                if not ahead:
                    self._compile()
            elif self._runs == 2:
                self._compile(cached_only=True)
        if self.segments:
            self._run_compiled(env)
            return
        self._run_ops(env)
        if ahead:  # (after the run: the block's temporaries are in env, and their types tell)
            from fluidps.executor.compiler.ahead import CompileAhead, argument_types

            names = {n for op in self.block.ops for n in (*op.input_arg_names, *op.output_arg_names)}
            types = argument_types(env, names)
            self._ahead = CompileAhead(self.block, self._compiler, self._keep, types)

    def _run_ops(self, env: Any) -> None:
        index = 0
        try:
            if self._profile is None:
                guarded = zip(self._guards, self.runners, strict=True)
                for index, (guard, runner) in enumerate(guarded):  # noqa: B007 (index names the failing op)
                    guard.check_env(env)
                    runner(env)
            else:
                add, clock = self._profile.add, time.perf_counter
                timed = zip(self._guards, self.runners, self._categories, strict=True)
                for index, (guard, runner, category) in enumerate(timed):  # noqa: B007 (as above)
                    guard.check_env(env)
                    start = clock()
                    try:
                        runner(env)
                    finally:
                        if category is not None:
                            add(category, clock() - start)
        except (EOFException, NoDataYet):
            raise  # not failures: a reader's end of data, which training loops catch
        except Refused as e:
            raise ExecutionError(self._failure(e.index, env, e.reason)) from None
        except Exception as e:
            raise ExecutionError(self._failure(index, env, e)) from e

    def run_timed(self, env: Any) -> list[float]:
        """Run every op through its interpreted kernel, timing each (fluidps.executor.measure.op_profile):
        seconds per op, in order."""
        seconds, clock = [], time.perf_counter
        for index, (guard, runner) in enumerate(zip(self._guards, self.runners, strict=True)):
            try:
                guard.check_env(env)
                start = clock()
                runner(env)
                seconds.append(clock() - start)
            except Refused as e:
                raise ExecutionError(self._failure(e.index, env, e.reason)) from None
            except Exception as e:
                raise ExecutionError(self._failure(index, env, e)) from e
        return seconds

    @property
    def compiled_ops(self) -> int:
        """How many of the block's ops run inside compiled segments (0 until it compiles)."""
        return sum(s.stop - s.start for s in self.segments.values() if s.start not in self._broken)

    @property
    def compiling(self) -> bool:
        """Whether its code is being compiled on a thread of its own (Compiler.background)."""
        return self._ahead is not None and not self._ahead.done

    def _compile(self, cached_only: bool = False) -> None:
        """Compile the block's segments now (with `cached_only`, only when their code is
        on disk already)."""
        from fluidps.executor.compiler import compile_block

        self._install(lambda: compile_block(self.block, self._compiler, self._keep, cached_only))

    def _install(self, make: Callable[[], list[Segment] | None]) -> None:
        """Run the segments `make` returns from now on (None: none yet); a block the
        compiler cannot handle (a cache directory it cannot write, a lowering that fails)
        runs interpreted, with a warning."""
        try:
            segments = make()
            if segments is None:
                return  # (not on disk yet: compiled at run compile_after)
            self._compiled = True
            self.segments = {s.start: s for s in segments}
            self._segment_guards = {
                s.start: ShapeGuard(self.block, s.start, s.stop, s.inputs, self._limit) for s in segments
            }
        except Exception as e:  # the interpreter gives the same results: compiling is only faster
            self._compiled = True
            warnings.warn(
                f"block {self.block.idx} runs interpreted: it could not be compiled ({type(e).__name__}: {e})",
                RuntimeWarning,
                stacklevel=3,
            )

    def _run_compiled(self, env: Any) -> None:
        index, count = 0, len(self.runners)
        while index < count:
            segment = self.segments.get(index)
            if segment is None or segment.start in self._broken:
                self._run_op(index, env)
                index += 1
                continue
            if self._profile is None:
                self._run_segment(segment, env)
            else:
                start = time.perf_counter()
                try:
                    self._run_segment(segment, env)
                finally:
                    self._profile.add(self._compute, time.perf_counter() - start)
            index = segment.stop

    def _run_op(self, index: int, env: Any) -> None:
        category = self._categories[index] if self._profile is not None else None
        start = time.perf_counter() if category is not None else 0.0
        try:
            self._guards[index].check_env(env)
            self.runners[index](env)
        except (EOFException, NoDataYet):
            raise
        except Refused as e:
            raise ExecutionError(self._failure(index, env, e.reason)) from None
        except Exception as e:
            raise ExecutionError(self._failure(index, env, e)) from e
        finally:
            if category is not None:
                self._profile.add(category, time.perf_counter() - start)

    def _run_segment(self, segment: Segment, env: Any) -> None:
        try:
            for name in segment.writes_in_place:  # as the interpreter's kernels: a copy if not writable
                value = env[name]
                if not (value.flags.c_contiguous and value.flags.writeable):
                    env[name] = np.array(value, order="C")
            args = [_contiguous(env[name]) for name in segment.inputs]
        except (KeyError, AttributeError):  # a missing or odd input: the interpreter says which
            self._run_interpreted(segment, env)
            return
        guard = self._segment_guards[segment.start]
        try:
            try:  # the segment compares its inputs' shapes with those its guard checked ...
                results = segment.fn(guard.shapes, *args)
            except ShapesChanged:  # ... and new ones are checked by shape inference before it runs
                guard.check_args(args, env)
                results = segment.fn(guard.shapes, *args)
        except Refused as e:  # (the values its earlier ops would make, as inference says)
            raise ExecutionError(self._failure(e.index, {**e.made, **env}, e.reason)) from None
        except NumbaError:  # no compiled form for these inputs' types: interpreted from now on
            self._broken.add(segment.start)
            self._run_interpreted(segment, env)
            return
        except Exception as e:
            if segment.writes_in_place:
                raise ExecutionError(
                    f"block {self.block.idx}, ops #{segment.start}..#{segment.stop - 1} "
                    f"({', '.join(op.type for op in self.block.ops[segment.start : segment.stop])}; compiled) "
                    f"failed: {_reason(e)}"
                ) from e
            self._run_interpreted(segment, env)  # it raises, naming the op; or it is a case only it handles
            return
        for name, value in zip(segment.outputs, results, strict=True):
            env[name] = value

    def _run_interpreted(self, segment: Segment, env: Any) -> None:
        for index in range(segment.start, segment.stop):
            self._run_op(index, env)

    def _failure(self, index: int, env: Any, error: Exception) -> str:
        op = self.block.ops[index]

        def slots(mapping: dict[str, list[str]]) -> str:
            return " ".join(
                f"{s}={[f'{n} {describe(env.get(n))}' for n in names]}"
                for s, names in sorted(mapping.items())
            )

        if not isinstance(error, Error):  # numpy's or numba's words: ours, where the shapes tell
            error = _shape_problem(op, env) or (_reason(error) if isinstance(error, MemoryError) else error)
        return (
            f"block {self.block.idx}, op #{index} ({op.type}) failed: {error}\n  inputs:  {slots(op.inputs)}\n"
            f"  outputs: {', '.join(op.output_arg_names)}"
        )


def _reason(error: BaseException) -> str:
    """An error that is not fluidps's, in words (a MemoryError's own are none)."""
    if isinstance(error, MemoryError):
        said = f": {error}" if str(error) else ""
        return (
            f"out of memory (MemoryError{said}): its inputs or attributes ask for more than this machine has"
        )
    return str(error) if isinstance(error, Error) else f"{type(error).__name__}: {error}"


def _contiguous(value: Any) -> Any:
    """Compiled code reshapes its inputs: it takes C-contiguous arrays."""
    if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
        return np.ascontiguousarray(value)
    return value


def _shape_problem(op: Any, env: Any) -> str | None:
    """Why the values `op` was given at run time do not fit together, as its shape
    inference says with their actual shapes (the declared ones let batch sizes vary),
    or None when inference finds nothing wrong."""
    block = op.block

    def lookup(name: str) -> VarInfo | None:
        value, var = env.get(name), block.find_var(name)
        info = None if var is None else VarInfo.of(var)
        if isinstance(value, np.ndarray):
            dtype = info.dtype if info is not None else None
            with contextlib.suppress(Exception):
                dtype = to_vartype(value.dtype)
            kind = info.type if info is not None else VarType.LOD_TENSOR
            return VarInfo(name, kind, dtype, tuple(value.shape), info.lod_level if info else 0)
        return info

    try:
        REGISTRY.infer(op, lookup)
    except Error as e:
        return f"{e}: the values it was given at run time do not fit together; check the feeds' shapes"
    except Exception:  # inference itself could not read these values: keep the kernel's error
        return None
    return None
