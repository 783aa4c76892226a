"""Every stage of a pipeline in one process: what `Executor.run` does with a
PipelineOptimizer's program.

The mini-batch is cut into m micro-batches along its first dimension. Each
stage follows its schedule (PipelinePlan.schedule); a stage's next action runs
once the values it receives for that micro-batch are there, so the stages
interleave as processes would, and each keeps only the activations its
schedule holds (each StageRunner's `peak_live` counts them). Then each stage's optimize phase runs
once. Values cross stages through a LocalChannel, keyed by (from, to, variable,
micro-batch): the section programs' own send_v2 / recv_v2 ops move them.

The result is the whole mini-batch's training step: the parameters' gradients
are the sums of the micro-batches' (each micro-batch's loss gradient is 1 / m),
so they equal the full batch's up to float32 summation order. Fetched values
come back whole: per-example values concatenated, a mean (the loss) averaged
over the micro-batches, persistable values as the step left them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.executor.pipeline.stage import RunProgram, StageRunner, split_feed
from fluidps.transpiler.pipeline_plan import FORWARD, PipelinePlan

__all__ = ["LocalChannel", "LocalPipeline", "RunProgram"]


class LocalChannel:
    """send_v2 / recv_v2 between stages of one process: values wait in a mailbox
    until the stage they are for takes them. `stage` and `micro_batch` say who is
    running (set before each of its programs runs)."""

    def __init__(self) -> None:
        self.stage = 0
        self.micro_batch = 0
        self.waited_s = 0.0  # (a stage of one process never waits: it runs when its values are there)
        self._mail: dict[tuple[int, int, str, int], Any] = {}

    def send(self, peer: int, name: str, value: Any) -> None:
        self._mail[(self.stage, peer, name, self.micro_batch)] = value

    def recv(self, peer: int, name: str) -> Any:
        key = (peer, self.stage, name, self.micro_batch)
        if key not in self._mail:
            raise ExecutionError(
                f"stage {self.stage}, micro-batch {self.micro_batch}: {name!r} from stage {peer} has not been sent"
            )
        return self._mail.pop(key)

    def has(self, src: int, dst: int, name: str, micro_batch: int) -> bool:
        return (src, dst, name, micro_batch) in self._mail

    def clear(self) -> None:
        self._mail.clear()


class LocalPipeline:
    """Runs `plan`'s stages with `run` (an Executor's run whose runtime has `channel`)."""

    def __init__(self, plan: PipelinePlan, run: RunProgram, channel: LocalChannel):
        self.plan = plan
        self._channel = channel
        self.runners = [StageRunner(s, plan.config, run, channel) for s in plan.stages]
        self.steps = 0

    def step(self, scope: Any, feed: Mapping[str, Any], fetch_names: Sequence[str]) -> list[Any]:
        plan = self.plan
        micro = split_feed(feed, plan.config.num_microbatches, {n for s in plan.stages for n in s.feeds})
        owner = self._fetch_stages(fetch_names, scope)
        self._channel.clear()
        for runner in self.runners:
            runner.begin(scope, micro, fetch_names)
        while any(r.next_action is not None for r in self.runners):
            progressed = False
            for runner in self.runners:
                while (action := runner.next_action) is not None and self._ready(runner.plan.stage, *action):
                    runner.act(scope)
                    progressed = True
            if not progressed:  # a plan whose crossings no schedule order can satisfy
                waiting = {r.plan.stage: r.next_action for r in self.runners if r.next_action is not None}
                raise ExecutionError(f"pipeline: no stage can go on (each waits for another): {waiting}")
        for runner in self.runners:
            runner.optimize(scope)
        self.steps += 1
        return [
            np.array(scope.find(name), copy=True)
            if owner[name] is None
            else self.runners[owner[name]].whole(name)
            for name in fetch_names
        ]

    def _ready(self, stage: int, kind: str, k: int) -> bool:
        phase = "forward" if kind == FORWARD else "backward"
        return all(self._channel.has(c.src, c.dst, c.var, k) for c in self.plan.receives(stage, phase))

    def _fetch_stages(self, fetch_names: Sequence[str], scope: Any) -> dict[str, int | None]:
        """The stage whose forward makes each fetched variable (None: persistable, read after the step)."""
        owner: dict[str, int | None] = {}
        for name in fetch_names:
            makers = [s.stage for s in self.plan.stages if name in s.made]
            if makers:
                owner[name] = makers[0]
            elif scope.find(name) is not None:
                owner[name] = None
            else:
                raise ExecutionError(
                    f"cannot fetch {name!r} from a pipeline: fetch what a forward computes (the loss, "
                    "per-example outputs) or a persistable variable"
                )
        return owner
