"""What a listen_and_serv op asks of its pserver, read once into a frozen ServeSpec.

The pserver reads its op's attributes only here. The op's definition already checks
each value on its own (fluidps.ops.distributed: Fanin >= 1, a known mode, checkpoint
intervals); this checks what ties them to each other and to the program: every
"gradient:block" entry parses, names a sub-block and no gradient twice; an async or
SSP pserver has a receive block for every gradient; the learning-rate block exists;
the distributed tables are persistable variables here; the checkpoint placements
line up. An error names the attribute and the pserver.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fluidps.errors import ProgramError
from fluidps.io import checkpoints as ckpt
from fluidps.ir.operator import Operator
from fluidps.ir.program import Program
from fluidps.ir.types import DISTRIBUTED_MODES
from fluidps.ops import REGISTRY


@dataclass(frozen=True)
class CheckpointSpec:
    """Where and how often the program says to checkpoint (a job's CheckpointOverrides
    replace these: fluidps.executor.ps.checkpointer), and what each persistable here is
    of the original program."""

    directory: str  # "": no checkpoints
    every_steps: int
    every_seconds: float
    keep: int
    base_every: int
    placements: Mapping[str, ckpt.Placement]


@dataclass(frozen=True)
class ServeSpec:
    """What one listen_and_serv op asks of its pserver (ServeSpec.of reads and checks it)."""

    endpoint: str
    pserver_id: int
    mode: str  # "sync", "async" or "ssp"
    trainers: int  # the op's Fanin
    staleness: int  # SSP's bound
    grad_blocks: Mapping[str, int]  # gradient -> its optimize block, in block order
    queue_blocks: Mapping[str, int]  # async / SSP: gradient -> its receive (enqueue) block
    lr_block: int | None  # the learning-rate schedule's block
    tables: frozenset[str]  # distributed tables' blocks: trainers PREFETCH their rows
    # Sync: where each trainer's gradient of a slice lands, `<grad>.trainer_<i>` (the
    # optimize block sums the copies), or the gradient itself in a job of one trainer.
    copies: Mapping[str, tuple[str, ...]]
    checkpoints: CheckpointSpec

    @property
    def name(self) -> str:
        return f"pserver {self.pserver_id} ({self.endpoint})"

    @classmethod
    def of(cls, op: Operator) -> ServeSpec:
        """The spec of listen_and_serv `op` (its defaults where an attribute is missing)."""
        schema = REGISTRY.schema("listen_and_serv")

        def attr(name: str) -> Any:
            return schema.attr_value(op, name)

        program = op.block.program
        name = f"pserver {attr('pserver_id')} ({attr('endpoint')})"
        problem = _Problems(name)
        mode = DISTRIBUTED_MODES.get(attr("distributed_mode"))
        problem.unless(
            mode is not None, "distributed_mode", f"{attr('distributed_mode')} is not a known mode"
        )
        trainers = attr("Fanin")
        problem.unless(trainers >= 1, "Fanin", f"{trainers} trainers: a job has at least one")
        problem.unless(attr("staleness") >= 0, "staleness", "must be >= 0")
        grad_blocks = _block_pairs(program, attr("grad_to_block_id"), "grad_to_block_id", problem)
        queue_blocks = _block_pairs(
            program, attr("grad_to_queue_block_id"), "grad_to_queue_block_id", problem
        )
        unknown = sorted(set(queue_blocks) - set(grad_blocks))
        problem.unless(not unknown, "grad_to_queue_block_id", f"gradients {unknown} have no optimize block")
        if mode in ("async", "ssp"):
            missing = sorted(set(grad_blocks) - set(queue_blocks))
            problem.unless(
                not missing, "grad_to_queue_block_id", f"{mode}: gradients {missing} have no block"
            )
        lr = attr("lr_decay_block_id")
        problem.unless(lr == -1 or 0 < lr < len(program.blocks), "lr_decay_block_id", f"{lr} is not a block")
        declared = program.global_block().vars
        tables = frozenset(attr("distributed_tables"))
        unserved = sorted(t for t in tables if t not in declared or not declared[t].persistable)
        problem.unless(not unserved, "distributed_tables", f"{unserved} are not persistable variables here")
        copies = {
            g: tuple(c if (c := f"{g}.trainer_{t}") in declared else g for t in range(trainers))
            for g in grad_blocks
        }
        return cls(
            attr("endpoint"),
            attr("pserver_id"),
            mode,
            trainers,
            attr("staleness"),
            MappingProxyType(grad_blocks),
            MappingProxyType(queue_blocks),
            lr if lr >= 0 else None,
            tables,
            MappingProxyType(copies),
            _checkpoints(attr, problem),
        )


class _Problems:
    """Raises the ProgramError of a pserver's attribute that fails a check."""

    def __init__(self, pserver: str):
        self.pserver = pserver

    def unless(self, ok: bool, attribute: str, what: str) -> None:
        if not ok:
            raise ProgramError(f"{self.pserver}: listen_and_serv's attribute {attribute}: {what}")


def _block_pairs(program: Program, entries: list[str], attribute: str, problem: _Problems) -> dict[str, int]:
    """{gradient: block} of "gradient:block" entries, in block order; each block a sub-block."""
    out: dict[str, int] = {}
    for entry in entries:
        grad, _, idx = entry.rpartition(":")
        ok = bool(grad) and idx.isdigit()
        problem.unless(ok, attribute, f"{entry!r} is not 'gradient:block'")
        problem.unless(grad not in out, attribute, f"gradient {grad!r} is listed twice")
        problem.unless(0 < int(idx) < len(program.blocks), attribute, f"{entry!r}: no sub-block {idx}")
        out[grad] = int(idx)
    return dict(sorted(out.items(), key=lambda item: item[1]))


def _checkpoints(attr: Any, problem: _Problems) -> CheckpointSpec:
    names, origins = attr("checkpoint_vars"), attr("checkpoint_origins")
    offsets, heights = attr("checkpoint_offsets"), attr("checkpoint_origin_rows")
    heights = heights or [-1] * len(names)  # programs transpiled before heights were recorded
    for attribute, values in (
        ("checkpoint_origins", origins),
        ("checkpoint_offsets", offsets),
        ("checkpoint_origin_rows", heights),
    ):
        problem.unless(
            len(values) == len(names), attribute, f"{len(values)} entries for {len(names)} checkpoint_vars"
        )
    placements = {
        n: ckpt.Placement(o, None if off < 0 else off, None if rows < 0 else rows)
        for n, o, off, rows in zip(names, origins, offsets, heights, strict=True)
    }
    return CheckpointSpec(
        attr("checkpoint_dir"),
        attr("checkpoint_every_steps"),
        attr("checkpoint_every_seconds"),
        attr("checkpoint_keep"),
        attr("checkpoint_base_every"),
        MappingProxyType(placements),
    )
