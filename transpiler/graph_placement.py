"""Placing a program's forward ops on pipeline stages by list scheduling, for programs
whose ops are not one chain (two towers, a wide-and-deep model): a stage may hold ops
that are not next to each other in program order, so long as every value still goes
forward (a reader's stage is at least its maker's).

Earliest finish time, m-ETF style, made to see a pipeline: units go depth first (what
the unit just placed feeds, when it is ready, so that a branch is placed whole), else
the ready unit with the longest path of compute below it; each candidate stage is scored by when the
unit would finish there (its stage free, its inputs arrived, messages counted where
they cross) plus (m - 1) x the slowest stage the step would then have, at least the
work not yet placed spread over the stages still open to it. A stage that would pass
the memory cap is no candidate. fluidps.transpiler.partition runs this next to the
exact search over cuts of the program order and keeps whichever the model predicts
faster.
"""

from __future__ import annotations

from fluidps.transpiler.stage_costs import Units, in_flight


def list_schedule(
    units: Units, num_stages: int, micro_batches: int, schedule_mode: str, memory_cap: float | None = None
) -> list[int] | None:
    """A stage for every unit, or None when the schedule leaves a stage empty or cannot
    keep a unit under the memory cap."""
    n, p, m = len(units.ops), num_stages, micro_batches
    preds: list[set[int]] = [set() for _ in range(n)]
    succs: list[set[int]] = [set() for _ in range(n)]
    crossing = {}  # (maker, reader) -> seconds of work and on the way
    for value in units.values:
        for reader in value.readers:
            preds[reader].add(value.maker)
            succs[value.maker].add(reader)
            work, wait = crossing.get((value.maker, reader), (0.0, 0.0))
            crossing[(value.maker, reader)] = (work + value.work, wait + value.wait)
    together = _written_together(units)
    below = [0.0] * n  # the longest path of compute from each unit to the end
    for u in reversed(range(n)):
        below[u] = float(units.compute[u]) + max((below[s] for s in succs[u]), default=0.0)

    stage: list[int | None] = [None] * n
    finish = [0.0] * n
    free = [0.0] * p  # when each stage is done with what it holds, for one micro-batch
    load = [units.run_s] * p
    memory = [0.0] * p
    remaining = float(units.compute.sum())
    ready = {u for u in range(n) if not preds[u]}
    last = -1
    while ready:
        # depth first (what the unit just placed feeds, if it is ready), then the longest path below
        u = max(ready, key=lambda v: (last >= 0 and v in succs[last], below[v], -v))
        last = u
        ready.discard(u)
        lowest = max((stage[v] for v in preds[u]), default=0)
        fixed = units.pins[u] if units.pins[u] is not None else together.get(u, {}).get("stage")
        choices = [fixed] if fixed is not None else list(range(lowest, p))
        best = None
        for k in choices:
            if k < lowest:
                return None  # a guard or a shared variable sends a value backward
            keeps = float(units.param_bytes[u]) + in_flight(schedule_mode, k, p, m) * float(
                units.stash_bytes[u]
            )
            if memory_cap is not None and memory[k] + keeps > memory_cap:
                continue
            arrive = max(
                (finish[v] + sum(crossing[(v, u)]) if stage[v] != k else finish[v] for v in preds[u]),
                default=0.0,
            )
            done = max(free[k], arrive) + float(units.compute[u])
            after = list(load)
            after[k] += float(units.compute[u])
            for v in preds[u]:
                if stage[v] != k:
                    after[k] += crossing[(v, u)][0]
                    after[stage[v]] += crossing[(v, u)][0]
            left = remaining - float(units.compute[u])
            spread = (left + sum(after[k:])) / (p - k)  # the least the open stages can end with
            score = done + (m - 1) * max(max(after), spread)
            if best is None or score < best[0]:
                best = (score, k, done, after, keeps)
        if best is None:
            return None
        _, k, done, after, keeps = best
        stage[u], finish[u], free[k], load, memory[k] = k, done, done, after, memory[k] + keeps
        remaining -= float(units.compute[u])
        if u in together:
            together[u]["stage"] = k
        ready |= {s for s in succs[u] if all(stage[v] is not None for v in preds[s])}
    if any(s is None for s in stage) or len(set(stage)) < p:
        return None
    return [int(s) for s in stage]


def _written_together(units: Units) -> dict[int, dict]:
    """Units that write one variable (a value has one stage): each maps to a shared record
    whose "stage" the first of them to be placed sets."""
    groups: dict[int, dict] = {}
    for u in range(len(units.ops)):
        if not units.cut_ok[u + 1] and u + 1 < len(units.ops):  # no cut between u and u + 1
            shared = groups.get(u) or {"stage": None}
            groups[u] = groups[u + 1] = shared
    return groups
