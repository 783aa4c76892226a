"""The kernel contract.

A kernel is registered per op type as a *builder*: given a `KernelOp` (the
op's variable names and attribute values, defaults filled in) it returns a
`Runner`, a function of the environment (variable name -> value) that reads
its inputs and stores its outputs. Everything that depends only on the op is
resolved once, when the executor prepares the program; the runner does only
the per-step work, typically one call into a numba-compiled function.

Kernels that take part in a job (communication and reader ops) also get the
process's runtime, typed by `fluidps.ops.runtime_api.KernelRuntime`, as
`KernelOp.runtime`; the executor supplies it when it builds them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.operator import Operator
from fluidps.ir.opschema import OpSchema
from fluidps.ir.types import EMPTY_VAR_NAME
from fluidps.ir.variable import Variable
from fluidps.ops.runtime_api import KernelRuntime

Env = dict[str, Any]
Runner = Callable[[Env], None]


class KernelOp:
    """What a kernel builder sees of one op."""

    def __init__(self, op: Operator, schema: OpSchema, runtime: KernelRuntime | None = None):
        self.op = op
        self.type = op.type
        self._schema = schema
        self._runtime = runtime
        # A kernel is built for its op as it is (its attributes read once, too): optimizers
        # look their slots up every run, so the names are kept once found.
        self._input: dict[str, str] = {}
        self._output: dict[str, str | None] = {}

    @property
    def runtime(self) -> KernelRuntime:
        """The process's part in a job, for kernels that talk to other processes or read datasets."""
        if self._runtime is None:
            raise ExecutionError(
                f"op {self.type!r} takes part in a distributed job or reads a dataset: build it with a "
                "runtime (fluidps.Executor gives one to the programs that need it)"
            )
        return self._runtime

    def inputs(self, slot: str) -> list[str]:
        return self.op.input(slot)

    def outputs(self, slot: str) -> list[str]:
        return self.op.output(slot)

    def has_input(self, slot: str) -> bool:
        return any(n != EMPTY_VAR_NAME for n in self.op.input(slot))

    def has_output(self, slot: str) -> bool:
        return any(n != EMPTY_VAR_NAME for n in self.op.output(slot))

    def input(self, slot: str) -> str:
        """The one variable of an input slot."""
        if slot not in self._input:
            self._input[slot] = self._one(self.op.input(slot), "input", slot)
        return self._input[slot]

    def output(self, slot: str) -> str | None:
        """The one variable of an output slot; None when the output is not wanted."""
        if slot not in self._output:
            names = [n for n in self.op.output(slot) if n != EMPTY_VAR_NAME]
            self._output[slot] = self._one(names, "output", slot) if names else None
        return self._output[slot]

    def attr(self, name: str) -> Any:
        return self._schema.attr_value(self.op, name)

    def var(self, name: str) -> Variable | None:
        """The declared variable (shape, dtype) behind a name."""
        return None if self.op.block is None else self.op.block.find_var(name)

    def _one(self, names: list[str], kind: str, slot: str) -> str:
        if len(names) != 1 or names[0] == EMPTY_VAR_NAME:
            raise ExecutionError(f"op {self.type!r}: {kind} {slot} needs exactly one variable, got {names}")
        return names[0]


KernelBuilder = Callable[[KernelOp], Runner]


def contiguous(x: Any, dtype: Any = None) -> np.ndarray:
    """A C-contiguous array (a copy only when needed). Unlike np.ascontiguousarray,
    a 0-d array stays 0-d: full reductions and scalars keep their shape ()."""
    return np.asarray(x, dtype=dtype, order="C")
