"""bench.distributed's training rows the Fluid way: this script is what `fluidps launch`
runs in every process of the job (no client process; each trainer feeds itself).

    python -m fluidps launch --pservers 1 --trainers 2 --mode sync bench/launched.py \\
        --workload digits_mlp --out DIR [--steps 100 --repeats 3 --warmup 20] [--communicator]
        [--no-proof]

A pserver serves; trainer i runs the trainer program on its rows of each of the
workload's global batches (rows i*B/T .. (i+1)*B/T - 1, as RemoteExecutor splits a fed
batch), `warmup` steps, then `repeats` timed windows of `steps` steps, and writes its
steps per second of each window to DIR/trainer.<i>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package, run as a script

import fluidps
from bench.workloads import make


def rows_of(batch: dict, trainer: int, trainers: int) -> dict:
    size = len(next(iter(batch.values()))) // trainers
    return {name: value[trainer * size : (trainer + 1) * size] for name, value in batch.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, default=128, help="the global batch")
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--communicator", action="store_true", help="async: DistributeTranspilerConfig.communicator"
    )
    parser.add_argument(
        "--no-proof",
        action="store_true",
        help="every process drops the job's secret its launcher gave it and serves insecure: the same "
        "job without the proof on its messages, to measure what the proof costs",
    )
    args = parser.parse_args()
    if args.no_proof:  # (read by the runtime when the first program needs it, below)
        os.environ.pop("FLUIDPS_JOB_SECRET_FILE", None)
        os.environ["FLUIDPS_INSECURE"] = "1"

    role = fluidps.role_from_env()
    w = make(args.workload, args.batch, args.steps, args.vocab)
    main_program, startup, loss = w.build()
    config = fluidps.DistributeTranspilerConfig(mode=role.mode, communicator=args.communicator)
    mine = fluidps.transpile_for_role(role, main_program, startup, config)
    exe = fluidps.Executor()
    if role.is_pserver:
        exe.run(mine.startup)
        exe.run(mine.main)  # serves until every trainer is done
        return
    program = mine.main
    feeds = [rows_of(b, role.trainer_id, role.trainers) for b in w.batches]
    rates, last = [], None
    try:
        exe.run(mine.startup)
        # run_batches: each step is told the next batch (its table rows come with this step's values)
        for _ in exe.run_batches(program, (feeds[i % len(feeds)] for i in range(args.warmup)), [loss]):
            pass
        for r in range(args.repeats):
            began = time.perf_counter()
            steps = (feeds[(r * args.steps + i) % len(feeds)] for i in range(args.steps))
            fetched = list(exe.run_batches(program, steps, [loss]))  # (a loss per step: a few KiB)
            (last,) = fetched[-1]
            rates.append(args.steps / (time.perf_counter() - began))
    finally:
        for problem in exe.close():
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    batch = len(next(iter(feeds[0].values())))
    result = {"trainer_id": role.trainer_id, "steps_per_s": rates, "batch": batch, "loss": float(last)}
    (args.out / f"trainer.{role.trainer_id}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
