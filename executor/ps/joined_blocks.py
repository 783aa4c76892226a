"""Optimize blocks that run together as one block.

A pserver applies the gradients of one message at once (sync: those every trainer has
sent; async: those the message brought). Run one block at a time, each update pays a
call of its own (and a lone `adam` is too short to compile); joined, the updates of a
message are one compiled call, a loop over the parameters
(fluidps.executor.compiler.batching), as in local training. The blocks are independent
(each writes only its own slice and its state), so any order that keeps each block's
own ops in order gives each block's results bit for bit: the joined block takes every
block's gradient off its queue first (an async block's leading `dequeue`), then runs
the rest of each block in turn, so the updates sit side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fluidps.errors import ExecutionError
from fluidps.ir.program import Block, Program

if TYPE_CHECKING:
    from fluidps.executor.block_runner import BlockRunner

_TAKES = frozenset({"dequeue"})  # ops that take a block's input from the pserver: they go first

# Distinct sets of blocks kept joined. A job's messages bring the same sets step after
# step; with many trainers arriving in varying order there could be many, so past this
# many the rest run block by block.
JOINED_LIMIT = 64


def joined_block(program: Program, ids: Sequence[int]) -> Block | None:
    """A block holding the ops of blocks `ids`, in that order (their leading dequeues
    first), with their variables, in a copy of `program` (which is not changed); its
    parent is the blocks' parent.
    None when the blocks cannot share one block: different parents, or a variable that
    two of them declare."""
    parents = {program.block(i).parent_idx for i in ids}
    if len(parents) != 1:
        return None
    copy = program.clone()
    joined = Block(copy, len(copy.blocks), parents.pop())
    takes, rest, declared = [], [], {}
    for i in ids:
        block = copy.block(i)
        for name, var in block.vars.items():
            if name in declared:
                return None
            declared[name] = var._copy_to(joined)
        ops = [op._copy_to(joined) for op in block.ops]
        lead = next((k for k, op in enumerate(ops) if op.type not in _TAKES), len(ops))
        takes += ops[:lead]
        rest += ops[lead:]
    joined.vars = declared
    joined.ops = takes + rest
    copy.blocks.append(joined)
    return joined


class JoinedBlocks:
    """Runs sets of a program's blocks, each set as one joined block (built at its first
    use with `runner_for`), or block by block where they cannot be joined."""

    def __init__(
        self, program: Program, runners: dict[int, BlockRunner], runner_for: Callable[[Block], BlockRunner]
    ):
        self._program = program
        self._runners = runners  # each block's own
        self._runner_for = runner_for
        self._joined: dict[tuple[int, ...], BlockRunner | None] = {}

    def run(self, ids: Sequence[int], env: Any) -> None:
        """Run blocks `ids` on `env`: joined as one block when they can be."""
        key = tuple(ids)
        if len(key) == 1:
            self._runners[key[0]].run(env)
            return
        if key not in self._joined and len(self._joined) < JOINED_LIMIT:
            block = joined_block(self._program, key)
            self._joined[key] = None if block is None else self._runner_for(block)
        runner = self._joined.get(key)
        if runner is None:
            for i in key:
                self._runners[i].run(env)
            return
        try:
            runner.run(env)
        except ExecutionError as e:  # its block index is the joined one's: say which they are
            raise ExecutionError(f"optimize blocks {list(key)}, run joined as one: {e}") from e

    @property
    def sets(self) -> list[list[int]]:
        """The sets of blocks run joined so far (those that could be joined)."""
        joined = list(self._joined.items())  # a copy: the optimize thread may add one meanwhile
        return [list(key) for key, runner in joined if runner is not None]

    @property
    def runners(self) -> list[BlockRunner]:
        """The joined blocks' runners built so far."""
        return [r for r in list(self._joined.values()) if r is not None]
