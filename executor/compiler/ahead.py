"""Compiling a block on a thread of its own while the block keeps running interpreted.

A parameter server's loop answers every trainer, heartbeats included, between the
optimize blocks it runs: a compile of several seconds on that thread would stall the
whole job and, on a loaded machine, outlast the trainers' peer timeout, so that they
take a busy pserver for a dead one. Compiled ahead, the block runs interpreted (the
same results) until its machine code is ready, and the loop never stops answering.

numba compiles a function at its first call, for the types of that call's arguments;
here each segment is compiled for the types the block's variables had at the run
that made the compile due, so that the first compiled call finds its code ready. A
type that differs later only costs that call a compile of its own, as it would have.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import numba
import numpy as np
from numba.core.errors import NumbaError

from fluidps.executor.compiler.segments import Compiler, Segment, compile_block
from fluidps.ir.program import Block

SHAPES = numba.types.Array(numba.types.int64, 1, "C")  # a segment's first argument (ShapeGuard.shapes)


def argument_types(env: Any, names: Iterable[str]) -> dict[str, Any]:
    """numba's types of the arrays `env` holds under `names`, as a compiled segment
    takes them: C-contiguous (the block runner passes a copy of any other layout)."""
    types = {}
    for name in names:
        value = env.get(name)
        if isinstance(value, np.ndarray):
            with contextlib.suppress(ValueError, NumbaError):  # (a dtype numba has no type for)
                types[name] = numba.typeof(value).copy(layout="C")
    return types


def compile_segments(
    block: Block, compiler: Compiler, keep: Collection[str], types: Mapping[str, Any]
) -> list[Segment]:
    """compile_block, with each segment's machine code made now for `types` where they
    name all its inputs (otherwise at its first call, as always)."""
    segments = compile_block(block, compiler, keep)
    for segment in segments:
        if all(name in types for name in segment.inputs):
            # A segment numba cannot compile for these types fails its first call the same
            # way, and the runner takes it from there (it runs interpreted).
            with contextlib.suppress(NumbaError):
                segment.fn.compile((SHAPES, *(types[name] for name in segment.inputs)))
    return segments


class CompileAhead:
    """`block`'s segments, compiled on a daemon thread started now (a process that ends
    meanwhile has no use for them). `done` once they are ready or compiling failed;
    `result()` then returns them or raises what compiling raised."""

    def __init__(self, block: Block, compiler: Compiler, keep: Collection[str], types: Mapping[str, Any]):
        self._segments: list[Segment] | None = None
        self._error: Exception | None = None
        self._thread = threading.Thread(
            target=self._work,
            args=(block, compiler, keep, types),
            name=f"compile block {block.idx}",
            daemon=True,
        )
        self._thread.start()

    def _work(
        self, block: Block, compiler: Compiler, keep: Collection[str], types: Mapping[str, Any]
    ) -> None:
        try:
            self._segments = compile_segments(block, compiler, keep, types)
        except Exception as e:  # handed to the runner's thread, which warns and interprets
            self._error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self) -> list[Segment]:
        if self._error is not None:
            raise self._error
        assert self._segments is not None, "result() before done"
        return self._segments

    def join(self, timeout: float | None = None) -> bool:
        """Wait at most `timeout` seconds for it to be done; whether it is."""
        self._thread.join(timeout)
        return self.done
