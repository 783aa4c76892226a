"""A pserver's sub-blocks, each with its runner, and the locks that keep readers off them.

Per gradient, its optimize block and (async / SSP) its receive block, which enqueues
the gradient; the learning-rate schedule's block; the optimize blocks due together run
joined as one (joined_blocks.py). In async and SSP modes an optimize thread runs the
optimize blocks while the loop answers GETs: each optimize block has a lock, which the
thread holds while the block runs and a reader of a variable the block writes takes to
copy it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fluidps.executor.ps.joined_blocks import JoinedBlocks
from fluidps.executor.ps.layered_env import LayeredEnv
from fluidps.executor.ps.serve_spec import ServeSpec
from fluidps.ir.program import Block, Program

if TYPE_CHECKING:
    from fluidps.executor.block_runner import BlockRunner


class OptimizeBlocks:
    def __init__(self, program: Program, spec: ServeSpec, runner_for: Callable[[Block], BlockRunner]):
        self._grad_blocks = spec.grad_blocks
        self._queue_blocks = spec.queue_blocks
        ids = set(spec.grad_blocks.values()) | set(spec.queue_blocks.values())
        self._runners = {i: runner_for(program.block(i)) for i in ids}
        self._joined = JoinedBlocks(program, self._runners, runner_for)  # a message's blocks, run as one
        self._lr = runner_for(program.block(spec.lr_block)) if spec.lr_block is not None else None
        self.locks = {i: threading.Lock() for i in self._runners}
        self._lock_of = {name: self.locks[i] for i in self.locks for name in self._runners[i].writes}

    def run(self, grads: Sequence[str], env: dict[str, Any]) -> None:
        """Run the optimize blocks of `grads` on `env`, joined as one (the loop's thread, sync)."""
        if grads:
            self._joined.run([self._grad_blocks[g] for g in grads], env)

    def run_locked(self, grads: Sequence[str], env: dict[str, Any]) -> None:
        """Run the optimize blocks of `grads` joined as one, holding their locks, with their
        temporaries kept off `env` (an optimize thread beside the loop)."""
        blocks = [self._grad_blocks[g] for g in grads]
        with contextlib.ExitStack() as held:
            for block in sorted(set(blocks)):  # (a reader holds one lock at a time: no deadlock)
                held.enter_context(self.locks[block])
            writes = set().union(*(self._runners[b].writes for b in blocks))
            self._joined.run(blocks, LayeredEnv(env, writes))

    def enqueue(self, grad: str, value: Any) -> None:
        """Run `grad`'s receive block on `value`: it puts the gradient in its queue."""
        self._runners[self._queue_blocks[grad]].run({grad: value})

    def advance_learning_rate(self, env: dict[str, Any], steps: int = 1) -> None:
        """Run the learning-rate schedule's block `steps` times (nothing without one)."""
        for _ in range(steps if self._lr is not None else 0):
            self._lr.run(env)

    def locked(self, name: str) -> contextlib.AbstractContextManager:
        """Hold the lock of the optimize block that writes `name` (if one does)."""
        lock = self._lock_of.get(name)
        return lock if lock is not None else contextlib.nullcontext()

    @property
    def runners(self) -> list[BlockRunner]:
        """Every block's runner built so far (joined blocks' too): for the stats."""
        return [*self._runners.values(), *self._joined.runners, *([self._lr] if self._lr is not None else [])]

    @property
    def joined_sets(self) -> list[list[int]]:
        return self._joined.sets
