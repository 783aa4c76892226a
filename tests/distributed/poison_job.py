"""The digits job of examples/distributed_digits.py, reading a dataset with a `poison`
field: a trainer that reads a poisoned batch dies on the spot (os._exit), every time,
as a trainer crashing on bad records would. Run under `fluidps launch --dataset`.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

from digits_mlp import build
from distributed_digits import transpile

import fluidps

EPOCHS, BATCH = 3, 64


def main() -> None:
    out = Path(sys.argv[1])
    role = fluidps.role_from_env()
    model = build(seed=1)
    main_program, startup = model[0], model[1]
    with fluidps.program_guard(main_program, startup):
        poison = fluidps.layers.data("poison", [1], dtype="int64")
        block = main_program.global_block()
        fluidps.layers.dataset_reader(
            role.dataset, [block.var("image"), block.var("label"), poison], BATCH, passes=EPOCHS
        )
    mine = transpile(role, main_program, startup, 0)
    exe = fluidps.Executor()
    if role.is_pserver:
        exe.run(mine.startup)
        exe.run(mine.main)
        return
    steps = 0
    try:
        exe.run(mine.startup)
        while True:
            try:
                _, flags = exe.run(mine.main, fetch_list=[model[3], poison])
            except fluidps.EOFException:
                break
            if flags.any():
                print("read a poisoned batch: crashing", flush=True)
                os._exit(3)
            steps += 1
    finally:
        exe.close()
    (out / f"trainer.{role.trainer_id}.json").write_text(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main()
