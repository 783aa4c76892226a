"""`op_device` strings (which pipeline stage an op runs on) and the pipeline
configuration a program carries.

fluidps writes "stage:k". Paddle's pipeline programs say "gpu:k" (or another
accelerator's "xpu:k", "npu:k", ...), which mean stage k here too, and "cpu" or ""
(no device), which leave the op to take its stage from its neighbours
(fluidps.transpiler.stages).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fluidps.errors import BuilderError

STAGE_PREFIX = "stage:"
_DEVICE = re.compile(r"(stage|gpu|xpu|npu|mlu|ipu|custom_cpu):(\d+)")
_NO_STAGE = ("", "cpu")


def parse_device(device: str, where: str = "op_device") -> int | None:
    """The stage `device` names (None: none). `where` names the caller in errors."""
    if device in _NO_STAGE:
        return None
    if device in ("gpu", "xpu", "npu"):  # Paddle's current device of that kind: its first
        return 0
    match = _DEVICE.fullmatch(device)
    if match is None:
        raise BuilderError(
            f"{where}: {device!r} is not a device: use 'stage:k' (pipeline stage k, k >= 0), Paddle's "
            "'gpu:k', or 'cpu' / None for no stage"
        )
    return int(match.group(2))


def stage_device(stage: int) -> str:
    return f"{STAGE_PREFIX}{stage}"


SCHEDULES = ("1F1B", "F-then-B")  # Paddle's names; F-then-B is GPipe's


@dataclass(frozen=True)
class StageEndpoints:
    """Which stage of a pipeline this process runs (`stage`) and where every stage's
    process takes its peers' values (`endpoints`, "host:port" in stage order): what
    fluidps.transpile_for_role records on the program of a process `fluidps launch
    --stages` started, so that Executor.run runs that stage only."""

    stage: int
    endpoints: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.endpoints or not all(isinstance(e, str) and e for e in self.endpoints):
            raise BuilderError(f"a launched pipeline needs one endpoint per stage, got {self.endpoints!r}")
        if len(set(self.endpoints)) != len(self.endpoints):
            raise BuilderError(f"the stages' endpoints must differ, got {', '.join(self.endpoints)}")
        if (
            isinstance(self.stage, bool)
            or not isinstance(self.stage, int)
            or not 0 <= self.stage < len(self.endpoints)
        ):
            raise BuilderError(
                f"stage {self.stage!r} is not one of the {len(self.endpoints)} stages the endpoints name"
            )


@dataclass(frozen=True)
class PipelineConfig:
    """What fluidps.optimizer.PipelineOptimizer records on a program (`program.pipeline`):
    each mini-batch is cut into `num_microbatches` equal micro-batches that go through
    `num_stages` stages on `schedule_mode` ("1F1B": each stage starts a micro-batch's
    backward as soon as it can, keeping at most num_stages - stage micro-batches'
    activations; "F-then-B": every forward, then every backward, as GPipe)."""

    num_microbatches: int
    schedule_mode: str = "1F1B"
    num_stages: int = 1
    # Set on a launched stage process's program: it runs this stage only (Executor.run).
    this_stage: StageEndpoints | None = None

    def __post_init__(self) -> None:
        m = self.num_microbatches
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise BuilderError(f"num_microbatches must be an integer >= 1, got {m!r}")
        if self.schedule_mode not in SCHEDULES:
            raise BuilderError(
                f"schedule_mode must be one of {', '.join(SCHEDULES)}; got {self.schedule_mode!r}"
            )
        p = self.num_stages
        if isinstance(p, bool) or not isinstance(p, int) or p < 1:
            raise BuilderError(f"num_stages must be an integer >= 1, got {p!r}")
        if self.this_stage is not None and len(self.this_stage.endpoints) != p:
            raise BuilderError(
                f"the program has {p} pipeline stages but {len(self.this_stage.endpoints)} stage processes were "
                f"started: launch it with --stages {p}"
            )
