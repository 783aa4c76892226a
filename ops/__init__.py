"""The ops: one module per family holds its definitions (slots, attributes, shape
inference, grad makers) and its numba kernels; `all_ops` lists the modules.

`REGISTRY` maps every op type to its schema and kernel builder, and appends
checked ops (`REGISTRY.append_op`); `verify(program)` checks a program against it.

May import: fluidps.errors, fluidps.ir
"""

from __future__ import annotations

from fluidps.ir import verify as _verify
from fluidps.ir.program import Program
from fluidps.ops.all_ops import REGISTRY

__all__ = ["REGISTRY", "check", "verify"]


def verify(program: Program) -> None:
    """Raise VerifyError listing every problem of `program` (see fluidps.ir.verify)."""
    _verify.verify(program, REGISTRY)


def check(program: Program) -> list[str]:
    """Every problem of `program` as a message; [] when it is well formed."""
    return _verify.check_program(program, REGISTRY)
