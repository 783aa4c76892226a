"""Timing a pipeline program as a job: what `fluidps place --measure`, `fluidps calibrate`
and bench.placement compare the cost model with."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import fluidps
from fluidps.errors import ExecutionError


def time_stages(
    main: fluidps.Program,
    startup: fluidps.Program,
    feeds: Sequence[Mapping[str, Any]],
    steps: int = 10,
    fetch: Sequence[Any] = (),
) -> tuple[float, list[float]]:
    """(median seconds a step, each stage's busy seconds a step: running its programs,
    not waiting for its peers) of pipeline program `main` under RemoteExecutor, one
    process per stage, fed `feeds` in turn. The job first runs until every stage's
    compiled ops have not changed for three steps: a stage compiling is not a stage
    training."""
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(startup)
        compiled, settled, i = None, 0, 0
        while settled < 3:
            exe.run(main, feed=feeds[i % len(feeds)], fetch_list=list(fetch))
            now = [s["compiled_ops"] for s in exe.stage_stats()]
            settled, compiled, i = (settled + 1 if now == compiled and all(now) else 0), now, i + 1
            if i > 200:
                raise ExecutionError(f"the stages' compiled ops did not settle in 200 steps: {now}")
        before = [s["pipeline"] for s in exe.stage_stats()]
        seconds = []
        for k in range(steps):
            start = time.perf_counter()
            exe.run(main, feed=feeds[k % len(feeds)], fetch_list=list(fetch))
            seconds.append(time.perf_counter() - start)
        after = [s["pipeline"] for s in exe.stage_stats()]
    busy = [
        (a["busy_s"] - b["busy_s"]) / max(a["steps"] - b["steps"], 1)
        for a, b in zip(after, before, strict=True)
    ]
    return statistics.median(seconds), busy
