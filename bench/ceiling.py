"""What a 1x1 sync step could cost on this machine: the job's own work, over raw pyzmq.

    python -m bench.ceiling [--workload digits_mlp] [--batch 128] [--steps 300] [--repeats 3]

A trainer process (this one) runs the workload's forward and backward (the program
without its optimizer ops) with a compiled fluidps.Executor and pushes the gradients
as raw frames to a pserver subprocess, which runs the optimizer ops (a compiled
Executor too) and answers with the parameters, as raw frames: one DEALER/ROUTER round
trip a step, copy=False both ways, no fluidps transport, checks, barriers or
bookkeeping, and no overlap of the exchange with compute. Its samples/s over local
training's, measured in the same run, is the ratio a 1x1 sync job of these kernels can
reach on this machine's loopback and cores; bench.distributed prints it next to its
1x1 sync rows ("runner": "raw pyzmq (ceiling)"). Dense workloads only (digits_mlp).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
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


def serve(workload: str, batch: int, address: str) -> None:
    """The pserver: apply each pushed set of gradients, answer with the parameters."""
    main, startup, _ = make(workload, batch, 1).build()
    _, optimize, pairs = split(main)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    socket = zmq.Context().socket(zmq.ROUTER)
    socket.connect(address)
    while socket.poll(PEER_TIMEOUT_MS):
        client, *frames = socket.recv_multipart(copy=False)
        if len(frames) != len(pairs):  # the trainer is done
            return
        feed = {
            grad: np.frombuffer(frame.buffer, dtype=np.float32).reshape(main.global_block().var(grad).shape)
            for (_, grad), frame in zip(pairs, frames, strict=True)
        }
        exe.run(optimize, feed=feed, scope=scope)
        socket.send_multipart([client, *(np.asarray(scope[p]) for p, _ in pairs)], copy=False)


def raw_sync_rate(w: Workload, repeats: int, warmup: int) -> tuple[float, float]:
    """(samples/s, the last step's loss) of the workload's 1x1 sync exchange over raw pyzmq."""
    batch = len(next(iter(w.batches[0].values())))
    main, startup, loss = w.build()
    compute, _, pairs = split(main)
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    shapes = {p: main.global_block().var(p).shape for p, _ in pairs}
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)  # bound here, the pserver's ROUTER connects: no port race
    address = f"tcp://127.0.0.1:{socket.bind_to_random_port('tcp://127.0.0.1')}"
    peer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.ceiling",
            "--serve",
            address,
            "--workload",
            w.name,
            "--batch",
            str(batch),
        ],
        cwd=Path(__file__).resolve().parents[1],
    )

    last = []

    def step(i: int) -> None:
        feed = w.batches[i % len(w.batches)]
        loss_value, *grads = exe.run(
            compute, feed=feed, scope=scope, fetch_list=[loss, *(g for _, g in pairs)]
        )
        last[:] = [loss_value]
        socket.send_multipart([np.ascontiguousarray(g) for g in grads], copy=False)
        waited = 0
        while not socket.poll(1000):
            waited += 1000
            if peer.poll() is not None or waited >= PEER_TIMEOUT_MS:
                raise RuntimeError(f"the raw pyzmq pserver did not answer (exit status {peer.poll()})")
        for (param, _), frame in zip(pairs, socket.recv_multipart(copy=False), strict=True):
            scope[param] = np.frombuffer(frame.buffer, dtype=np.float32).reshape(shapes[param])

    try:
        rate = timed(step, w.steps, repeats, warmup)
        socket.send_multipart([b""])  # done
        peer.wait(timeout=60)
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        socket.close(linger=0)
        context.term()
    return rate * batch, float(np.asarray(last).reshape(-1)[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workload", default="digits_mlp")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", metavar="ADDRESS", help=argparse.SUPPRESS)  # the pserver subprocess
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.workload, args.batch, args.serve)
        return
    w = make(args.workload, args.batch, args.steps)
    from bench.distributed import run_local  # (bench.distributed imports this module)

    local, _ = run_local(w, args.repeats, WARMUP, compiled=True)
    raw, loss = raw_sync_rate(w, args.repeats, WARMUP)
    print(json.dumps({"bench": w.name, "mode": "local", "samples_per_s": round(local, 1)}))
    print(
        json.dumps(
            {
                "bench": w.name,
                "mode": "sync",
                "trainers": 1,
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
