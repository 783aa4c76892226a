"""PipelineOptimizer: an optimizer whose program trains as a pipeline of stages.

    with fluidps.device_guard("stage:0"):
        h = layers.fc(x, 256, act="relu")
    with fluidps.device_guard("stage:1"):
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 10), y))
    fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.Adam(1e-3), num_microbatches=4).minimize(loss)

`minimize` places every forward op on a stage (fluidps.ir.stages), builds the
usual backward and update ops (grad ops carry their forward op's op_device),
writes each op's stage into its op_device, and records the PipelineConfig on
the program. The program stays an ordinary training program: an Executor runs
it micro-batch by micro-batch through its stages (the same results as the
whole batch at once), fluidps.PipelineTranspiler cuts it into one program per
stage, and a RemoteExecutor runs those as processes.

With `num_stages` and forward ops that no device_guard placed, `minimize` places
those by a cost model (fluidps.transpiler.partition): where the predicted step of a
`batch_size`-row mini-batch is least, every guarded op kept on its stage:

    opt = fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.Adam(1e-3), num_microbatches=8, num_stages=2)
    opt.minimize(loss)
    print(opt.placement.summary())
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fluidps.errors import BuilderError
from fluidps.ir.devices import PipelineConfig, stage_device
from fluidps.ir.operator import Operator
from fluidps.ir.program import Program
from fluidps.ir.stages import assign_stages, explicit_stage, phase
from fluidps.ir.types import OP_DEVICE_ATTR
from fluidps.ir.variable import Parameter, Variable
from fluidps.optimizer.base import Optimizer
from fluidps.transpiler.cost_model import CostModel
from fluidps.transpiler.partition import Placement, complete_stages, place_pipeline, write_stages

_DEFAULT_MICRO_ROWS = 32  # a micro-batch's rows placement assumes when no batch_size is given


class PipelineOptimizer:
    """`inner` (SGD, Adam, ...) applied once a mini-batch to the sum of the gradients
    of its `num_microbatches` micro-batches (the loss gradient scaled by
    1 / num_microbatches), on `schedule_mode` "1F1B" (the default) or "F-then-B"
    (GPipe). `num_stages`: how many stages the program must have (default: as
    many as its device_guards name); with one, a pipeline is gradient accumulation.

    Forward ops without a device_guard, when `num_stages` is given, are placed by
    `cost_model` (default: CostModel.load(), this machine's calibration and op profile)
    for mini-batches of `batch_size` rows (default 32 per micro-batch), each stage
    keeping at most `memory_cap` bytes when given; `placement` then holds the plan."""

    def __init__(
        self,
        optimizer: Optimizer,
        num_microbatches: int = 1,
        schedule_mode: str = "1F1B",
        num_stages: int | None = None,
        batch_size: int | None = None,
        cost_model: CostModel | None = None,
        memory_cap: int | None = None,
    ):
        if not isinstance(optimizer, Optimizer):
            raise BuilderError(
                f"PipelineOptimizer wraps an optimizer (SGD, Adam, ...), got {type(optimizer).__name__}"
            )
        PipelineConfig(
            num_microbatches, schedule_mode, 1 if num_stages is None else num_stages
        )  # checked now
        self.inner = optimizer
        self.num_microbatches = num_microbatches
        self.schedule_mode = schedule_mode
        self.num_stages = num_stages
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise BuilderError(
                f"batch_size must be a positive integer (a mini-batch's rows), got {batch_size!r}"
            )
        if memory_cap is not None and (
            isinstance(memory_cap, bool) or not isinstance(memory_cap, int) or memory_cap < 1
        ):
            raise BuilderError(f"memory_cap must be a positive number of bytes, got {memory_cap!r}")
        self.batch_size = batch_size if batch_size is not None else _DEFAULT_MICRO_ROWS * num_microbatches
        self.cost_model = cost_model
        self.memory_cap = memory_cap
        self.placement: Placement | None = None  # what minimize chose, when it placed ops

    def minimize(
        self,
        loss: Variable,
        startup_program: Program | None = None,
        parameter_list: Sequence[Parameter | str] | None = None,
        no_grad_set: Iterable[Variable | str] | None = None,
    ) -> tuple[list[Operator], list[tuple[Parameter, Variable]]]:
        """As Optimizer.minimize, on a program whose ops are placed on stages."""
        program = loss.block.program
        if program.pipeline is not None:
            raise BuilderError(
                "PipelineOptimizer.minimize: the program is a pipeline already (minimize once)"
            )
        block = program.global_block()
        if self.num_stages is None and not any(
            op.attr(OP_DEVICE_ATTR) for op in block.ops if op.has_attr(OP_DEVICE_ATTR)
        ):
            raise BuilderError(
                "PipelineOptimizer: no op of the program is placed on a stage, so it would run as one stage: "
                "build its layers inside fluidps.device_guard('stage:k'), or say num_stages=1 for gradient "
                "accumulation alone"
            )
        if self._places(program):
            result = self.inner.minimize(loss, startup_program, parameter_list, no_grad_set)
            self._place(program)
        else:
            forward = assign_stages(program, self.num_stages)
            for op, stage in zip(block.ops, forward.op_stages, strict=True):
                op.set_attr(OP_DEVICE_ATTR, stage_device(stage))  # (backward copies it onto the grad ops)
            result = self.inner.minimize(loss, startup_program, parameter_list, no_grad_set)
        stages = complete_stages(program, self.num_stages)
        program.pipeline = PipelineConfig(self.num_microbatches, self.schedule_mode, stages)
        return result

    def _places(self, program: Program) -> bool:
        """Whether minimize places ops by cost: stages asked for, and forward ops without one."""
        if self.num_stages is None or self.num_stages == 1:
            return False
        ops = program.global_block().ops
        return any(explicit_stage(op, i) is None for i, op in enumerate(ops) if phase(op) == "forward")

    def _place(self, program: Program) -> None:
        """Give the unplaced forward ops, and the grad ops that go with them, the stage of
        the cheapest predicted step (the rest follow fluidps.ir.stages' rules)."""
        cost = self.cost_model if self.cost_model is not None else CostModel.load()
        self.placement = place_pipeline(
            program,
            self.num_stages,
            self.num_microbatches,
            cost,
            self.batch_size,
            self.schedule_mode,
            self.memory_cap,
        )
        write_stages(program, self.placement)
