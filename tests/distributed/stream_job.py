"""A streaming job: linear regression trained from a stream until SIGTERM drains it.

    fluidps launch --stream log:DIR --pservers 1 --trainers 2 --mode async \\
        tests/distributed/stream_job.py --out OUT

Every record's `idx` field is its offset, so what each trainer trained on is known
exactly: each trainer writes the idx of every batch it read, in order, into
OUT/trainer.K.json once its reader ends, with the final parameters (trainer 0).

`--model counter`: w [1, 1] from 0, loss = mean(x w), SGD with learning rate 1: each
step's gradient is its batch's mean of x, whatever w is, so the final w is minus the sum
of the batch means of the records applied. With small integer x and batches of a power
of two, every sum is exact in float32, in any order: a batch applied twice, or not at
all, shows. `--announce` prints "window START batch INDEX" after each step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import fluidps
from fluidps import layers, optimizer

WIDTH = 4
TRUE_W = np.array([[0.5], [-1.0], [2.0], [0.25]], np.float32)


def records(start: int, n: int, counter: bool = False) -> dict[str, np.ndarray]:
    """Records start .. start + n - 1; `counter`: x small integers (exact sums)."""
    rng = np.random.default_rng(start)
    x = rng.integers(1, 8, size=(n, WIDTH)).astype(np.float32) if counter else rng.normal(size=(n, WIDTH))
    x = x.astype(np.float32)
    idx = np.arange(start, start + n, dtype=np.int64)[:, None]
    return {"idx": idx, "x": x, "y": x @ TRUE_W + np.float32(0.5)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--window-records", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--model", choices=["regression", "counter"], default="regression")
    parser.add_argument("--follow", type=int, default=1, help="0: read what the stream holds, then end")
    parser.add_argument("--announce", action="store_true")
    parser.add_argument(
        "--step-sleep", type=float, default=0.0, help="seconds each step sleeps after running"
    )
    args = parser.parse_args()

    role = fluidps.role_from_env()
    main_program, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    with fluidps.program_guard(main_program, startup):
        idx = layers.data("idx", [1], dtype="int64")
        x = layers.data("x", [WIDTH])
        y = layers.data("y", [1])
        if args.model == "counter":
            weight = fluidps.ParamAttr(name="fc_0.w_0", initializer=fluidps.initializer.Constant(0.0))
            loss = layers.mean(layers.fc(x, 1, param_attr=weight, bias_attr=False))
            optimizer.SGD(1.0).minimize(loss)
        else:
            loss = layers.mean(layers.square(layers.elementwise_sub(layers.fc(x, 1), y)))
            optimizer.SGD(0.05).minimize(loss)
        if role.stream:
            layers.stream_reader(
                role.stream, [idx, x, y], args.batch_size, window_records=args.window_records,
                follow=bool(args.follow),
            )  # fmt: skip
    mine = fluidps.transpile_for_role(role, main_program, startup)
    exe = fluidps.Executor()
    if role.is_pserver:
        exe.run(mine.startup)
        exe.run(mine.main)
        return
    seen: list[list[int]] = []
    result: dict = {}
    try:
        exe.run(mine.startup)
        while True:
            try:
                got, _ = exe.run(mine.main, fetch_list=[idx, loss])
            except fluidps.EOFException:
                break
            seen.append(got.reshape(-1).tolist())
            if args.announce:
                print(f"trained on records {seen[-1][0]}..{seen[-1][-1]}", flush=True)
            if args.step_sleep:
                time.sleep(args.step_sleep)
        result = {"trainer_id": role.trainer_id, "batches": seen}
        if role.trainer_id == 0:
            exe.run(mine.startup)  # the parameters as the pservers hold them now
            result["w"] = np.asarray(exe.scope.find("fc_0.w_0")).tolist()
    finally:
        for problem in exe.close():
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    (args.out / f"trainer.{role.trainer_id}.json").write_text(json.dumps(result))
    print(f"trainer {role.trainer_id}: read {sum(map(len, seen))} records; exiting", flush=True)


if __name__ == "__main__":
    main()
