"""One pipeline stage: its forward and backward for each micro-batch, in its schedule's
order, then its update once a step.

A micro-batch's forward keeps what its backward reads (StagePlan.stash) until that
backward runs: how many micro-batches' values a stage holds at once is what its
schedule allows, and `peak_live` counts it. Values crossing stages go through the
channel the stage's programs' send_v2 / recv_v2 use; the runner only tells the
channel which micro-batch is running.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from fluidps.errors import ExecutionError, FeedError
from fluidps.ir.devices import PipelineConfig
from fluidps.ir.program import Program
from fluidps.transpiler.pipeline_plan import FORWARD, Action, StagePlan, schedule

# (program, feed, fetch names, scope) -> fetched values: an Executor's run, whose
# runtime has the stage channel attached.
RunProgram = Callable[[Program, Mapping[str, Any], Sequence[str], Any], list[Any]]
_MEANS = frozenset({"mean", "reduce_mean"})  # a fetched mean of a micro-batch: averaged over them


class StageRunner:
    def __init__(self, plan: StagePlan, config: PipelineConfig, run: RunProgram, channel: Any):
        self.plan = plan
        self.config = config
        self.actions: tuple[Action, ...] = schedule(
            config.schedule_mode, plan.stage, config.num_stages, config.num_microbatches
        )
        self._run = run
        self._channel = channel
        self._stash: dict[int, dict[str, Any]] = {}
        self._feeds: list[dict[str, Any]] = []
        self._wanted: list[str] = []
        self.fetched: dict[str, list[Any]] = {}
        self.position = 0  # of the next action in `actions`
        self.peak_live = 0  # most micro-batches' values held at once, over every step
        self.steps = 0
        self.busy_s = 0.0  # running its programs, not waiting for its peers' values

    def begin(self, scope: Any, micro_feeds: list[dict[str, Any]], fetch_names: Sequence[str]) -> None:
        """Start a step on these micro-batches' feeds; fetch what of `fetch_names` this stage's forward makes."""
        for name, shape, dtype in self.plan.accumulators:  # the gradient sums start at zero
            # (here, not only after the update: a failed step leaves them half summed, and a
            # stage whose parameters live on pservers has no update to zero them after)
            held = scope.find(name)
            if isinstance(held, np.ndarray) and held.flags.writeable:
                held[...] = 0
            else:
                scope[name] = np.zeros(shape, dtype)
        self.steps += 1
        self._feeds = micro_feeds
        self._wanted = [n for n in fetch_names if n in self.plan.made]
        self.fetched = {n: [] for n in self._wanted}
        self._stash.clear()
        self.position = 0

    @property
    def next_action(self) -> Action | None:
        return self.actions[self.position] if self.position < len(self.actions) else None

    def act(self, scope: Any) -> None:
        """Run the next action of the schedule."""
        kind, k = self.actions[self.position]
        self._channel.stage, self._channel.micro_batch = self.plan.stage, k
        with self._busy():
            self._act(kind, k, scope)
        self.position += 1

    def _act(self, kind: str, k: int, scope: Any) -> None:
        plan = self.plan
        if kind == FORWARD:
            feed = {n: self._feeds[k][n] for n in plan.feeds}
            values = self._run(plan.forward, feed, [*plan.stash, *self._wanted], scope)
            self._stash[k] = dict(zip(plan.stash, values, strict=False))
            for name, value in zip(self._wanted, values[len(plan.stash) :], strict=True):
                self.fetched[name].append(value)
            self.peak_live = max(self.peak_live, len(self._stash))
        else:
            self._run(plan.backward, self._stash.pop(k), [], scope)

    @contextmanager
    def _busy(self) -> Iterator[None]:
        """Time what runs inside, less what the channel spent waiting for peers meanwhile."""
        waited, start = self._channel.waited_s, time.perf_counter()
        try:
            yield
        finally:
            self.busy_s += time.perf_counter() - start - (self._channel.waited_s - waited)

    def optimize(self, scope: Any) -> None:
        self._channel.stage, self._channel.micro_batch = self.plan.stage, 0  # (a step's own exchanges)
        with self._busy():
            self._run(self.plan.optimize, {}, [], scope)

    def step(self, scope: Any, feed: Mapping[str, Any], fetch_names: Sequence[str]) -> dict[str, Any]:
        """A whole step of this stage alone (its peers run theirs in their own processes):
        the fetched values it makes, each for the whole mini-batch."""
        self.begin(scope, split_feed(feed, self.config.num_microbatches, set(self.plan.feeds)), fetch_names)
        while self.next_action is not None:
            self.act(scope)
        self.optimize(scope)
        return {name: self.whole(name) for name in self._wanted}

    def stats(self) -> dict[str, Any]:
        """Its parameters and their bytes, and the most micro-batches' activations it held at once."""
        return {
            "stage": self.plan.stage,
            "params": list(self.plan.params),
            "param_bytes": self.plan.param_bytes,
            "peak_live_microbatches": self.peak_live,
            "steps": self.steps,
            "busy_s": self.busy_s,  # (over every step so far: compare two reads for a span)
        }

    def whole(self, name: str) -> Any:
        """A fetched variable's value for the mini-batch, from its micro-batches' values:
        per-example values joined, a mean averaged."""
        parts = [np.asarray(p) for p in self.fetched[name]]
        block = self.plan.forward.global_block()
        var = block.find_var(name)
        if var is not None and var.shape and var.shape[0] == -1:
            return np.concatenate(parts)
        maker = next((op.type for op in block.ops if name in op.output_arg_names), None)
        if maker in _MEANS:
            return np.mean(np.stack(parts), axis=0).astype(parts[0].dtype)
        raise ExecutionError(
            f"cannot fetch {name!r} from a pipeline: it is neither per example (a first dimension of -1) nor "
            f"a mean (made by {maker}); its micro-batches' values do not make the mini-batch's"
        )


def check_feed(feed: Mapping[str, Any], m: int) -> None:
    """FeedError naming the first fed value `m` micro-batches cannot share equally."""
    for name, value in feed.items():
        shape = np.shape(value)
        if not shape or shape[0] % m:
            rows = "a scalar" if not shape else f"{shape[0]} rows"
            raise FeedError(
                f"feed {name!r} has {rows}, which {m} micro-batches cannot share equally: feed a batch whose "
                f"size is a multiple of num_microbatches={m}, or change num_microbatches"
            )


def split_feed(feed: Mapping[str, Any], m: int, read: set[str]) -> list[dict[str, Any]]:
    """The feed cut into `m` equal micro-batches along the first dimension (the values of
    `read` only, each of which must be fed; every value checked)."""
    check_feed(feed, m)
    missing = sorted(read - feed.keys())
    if missing:
        raise FeedError(
            f"the pipeline's stages read {', '.join(map(repr, missing))} from the feed, which does not hold "
            "them: add them to feed"
        )
    pieces: list[dict[str, Any]] = [{} for _ in range(m)]
    for name in read:
        for k, part in enumerate(np.split(np.asarray(feed[name]), m)):
            pieces[k][name] = part
    return pieces
