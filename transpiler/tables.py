"""Distributed lookup tables: the embedding tables that never leave the pservers.

A table is distributed when one of its lookups says `is_distributed=True` (Fluid's
flag), or when it is a sparse table (its gradient is a SelectedRows) of at least
`DistributeTranspilerConfig.distributed_table_min_rows` rows. Its rows are cut into
blocks over the pservers like any sliced parameter: id i belongs to the block whose
row range holds it, whatever ids a batch brings. On the trainers each lookup becomes
a `distributed_lookup_table` op, which asks each owning pserver for the rows of the
batch's unique ids, and the gradient goes back as a SelectedRows of those rows only;
the table is in no trainer's `recv` and no trainer's startup.

A hashed table (layers.sparse_embedding, read by lookup_sparse_table) is always
distributed: it is sharded over every pserver by id (id i on pserver mix64(i) mod K),
each shard growing with the ids it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from fluidps.errors import UnsupportedError
from fluidps.ir.program import Program
from fluidps.ir.types import VarType
from fluidps.transpiler.analysis import ProgramRoles
from fluidps.transpiler.config import DistributeTranspilerConfig

LOOKUPS = ("lookup_table", "lookup_table_v2")
HASHED_LOOKUP = "lookup_sparse_table"
_READERS = (*LOOKUPS, HASHED_LOOKUP)
_READER_GRADS = tuple(f"{t}_grad" for t in _READERS)


@dataclass(frozen=True)
class DistributedTable:
    param: str
    rows: int
    width: int
    lookups: tuple[int, ...]  # indices of its lookup ops in block 0
    marked: bool  # a lookup says is_distributed (else: chosen by distributed_table_min_rows)
    hashed: bool = False  # rows created by id (sparse_embedding); `rows` is -1


def find_distributed_tables(
    program: Program, roles: ProgramRoles, config: DistributeTranspilerConfig
) -> dict[str, DistributedTable]:
    """The program's distributed tables, by parameter name. A table marked
    is_distributed that cannot be one raises UnsupportedError saying why; a table
    only large enough stays an ordinary parameter then."""
    block = program.global_block()
    lookups: dict[str, list[int]] = {}
    for i, op in enumerate(block.ops):
        if op.type in _READERS:
            lookups.setdefault(op.input("W")[0], []).append(i)
    grads = {u.param: u.grad for u in roles.updates}
    tables = {}
    for param, indices in lookups.items():
        hashed = {block.ops[i].type == HASHED_LOOKUP for i in indices}
        if hashed == {True}:
            problem = _why_not(program, roles, param, grads.get(param))
            if problem is not None:
                raise UnsupportedError(f"hashed table {param!r} lives on the pservers, but {problem}")
            tables[param] = DistributedTable(param, -1, block.var(param).shape[1], tuple(indices), True, True)
            continue
        if len(hashed) > 1:
            raise UnsupportedError(f"table {param!r} is read both as a hashed table and as a fixed one")
        marked = any(block.ops[i].attr("is_distributed") for i in indices)
        var = block.var(param)
        rows = var.shape[0] if var.shape else -1
        large = config.distributed_table_min_rows > 0 and rows >= config.distributed_table_min_rows
        if not (marked or large):
            continue
        problem = _why_not(program, roles, param, grads.get(param))
        if problem is None:
            tables[param] = DistributedTable(param, rows, var.shape[1], tuple(indices), marked)
        elif marked:
            raise UnsupportedError(f"embedding table {param!r} is marked is_distributed, but {problem}")
    return tables


def _why_not(program: Program, roles: ProgramRoles, param: str, grad: str | None) -> str | None:
    """Why `param` cannot be a distributed table (None: it can)."""
    block = program.global_block()
    var = block.var(param)
    if len(var.shape) != 2 or var.shape[1] < 1 or (var.shape[0] < 1 and var.type != VarType.SELECTED_ROWS):
        return f"it is not a [rows, width] table (shape {list(var.shape)})"
    moved = roles.pserver_ops
    for b in program.blocks:
        for i, op in enumerate(b.ops):
            if param not in op.input_arg_names + op.output_arg_names:
                continue
            if b.idx == 0 and i in moved:
                continue  # its optimizer ops: they move to the pservers with the table
            if op.type in _READERS + _READER_GRADS and op.input("W") == [param] and b.idx == 0:
                continue
            return (
                f"op {op.type!r} (block {b.idx}, op {i}) uses it: a distributed table can only be "
                "read by lookups in the main block (trainers never hold it)"
            )
    if grad is None:
        return "no optimizer updates it: a distributed table lives on the pservers that train it"
    if block.var(grad).type != VarType.SELECTED_ROWS:
        return (
            "its gradient is dense (a table-sized tensor each step): give its lookups is_sparse=True "
            "so that only the looked-up rows travel"
        )
    return None
