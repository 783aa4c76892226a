"""The program fuzzer's full run: random and mutated programs through verify and the
executors, in worker processes; one JSON row with the count of each outcome.

    python -m bench.fuzz [--programs 20000] [--seed 0] [--jobs 2] [--timeout 120]

Outcomes: "clean", a fluidps.Error's class name (VerifyError, ExecutionError, ...),
"other:<type>" (another exception: a bug), "signal:<name>" (a crash: a bug), "timeout"
and "exit:<code>". A second row per failure gives its seed and index (the program is
made again from them: tests/fuzz_programs.py) and what it said. The fuzzer lives in
tests/fuzz_programs.py, which tests/unit/test_fuzz.py runs on a seeded subset.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # where the fuzzer lives

import fuzz_programs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--programs", type=int, default=20_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    parser.add_argument(
        "--timeout", type=float, default=fuzz_programs.PROGRAM_TIMEOUT_S, help="seconds one program may take"
    )
    args = parser.parse_args(argv)
    report = fuzz_programs.fuzz(args.programs, args.seed, args.jobs, args.timeout)
    counts = dict(sorted(report.counts.items(), key=lambda kv: (-kv[1], kv[0])))
    failures = sum(n for outcome, n in counts.items() if fuzz_programs.is_failure(outcome))
    row = {"workload": "fuzz", "programs": args.programs, "seed": args.seed, "outcomes": counts}
    slowest = [{"index": i, "seconds": t} for t, i in reversed(report.slowest)]
    print(json.dumps(row | {"failures": failures, "seconds": report.seconds, "slowest": slowest}), flush=True)
    for failure in report.failures:
        print(json.dumps({"workload": "fuzz_failure", **failure}), flush=True)


if __name__ == "__main__":
    main()
