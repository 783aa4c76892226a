"""What one wake-up between two processes costs on this machine, across cores and on one.

    python -m bench.cores [--rounds 5] [--quick]

A parameter-server step is a few messages between processes, and each message wakes a
thread of another process (ZeroMQ's I/O thread, then the receiving one). On a virtual
machine a wake-up across vCPUs can cost ten times one on the same vCPU, which no
one-process benchmark shows, and which sets a floor under every message of a job.

Rows: the round trip of one byte over a pipe between two processes (each wakes the
other once), the two bound to two cores, then both to one core; `round_trip_us` is the
median, min and max over `rounds` interleaved measurements (a virtual machine's cores
change speed within minutes), each the median of its round trips.

Linux only (os.sched_setaffinity); a machine with one core prints the one-core row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# The child: answers each byte it reads with one byte.
ECHO = "import os, sys\nr, w, n = map(int, sys.argv[1:])\nfor _ in range(n):\n    os.read(r, 1)\n    os.write(w, b'x')\n"


def round_trip_us(parent_core: int, child_core: int, round_trips: int) -> float:
    """Median microseconds of a one-byte round trip between this process, bound to
    `parent_core` for the measurement, and a child bound to `child_core`."""
    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-c", ECHO, str(child_reads), str(child_writes), str(round_trips)],
        pass_fds=(child_reads, child_writes),
        preexec_fn=lambda: os.sched_setaffinity(0, {child_core}),
    )
    os.close(child_reads)
    os.close(child_writes)
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {parent_core})
    times = []
    try:
        for _ in range(round_trips):
            start = time.perf_counter()
            os.write(parent_writes, b"x")
            if not os.read(parent_reads, 1):
                raise SystemExit(f"bench.cores: the echo process on core {child_core} ended early")
            times.append(time.perf_counter() - start)
    finally:
        os.sched_setaffinity(0, before)
        os.close(parent_writes)
        os.close(parent_reads)
        child.wait(timeout=60)
    return statistics.median(times[len(times) // 10 :]) * 1e6  # (the first ones wait for the child to start)


def spread(values: list[float]) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5, help="each placement this many times, interleaved")
    parser.add_argument(
        "--quick", action="store_true", help="one short round: a smoke test, not a measurement"
    )
    args = parser.parse_args()
    if not hasattr(os, "sched_setaffinity"):
        raise SystemExit("bench.cores needs Linux (os.sched_setaffinity)")
    cores = sorted(os.sched_getaffinity(0))
    placements = {"two cores": (cores[0], cores[-1])} if len(cores) > 1 else {}
    placements["one core"] = (cores[0], cores[0])
    rounds, round_trips = (1, 200) if args.quick else (max(args.rounds, 1), 2000)
    times: dict[str, list[float]] = {name: [] for name in placements}
    for _ in range(rounds):
        for name, (parent, child) in placements.items():
            times[name].append(round_trip_us(parent, child, round_trips))
    for name, (parent, child) in placements.items():
        row = {
            "bench": "cores",
            "probe": "wake_up",
            "placement": name,
            "cores": [parent, child],
            "rounds": rounds,
        }
        print(json.dumps(row | {"round_trip_us": spread(times[name])}), flush=True)


if __name__ == "__main__":
    main()
