"""What a sync step could cost on this machine: the job's own work, over raw pyzmq.

    python -m bench.ceiling [--workload digits_mlp|ctr_distributed] [--batch 128] [--trainers 1]
                            [--steps 300] [--repeats 3] [--vocab 1000000]

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
1x1 and 2x1 sync rows ("runner": "raw pyzmq (ceiling)").

A sparse table (ctr_distributed) stays whole in the pserver; each trainer holds a copy
only so that its lookup reads the rows it was sent. With a step's gradients (the
table's as rows and values, each row once, summed, as a fluidps trainer sends them
to an optimizer that sums them) a trainer sends the ids of its next batch, kept once
each, and the pserver answers with their rows after the update, as a fluidps sync
trainer asks for its next batch's rows ahead: one round trip a step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package, run as a script

import fluidps
from bench.local import timed
from bench.workloads import CTR_VOCAB, Workload, make
from fluidps.executor.launch.launcher import core_of
from fluidps.ops.selected_rows import SelectedRows, sum_rows, unique_ids
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


def tables(program: fluidps.Program) -> dict[str, str]:
    """{table: the fed ids it looks up} of the sparse (SelectedRows-gradient) lookups."""
    lookups = [op for op in program.global_block().ops if op.type in ("lookup_table", "lookup_table_v2")]
    found = {op.input("W")[0]: op.input("Ids")[0] for op in lookups if op.attr("is_sparse")}
    if len(found) != len(lookups) or len(found) > 1:
        raise SystemExit("bench.ceiling: one sparse table at most, looked up once (ctr_distributed)")
    return found


class _Frames:
    """A message's frames, taken in order as arrays."""

    def __init__(self, frames: list[zmq.Frame]):
        self.frames, self.at = frames, 0

    def take(self, dtype: type) -> np.ndarray:
        self.at += 1
        return np.frombuffer(self.frames[self.at - 1].buffer, dtype=dtype)


def serve(workload: str, batch: int, trainers: int, vocab: int) -> None:
    """The pserver: bind, say where (a line on stdout), then for each step take every
    trainer's gradients and apply their mean; with a sparse table, take each trainer's
    ids of its next batch too (sent while the update runs); answer each with the
    parameters (and the rows of its ids)."""
    main, startup, _ = make(workload, batch, 1, vocab).build()
    _, optimize, pairs = split(main)
    sparse = tables(main)
    shapes = {grad: main.global_block().var(grad).shape for _, grad in pairs}
    exe, scope = fluidps.Executor(), fluidps.Scope()
    exe.run(startup, scope=scope)
    socket = zmq.Context().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    live = trainers
    while live:
        grads = _gather(socket, live)
        live = len(grads)
        if not live:
            return
        feed = {}
        for param, grad in pairs:
            if param in sparse:  # every trainer's rows, each value divided by the trainers
                rows = np.concatenate([m.take(np.int64) for m in grads.values()])
                values = np.concatenate([m.take(np.float32) for m in grads.values()])
                values = values.reshape(len(rows), -1) / np.float32(len(grads))
                feed[grad] = SelectedRows(rows, values, shapes[grad][0])
                continue
            values = [m.take(np.float32) for m in grads.values()]
            total = values[0] if len(values) == 1 else np.mean(values, axis=0, dtype=np.float32)
            feed[grad] = total.reshape(shapes[grad])
        exe.run(optimize, feed=feed, scope=scope)
        dense = [np.asarray(scope[p]) for p, _ in pairs if p not in sparse]
        ids = _gather(socket, live) if sparse else dict.fromkeys(grads)
        for client, m in ids.items():
            rows = [np.take(np.asarray(scope[table]), m.take(np.int64), axis=0) for table in sparse]
            socket.send_multipart([client, *dense, *rows], copy=False)


def _gather(socket: zmq.Socket, trainers: int) -> dict[bytes, _Frames]:
    """One message from each of `trainers` trainers, by sender (those that said DONE left)."""
    arrived: dict[bytes, _Frames] = {}
    left = 0
    while len(arrived) + left < trainers:
        if not socket.poll(PEER_TIMEOUT_MS):
            raise RuntimeError("a trainer of the raw pyzmq ceiling went silent")
        client, *frames = socket.recv_multipart(copy=False)
        if len(frames) == 1 and frames[0].bytes == DONE:
            left += 1
        else:
            arrived[client.bytes] = _Frames(frames)
    return arrived


class _Trainer:
    """Trainer `rank` of `trainers`: each step, its share of the batch forward and
    backward, the gradients out, the parameters back."""

    def __init__(self, w: Workload, rank: int, trainers: int, address: str):
        main, startup, self.loss = w.build()
        self.compute, _, self.pairs = split(main)
        self.sparse = tables(main)
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
            return_numpy=False,
        )
        self.last_loss = float(np.asarray(loss_value).reshape(-1)[0])
        frames = []
        for (param, _), g in zip(self.pairs, grads, strict=True):
            if param in self.sparse:  # each row once, summed, as a fluidps trainer sends it
                rows, inverse = unique_ids(g.rows)
                frames += [rows, sum_rows(inverse, len(rows), np.ascontiguousarray(g.value))]
            else:
                frames.append(np.ascontiguousarray(g))
        self.socket.send_multipart(frames, copy=False)
        upcoming = self.batches[(i + 1) % len(self.batches)]
        wanted = {table: unique_ids(upcoming[ids].reshape(-1))[0] for table, ids in self.sparse.items()}
        if wanted:  # worked out while the pserver updates, as a fluidps trainer does
            self.socket.send_multipart(list(wanted.values()), copy=False)
        waited = 0
        while not self.socket.poll(1000):
            waited += 1000
            if pserver_exit() is not None or waited >= PEER_TIMEOUT_MS:
                raise RuntimeError(f"the raw pyzmq pserver did not answer (exit status {pserver_exit()})")
        reply = _Frames(self.socket.recv_multipart(copy=False))
        for param, _ in self.pairs:
            if param not in self.sparse:
                self.scope[param] = reply.take(np.float32).reshape(self.shapes[param])
        for table, ids in wanted.items():  # the next step's lookup reads these rows
            np.asarray(self.scope[table])[ids] = reply.take(np.float32).reshape(len(ids), -1)

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


def raw_sync_rate(
    w: Workload, repeats: int, warmup: int, trainers: int = 1, bind_cores: bool = False
) -> tuple[float, float]:
    """(samples/s, the last step's loss of trainer 0) of the workload's sync exchange over
    raw pyzmq with `trainers` trainers (this process is trainer 0 and times the steps;
    every trainer runs as many, in lockstep through the pserver). `bind_cores`: each
    process on one core, as `fluidps launch --bind-cores` places a job's."""
    batch = len(next(iter(w.batches[0].values())))
    common = [*w.launch_args, "--trainers", str(trainers)]  # (the subprocesses build w from them)
    cores = sorted(os.sched_getaffinity(0))

    def bind(pid: int, name: str) -> None:
        if bind_cores:
            os.sched_setaffinity(pid, {core_of(name, 1, cores)})

    processes = [pserver := _spawn("--serve", *common)]
    bind(pserver.pid, "pserver.0")
    try:
        address = pserver.stdout.readline().strip()
        if not address:
            raise RuntimeError(f"the raw pyzmq pserver did not start (exit status {pserver.wait(60)})")
        total = warmup + repeats * w.steps
        for rank in range(1, trainers):
            processes.append(
                _spawn("--train", address, "--rank", str(rank), "--total-steps", str(total), *common)
            )
            bind(processes[-1].pid, f"trainer.{rank}")
        bind(0, "trainer.0")  # (before the context of this process's socket starts its threads)
        me = _Trainer(w, 0, trainers, address)
        rate = timed(lambda i: me.step(i, pserver.poll), w.steps, repeats, warmup)
        me.close()
        for process in processes:
            process.wait(timeout=60)
    finally:
        os.sched_setaffinity(0, cores)
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
    parser.add_argument("--vocab", type=int, default=CTR_VOCAB, help="the CTR table's rows")
    parser.add_argument("--bind-cores", action="store_true", help="each process on one core")
    # The subprocesses' roles:
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--train", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--total-steps", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.workload, args.batch, args.trainers, args.vocab)
        return
    if args.train:
        w = make(args.workload, args.batch, 1, args.vocab)
        trainer = _Trainer(w, args.rank, args.trainers, args.train)
        for i in range(args.total_steps):
            trainer.step(i)  # (a silent pserver fails it after PEER_TIMEOUT_MS)
        trainer.close()
        return
    w = make(args.workload, args.batch, args.steps, args.vocab)
    from bench.distributed import run_local  # (bench.distributed imports this module)

    local, _ = run_local(w, args.repeats, WARMUP, compiled=True)
    raw, loss = raw_sync_rate(w, args.repeats, WARMUP, args.trainers, args.bind_cores)
    print(json.dumps({"bench": w.name, "mode": "local", "samples_per_s": round(local, 1)}))
    print(
        json.dumps(
            {
                "bench": w.name,
                "mode": "sync",
                "trainers": args.trainers,
                "pservers": 1,
                "runner": "raw pyzmq (ceiling)" + (", bound to cores" if args.bind_cores else ""),
                "samples_per_s": round(raw, 1),
                "vs_local": round(raw / local, 3),
                "loss": round(loss, 4),
            }
        )
    )


if __name__ == "__main__":
    main()
