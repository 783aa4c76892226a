"""What a sync step could cost on this machine: the job's own work, over raw pyzmq.

    python -m bench.ceiling [--workload digits_mlp] [--batch 128] [--trainers 1] [--steps 300] [--repeats 3]

Trainer processes (this one, and `trainers - 1` subprocesses) run the workload's
forward and backward (the program without its optimizer ops) with a compiled
fluidps.Executor on their share of each batch, and push the gradients as raw frames
to a pserver subprocess. The pserver waits for every trainer's gradients, runs the
optimizer ops on their mean (a compiled Executor too) and answers each trainer with
the parameters, as raw frames: one DEALER/ROUTER round trip per trainer and step,
copy=False both ways, no fluidps transport, checks, barriers or bookkeeping, and no
overlap of the exchange with compute. Its samples/s over local training's, measured
in the same run, is the ratio a sync job of these kernels and this many trainers can
reach on this machine's loopback and cores; bench.distributed prints it next to its
1x1 and 2x1 sync rows ("runner": "raw pyzmq (ceiling)"). Dense workloads only
(digits_mlp).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package, run as a script

import fluidps
from bench.local import timed
from bench.workloads import Workload, make
from fluidps.transpiler.analysis import analyze

WARMUP = 30  # steps before the timed windows: past the step where blocks compile
PEER_TIMEOUT_MS = 60_000  # a generous bound for a hung peer, not a performance claim
DONE = b""  # a trainer's last message: it has run every step


def split(main: fluidps.Program) -> tuple[fluidps.Program, fluidps.Program, list[tuple[str, str]]]:
    """(what a trainer runs, what its pserver runs, [(parameter, gradient sent)]) of
    `main`, as two copies of it (main is not changed), cut where DistributeTranspiler
    cuts (fluidps.transpiler.analysis)."""
    roles = analyze(main)
    moved = roles.pserver_ops
    compute, optimize = main.clone(), main.clone()
    compute.global_block().ops = [op for i, op in enumerate(compute.global_block().ops) if i not in moved]
    optimize.global_block().ops = [op for i, op in enumerate(optimize.global_block().ops) if i in moved]
    return compute, optimize, [(u.param, u.grad) for u in roles.updates]


def serve(workload: str, batch: int, trainers: int) -> None:
    """The pserver: bind, say where (a line on stdout), then for each step take every
    trainer's gradients, apply their mean and answer each with the parameters."""
    main, startup, _ = make(workload, batch, 1).build()
    _, optimize, pairs = split(main)
    shapes = {grad: main.global_block().var(grad).shape for _, grad in pairs}
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    socket = zmq.Context().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    done = 0
    while done < trainers:
        arrived: dict[bytes, list[zmq.Frame]] = {}
        while len(arrived) + done < trainers:
            if not socket.poll(PEER_TIMEOUT_MS):
                raise RuntimeError("a trainer of the raw pyzmq ceiling went silent")
            client, *frames = socket.recv_multipart(copy=False)
            if len(frames) == 1 and frames[0].bytes == DONE:
                done += 1
            else:
                arrived[client.bytes] = frames
        if not arrived:
            return
        feed = {}
        for k, (_, grad) in enumerate(pairs):
            values = [np.frombuffer(frames[k].buffer, dtype=np.float32) for frames in arrived.values()]
            total = values[0] if len(values) == 1 else np.mean(values, axis=0, dtype=np.float32)
            feed[grad] = total.reshape(shapes[grad])
        exe.run(optimize, feed=feed, scope=scope)
        params = [np.asarray(scope[p]) for p, _ in pairs]
        for client in arrived:
            socket.send_multipart([client, *params], copy=False)


class _Trainer:
    """Trainer `rank` of `trainers`: each step, its share of the batch forward and
    backward, the gradients out, the parameters back."""

    def __init__(self, w: Workload, rank: int, trainers: int, address: str):
        main, startup, self.loss = w.build()
        self.compute, _, self.pairs = split(main)
        self.shapes = {p: main.global_block().var(p).shape for p, _ in self.pairs}
        self.batches = [
            {name: np.ascontiguousarray(np.array_split(value, trainers)[rank]) for name, value in b.items()}
            for b in w.batches
        ]
        self.exe, self.scope = fluidps.Executor(), fluidps.Scope()
        self.exe.run(startup, scope=self.scope)
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.connect(address)
        self.last_loss = float("nan")

    def step(self, i: int, pserver_exit: Callable[[], int | None] = lambda: None) -> None:
        """One step; `pserver_exit` says whether the pserver is gone (its exit status)."""
        loss_value, *grads = self.exe.run(
            self.compute,
            feed=self.batches[i % len(self.batches)],
            scope=self.scope,
            fetch_list=[self.loss, *(g for _, g in self.pairs)],
        )
        self.last_loss = float(np.asarray(loss_value).reshape(-1)[0])
        self.socket.send_multipart([np.ascontiguousarray(g) for g in grads], copy=False)
        waited = 0
        while not self.socket.poll(1000):
            waited += 1000
            if pserver_exit() is not None or waited >= PEER_TIMEOUT_MS:
                raise RuntimeError(f"the raw pyzmq pserver did not answer (exit status {pserver_exit()})")
        for (param, _), frame in zip(self.pairs, self.socket.recv_multipart(copy=False), strict=True):
            self.scope[param] = np.frombuffer(frame.buffer, dtype=np.float32).reshape(self.shapes[param])

    def close(self) -> None:
        self.socket.send(DONE)
        self.socket.close(linger=1000)
        self.context.term()


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.ceiling", *args],
        cwd=Path(__file__).resolve().parents[1],
        stdout=subprocess.PIPE,
        text=True,
    )


def raw_sync_rate(w: Workload, repeats: int, warmup: int, trainers: int = 1) -> tuple[float, float]:
    """(samples/s, the last step's loss of trainer 0) of the workload's sync exchange over
    raw pyzmq with `trainers` trainers (this process is trainer 0 and times the steps;
    every trainer runs as many, in lockstep through the pserver)."""
    batch = len(next(iter(w.batches[0].values())))
    common = ["--workload", w.name, "--batch", str(batch), "--trainers", str(trainers)]
    processes = [pserver := _spawn("--serve", *common)]
    try:
        address = pserver.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"the raw pyzmq pserver did not start (exit status {pserver.wait(60)})")
        total = warmup + repeats * w.steps
        for rank in range(1, trainers):
            processes.append(
                _spawn("--train", address, "--rank", str(rank), "--total-steps", str(total), *common)
            )
        me = _Trainer(w, 0, trainers, address)
        rate = timed(lambda i: me.step(i, pserver.poll), w.steps, repeats, warmup)
        me.close()
        for process in processes:
            process.wait(timeout=60)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
    return rate * batch, me.last_loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--trainers", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    # The subprocesses' roles:
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--total-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.workload, args.batch, args.trainers)
        return
    if args.train:
        w = make(args.workload, args.batch, 1)
        trainer = _Trainer(w, args.rank, args.trainers, args.train)
        for i in range(args.total_steps):
            trainer.step(i)  # (a silent pserver fails it after PEER_TIMEOUT_MS)
        trainer.close()
        return
    w = make(args.workload, args.batch, args.steps)
    from bench.distributed import run_local  # (bench.distributed imports this module)

    local, _ = run_local(w, args.repeats, WARMUP, compiled=True)
    raw, loss = raw_sync_rate(w, args.repeats, WARMUP, args.trainers)
    print(json.dumps({"bench": w.name, "mode": "local", "samples_per_s": round(local, 1)}))
    print(
        json.dumps(
            {
                "bench": w.name,
                "mode": "sync",
                "trainers": args.trainers,
                "pservers": 1,
                "runner": "raw pyzmq (ceiling)",
                "samples_per_s": round(raw, 1),
                "vs_local": round(raw / local, 3),
                "loss": round(loss, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
