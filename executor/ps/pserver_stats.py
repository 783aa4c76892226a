"""What a pserver reports of itself (ParameterServer.stats, a STATS request): its
counters, clocks, logs and tables, as a snapshot that later requests do not change;
and, in its log, what a step that takes long waits for (Stall)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fluidps.executor.resources import resident_bytes
from fluidps.ops.sparse_table import SparseTable

if TYPE_CHECKING:
    from fluidps.executor.ps.parameter_server import ParameterServer

# Over the wire (STATS) the stats are compact: the recent clock log, and which rows arrived
# only while they are few; a message's text must stay far below the wire's limit.
WIRE_CLOCK_EVENTS = 1000
WIRE_UNIQUE_ROWS = 50_000
STALL_LOG_S = 30.0  # requests waiting this long on a step: the pserver says what for


class Stall:
    """When to say what requests wait for: once they have waited STALL_LOG_S on a step
    with no progress, and again every STALL_LOG_S while that lasts."""

    def __init__(self, now: float):
        self._since = (0, now)  # the progress counted, and since when requests wait on it

    def due(self, progress: int, waiting: bool, now: float) -> bool:
        if not waiting or progress != self._since[0]:
            self._since = (progress, now)
            return False
        if now - self._since[1] < STALL_LOG_S:
            return False
        self._since = (progress, now)
        return True

    def __str__(self) -> str:
        return f"no step done for {STALL_LOG_S:.0f} s"


def snapshot(ps: ParameterServer, compact: bool = False) -> dict[str, Any]:
    """Counters, clocks and logs (copies). `compact` (for the wire): the last
    WIRE_CLOCK_EVENTS clock events, and the rows each sparse gradient brought as a set,
    only while there are at most WIRE_UNIQUE_ROWS of them."""
    clock_log = list(ps.clock_log)
    if compact:
        clock_log = clock_log[-WIRE_CLOCK_EVENTS:]
        unique = {grad: log.unique() for grad, log in ps.received_rows.items()}
        few = sum(len(u) for u in unique.values()) <= WIRE_UNIQUE_ROWS
        rows = {grad: u.tolist() for grad, u in unique.items()} if few else None
    else:
        rows = {grad: log.rows() for grad, log in ps.received_rows.items()}
    out = {
        "mode": ps.spec.mode,
        **ps.strategy.stats(),
        "clocks": {str(t): m.clock for t, m in ps.members.members.items()},
        "trainers": {str(t): m.state for t, m in ps.members.members.items()},
        "clock_log": clock_log,
        "live_trainers": sorted(ps.members.live),
        "deferred_gets": len(ps.deferred),
        "unapplied_sends": len(ps.unapplied),
        "rejected": ps.server.rejected if ps.server else 0,
        "unproven": ps.server.unproven if ps.server else 0,  # of those: without the job's proof
        "incarnations": {str(t): f"{m.sender:x}" for t, m in ps.members.members.items()},  # 0: not known yet
        "peers": {  # what it keeps of its peers (bounded: fluidps.executor.transport.peers)
            "connections": len(ps.server.peers.connections) if ps.server else 0,
            "clocks": len(ps.server.peers.clocks) if ps.server else 0,
            "cached_reply_bytes": ps.server.peers.cached_bytes if ps.server else 0,
        },
        "received_row_counts": {grad: log.total for grad, log in ps.received_rows.items()},
        "checkpoints": list(ps.checkpoints.saved),
        "restored_step": ps.checkpoints.restored_step,
        "log": list(ps.log_lines)[-200:] if compact else list(ps.log_lines),
        "hashed_tables": {n: v.stats() for n in ps.served if isinstance(v := ps.env.get(n), SparseTable)},
        "rss_bytes": resident_bytes(),
        "compiled_ops": sum(r.compiled_ops for r in ps.blocks.runners),  # 0: interpreted
        "compiling_blocks": sum(r.compiling for r in ps.blocks.runners),  # compiling beside the loop
        "joined_blocks": ps.blocks.joined_sets,  # sets of optimize blocks run as one block
        "rows_first": dict(ps.rows_first.counts),  # table updates held, and cut for a PREFETCH
        "max_message_bytes": ps.settings.message_limit,
        "stream_gradients_dropped": ps.applied_batches.dropped,  # applied before (applied_batches.py)
    }
    if rows is not None:
        out["received_rows"] = rows
    if ps.host.profile is not None:
        out["profile"] = ps.host.profile.report(steps=ps.strategy.steps)
    return out
