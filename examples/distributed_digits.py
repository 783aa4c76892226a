"""Train the digits MLP with parameter servers: one script for every process of the job.

    fluidps launch --pservers 2 --trainers 2 examples/distributed_digits.py
    fluidps launch --pservers 2 --trainers 2 --mode async examples/distributed_digits.py --epochs 10

    # Fault tolerant: the trainers read a sharded dataset through a coordinator.
    python examples/distributed_digits.py --write-dataset digits_data
    fluidps launch --dataset digits_data --pservers 2 --trainers 2 examples/distributed_digits.py

`fluidps launch` starts this script once per pserver and once per trainer and
tells each process its role through Paddle's environment variables, which
`fluidps.role_from_env()` reads. Every process builds the same model and
transpiles it the same way; then, as in Fluid,

- a pserver runs its startup program (initializing the parameter slices it
  owns) and its main program, which serves until every trainer is done;
- a trainer runs its startup program (pulling the initial parameters from the
  pservers) and then its program once per mini-batch: forward, backward, send
  the gradients, receive the updated parameters.

Each step, every trainer draws the same global batch of trainers x batch-size
examples and takes its own rows of it: trainer i gets rows i*B .. (i+1)*B - 1.
In sync mode the pservers average the trainers' gradients, so a step is the
step local training would take on the whole global batch.

With `--dataset` (FLUIDPS_DATASET), the trainers are not fed: a reader bound
to the data variables (fluidps.layers.dataset_reader) takes tasks of the
dataset from the job's coordinator, `--epochs` passes over it, until it
raises EOFException. Any process may then die: the launcher starts it again
and the job still finishes, every task counted once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from digits_mlp import build, load_data

import fluidps


def global_batches(examples: int, batch_size: int, trainers: int, epoch: int, seed: int) -> list[np.ndarray]:
    """The indices of one epoch's global batches (each trainers x batch_size long).
    Every trainer computes the same list; an incomplete last batch is dropped so that
    all trainers take the same number of steps."""
    order = np.random.default_rng([seed, epoch]).permutation(examples)
    size = trainers * batch_size
    return [order[i : i + size] for i in range(0, examples - size + 1, size)]


def shard(batch: np.ndarray, trainer_id: int, batch_size: int) -> np.ndarray:
    """Trainer `trainer_id`'s rows of a global batch."""
    return batch[trainer_id * batch_size : (trainer_id + 1) * batch_size]


def transpile(role: fluidps.RoleInfo, main, startup, staleness: int) -> fluidps.RolePrograms:
    """This process's programs of the job (its mode is the launcher's --mode)."""
    config = fluidps.DistributeTranspilerConfig(
        mode=role.mode, staleness=staleness if role.mode == "ssp" else 0
    )
    return fluidps.transpile_for_role(role, main, startup, config)


def run_pserver(role: fluidps.RoleInfo, mine: fluidps.RolePrograms, out: Path | None) -> None:
    exe = fluidps.Executor()
    exe.run(mine.startup)  # initialize the parameter slices this pserver owns
    print(f"serving on {role.current_endpoint}", flush=True)
    exe.run(mine.main)  # listen_and_serv: returns once every trainer has finished
    print("every trainer has finished", flush=True)
    if out is not None:
        stats = exe.runtime.pserver_loops[0].stats()  # clocks, SSP grants, sparse rows received
        held = [s.name for s in mine.plan.slices_on(role.current_endpoint)]
        (out / f"pserver.{role.pserver_index}.json").write_text(json.dumps(stats | {"slices": held}))


def write_dataset(directory: str, seed: int) -> None:
    """The training split of the digits as a sharded dataset (the test split stays out)."""
    x_train, _, y_train, _ = load_data(seed)
    dataset = fluidps.io.Dataset.write(directory, {"image": x_train, "label": y_train}, records_per_shard=160)
    print(f"wrote {dataset.describe()}")


def add_reader(model, dataset: str, args) -> None:
    """Bind a reader of `dataset` to the model's data variables (after its test program was cloned)."""
    main, startup = model[0], model[1]
    block = main.global_block()
    with fluidps.program_guard(main, startup):
        fluidps.layers.dataset_reader(
            dataset,
            [block.var("image"), block.var("label")],
            args.batch_size,
            passes=args.epochs,
            seed=args.seed,
        )


def run_dataset_trainer(role: fluidps.RoleInfo, mine: fluidps.RolePrograms, model, args) -> None:
    """Train on whatever tasks the coordinator hands out, until every pass is done."""
    _, _, test_program, loss, accuracy = model
    _, x_test, _, y_test = load_data(args.seed)
    exe = fluidps.Executor()
    steps = 0
    try:
        exe.run(mine.startup)  # pull the parameters (a restarted trainer: the current ones)
        while True:
            try:
                (value,) = exe.run(mine.main, fetch_list=[loss])
            except fluidps.EOFException:
                break
            steps += 1
            if steps % 50 == 0:
                print(f"step {steps}: loss {float(value):.4f}", flush=True)
        result = {"trainer_id": role.trainer_id, "mode": role.mode, "steps": steps}
        if role.trainer_id == 0:
            exe.run(mine.startup)  # the final parameters, every trainer's updates in
            (acc,) = exe.run(test_program, feed={"image": x_test, "label": y_test}, fetch_list=[accuracy])
            result["test_accuracy"] = float(acc)
            print(f"test accuracy {float(acc):.4f} after {steps} steps of this trainer", flush=True)
    finally:
        for problem in exe.close():
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    if args.out is not None:
        (args.out / f"trainer.{role.trainer_id}.json").write_text(json.dumps(result))


def run_trainer(role: fluidps.RoleInfo, mine: fluidps.RolePrograms, model, args) -> None:
    _, _, test_program, loss, accuracy = model
    x_train, x_test, y_train, y_test = load_data(args.seed)
    params = [p.name for p in model[0].all_parameters()]
    program = mine.main
    slow = args.slow if role.trainer_id == role.trainers - 1 else 1.0

    exe = fluidps.Executor()
    losses = []
    try:
        exe.run(mine.startup)  # pull the initial parameters
        initial = {name: exe.scope[name].copy() for name in params}
        for epoch in range(args.epochs):
            epoch_losses = []
            for batch in global_batches(len(x_train), args.batch_size, role.trainers, epoch, args.seed):
                rows = shard(batch, role.trainer_id, args.batch_size)
                started = time.perf_counter()
                (value,) = exe.run(
                    program, feed={"image": x_train[rows], "label": y_train[rows]}, fetch_list=[loss]
                )
                if slow > 1:  # make this trainer's steps take `slow` times as long
                    time.sleep((slow - 1) * (time.perf_counter() - started))
                epoch_losses.append(float(value))
            losses += epoch_losses
            print(f"epoch {epoch + 1}/{args.epochs}: loss {np.mean(epoch_losses):.4f}", flush=True)
        result = {"trainer_id": role.trainer_id, "mode": role.mode, "losses": losses}
        if role.trainer_id == 0:
            if role.mode != "sync":  # the current parameters: async steps ran on the last ones pulled
                exe.run(mine.startup)
            (acc,) = exe.run(test_program, feed={"image": x_test, "label": y_test}, fetch_list=[accuracy])
            result["test_accuracy"] = float(acc)
            print(f"test accuracy {float(acc):.4f} after {len(losses)} steps", flush=True)
    finally:
        # Tell the pservers this trainer is done (even after a failure, so they do not wait for it).
        for problem in exe.close():
            print(f"warning: {problem}", file=sys.stderr, flush=True)
    if args.out is not None:
        name = f"trainer.{role.trainer_id}"
        (args.out / f"{name}.json").write_text(json.dumps(result))
        np.savez(args.out / f"{name}.initial.npz", **initial)
        np.savez(args.out / f"{name}.final.npz", **{n: exe.scope[n] for n in params})


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="examples per trainer and step")
    parser.add_argument("--lr", type=float, default=0.001)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--staleness", type=int, default=2, help="SSP: steps a trainer may run ahead")
    parser.add_argument(
        "--slow",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="the last trainer's steps take FACTOR x as long",
    )
    parser.add_argument(
        "--out", type=Path, help="write each process's results (JSON, npz) into this directory"
    )
    parser.add_argument(
        "--write-dataset", metavar="DIR", help="write the training split as a dataset into DIR and exit"
    )
    args = parser.parse_args()
    if args.write_dataset:
        write_dataset(args.write_dataset, args.seed)
        return

    role = fluidps.role_from_env()
    model = build(learning_rate=args.lr, seed=args.seed + 1)
    if role.dataset:
        add_reader(model, role.dataset, args)
    mine = transpile(role, model[0], model[1], args.staleness)
    if role.is_pserver:
        run_pserver(role, mine, args.out)
    elif role.dataset:
        run_dataset_trainer(role, mine, model, args)
    else:
        run_trainer(role, mine, model, args)


if __name__ == "__main__":
    main()
