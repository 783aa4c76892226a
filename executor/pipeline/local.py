"""Every stage of a pipeline in one process: what `Executor.run` does with a
PipelineOptimizer's program.

The mini-batch is cut into m micro-batches along its first dimension. Each
stage follows its schedule (PipelinePlan.schedule); a stage's next action runs
once the values it receives for that micro-batch are there, so the stages
interleave as processes would, and each keeps only the activations its
schedule holds (`peak_live` counts them). Then each stage's optimize phase runs
once. Values cross stages through a LocalChannel, keyed by (from, to, variable,
micro-batch): the section programs' own send_v2 / recv_v2 ops move them.

The result is the whole mini-batch's training step: the parameters' gradients
are the sums of the micro-batches' (each micro-batch's loss gradient is 1 / m),
so they equal the full batch's up to float32 summation order. Fetched values
come back whole: per-example values concatenated, a mean (the loss) averaged
over the micro-batches, persistable values as the step left them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError, FeedError
from fluidps.ir.program import Program
from fluidps.transpiler.pipeline_plan import FORWARD, PipelinePlan

# (program, feed, fetch names, scope) -> fetched values: an Executor's run, whose
# runtime has this pipeline's channel attached.
RunProgram = Callable[[Program, Mapping[str, Any], Sequence[str], Any], list[Any]]
_MEANS = frozenset({"mean", "reduce_mean"})  # a fetched mean of a micro-batch: averaged over them


class LocalChannel:
    """send_v2 / recv_v2 between stages of one process: values wait in a mailbox
    until the stage they are for takes them. `stage` and `micro_batch` say who is
    running (set before each of its programs runs)."""

    def __init__(self) -> None:
        self.stage = 0
        self.micro_batch = 0
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
        self._run = run
        self._channel = channel
        self.peak_live = [0] * plan.num_stages  # most micro-batches' activations a stage held at once
        self.steps = 0

    def step(self, scope: Any, feed: Mapping[str, Any], fetch_names: Sequence[str]) -> list[Any]:
        plan, m = self.plan, self.plan.config.num_microbatches
        micro = split_feed(feed, m, {n for s in plan.stages for n in s.feeds})
        owner = self._fetch_stages(fetch_names, scope)
        for stage in plan.stages:  # the gradient sums start at zero
            for name, shape, dtype in stage.accumulators:
                if scope.find(name) is None:
                    scope[name] = np.zeros(shape, dtype)
        fetched: dict[str, list[Any]] = {n: [] for n, s in owner.items() if s is not None}
        stash: list[dict[int, dict[str, Any]]] = [{} for _ in plan.stages]
        schedules = [plan.schedule(s.stage) for s in plan.stages]
        position = [0] * plan.num_stages
        self._channel.clear()
        while any(p < len(a) for p, a in zip(position, schedules, strict=True)):
            progressed = False
            for s, actions in enumerate(schedules):
                while position[s] < len(actions) and self._ready(s, *actions[position[s]]):
                    kind, k = actions[position[s]]
                    self._channel.stage, self._channel.micro_batch = s, k
                    stage = plan.stages[s]
                    if kind == FORWARD:
                        wanted = [n for n, o in owner.items() if o == s]
                        values = self._run(
                            stage.forward,
                            {n: micro[k][n] for n in stage.feeds},
                            [*stage.stash, *wanted],
                            scope,
                        )
                        stash[s][k] = dict(zip(stage.stash, values, strict=False))
                        for name, value in zip(wanted, values[len(stage.stash) :], strict=True):
                            fetched[name].append(value)
                        self.peak_live[s] = max(self.peak_live[s], len(stash[s]))
                    else:
                        self._run(stage.backward, stash[s].pop(k), [], scope)
                    position[s] += 1
                    progressed = True
            if not progressed:  # a plan whose crossings no schedule order can satisfy
                waiting = {
                    s: schedules[s][position[s]]
                    for s in range(plan.num_stages)
                    if position[s] < len(schedules[s])
                }
                raise ExecutionError(f"pipeline: no stage can go on (each waits for another): {waiting}")
        for stage in plan.stages:
            self._channel.stage = stage.stage
            self._run(stage.optimize, {}, [], scope)
        self.steps += 1
        return [_whole(name, fetched.get(name), scope, owner[name], plan) for name in fetch_names]

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


def split_feed(feed: Mapping[str, Any], m: int, read: set[str]) -> list[dict[str, Any]]:
    """The feed cut into `m` equal micro-batches along the first dimension."""
    pieces: list[dict[str, Any]] = [{} for _ in range(m)]
    for name, value in feed.items():
        array = np.asarray(value)
        if array.ndim == 0 or array.shape[0] % m:
            rows = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
            raise FeedError(
                f"feed {name!r} has {rows}, which {m} micro-batches cannot share equally: feed a batch whose "
                f"size is a multiple of num_microbatches={m}, or change num_microbatches"
            )
        if name not in read:
            continue
        for k, part in enumerate(np.split(array, m)):
            pieces[k][name] = part
    return pieces


def _whole(name: str, parts: list[Any] | None, scope: Any, owner: int | None, plan: PipelinePlan) -> Any:
    """A fetched variable's value for the mini-batch, from its micro-batches' values."""
    if owner is None:
        return np.array(scope.find(name), copy=True)
    stage = plan.stages[owner].forward.global_block()
    var = stage.find_var(name)
    if var is not None and var.shape and var.shape[0] == -1:
        return np.concatenate([np.asarray(p) for p in parts])
    maker = next((op.type for op in stage.ops if name in op.output_arg_names), None)
    if maker in _MEANS:
        return np.mean(np.stack([np.asarray(p) for p in parts]), axis=0).astype(np.asarray(parts[0]).dtype)
    raise ExecutionError(
        f"cannot fetch {name!r} from a pipeline: it is neither per example (a first dimension of -1) nor "
        f"a mean (made by {maker}); its micro-batches' values do not make the mini-batch's"
    )
