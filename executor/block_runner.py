"""Running one block's ops in order, with failures that name the op and its variables."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np

from fluidps.errors import EOFException, Error, ExecutionError, NoDataYet
from fluidps.ir.infer import VarInfo
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME, VarType, to_vartype
from fluidps.ops import REGISTRY
from fluidps.ops.kernel import Runner
from fluidps.ops.runtime_api import KernelRuntime
from fluidps.ops.selected_rows import SelectedRows
from fluidps.profiling import COMMUNICATION_OPS, UNTIMED_OPS


def describe(value: Any) -> str:
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
    under their type, the others' under `compute`."""

    def __init__(self, block: Block, runtime: KernelRuntime | None = None, compute: str = "compute"):
        self.block = block
        self._profile = getattr(runtime, "profile", None)
        self._categories = [
            None if op.type in UNTIMED_OPS else op.type if op.type in COMMUNICATION_OPS else compute
            for op in block.ops
        ]
        self.runners: list[Runner] = []
        for i, op in enumerate(block.ops):
            try:
                self.runners.append(REGISTRY.build_kernel(op, runtime))
            except Error as e:
                raise type(e)(f"block {block.idx}, op #{i} ({op.type}): {e}") from None
            except (MemoryError, ValueError, OverflowError) as e:  # a constant too large to make
                raise ExecutionError(
                    f"block {block.idx}, op #{i} ({op.type}): cannot build its kernel "
                    f"({type(e).__name__}: {e or 'out of memory'}); check its attributes"
                ) from None
        # Persistable variables this block writes (shared state when blocks run on threads).
        self.writes = {
            n
            for op in block.ops
            for n in op.output_arg_names
            if n != EMPTY_VAR_NAME and (v := block.find_var(n)) is not None and v.persistable
        }

    def run(self, env: Any) -> None:
        index = 0
        try:
            if self._profile is None:
                for index, runner in enumerate(self.runners):  # noqa: B007 (index names the failing op)
                    runner(env)
            else:
                add, clock = self._profile.add, time.perf_counter
                timed = zip(self.runners, self._categories, strict=True)
                for index, (runner, category) in enumerate(timed):  # noqa: B007 (as above)
                    start = clock()
                    try:
                        runner(env)
                    finally:
                        if category is not None:
                            add(category, clock() - start)
        except (EOFException, NoDataYet):
            raise  # not failures: a reader's end of data, which training loops catch
        except Exception as e:
            raise ExecutionError(self._failure(index, env, e)) from e

    def _failure(self, index: int, env: Any, error: Exception) -> str:
        op = self.block.ops[index]

        def slots(mapping: dict[str, list[str]]) -> str:
            return " ".join(
                f"{s}={[f'{n} {describe(env.get(n))}' for n in names]}"
                for s, names in sorted(mapping.items())
            )

        if not isinstance(error, Error):  # numpy's or numba's words: ours, where the shapes tell
            error = _shape_problem(op, env) or error
        return (
            f"block {self.block.idx}, op #{index} ({op.type}) failed: {error}\n  inputs:  {slots(op.inputs)}\n"
            f"  outputs: {', '.join(op.output_arg_names)}"
        )


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
