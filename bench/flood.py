"""Strangers and floods against live servers: what they are answered, what the job's
parameters end as, and what the servers' memory does. One JSON row per target.

    python -m bench.flood [--target pserver,job] [--peers 100000] [--connections 200]
                          [--steps 12] [--seed 0]

Both train examples/digits_mlp.py's model (64-256-256-10, Adam) on batches of 32 digits.

- pserver: one pserver (`fluidps serve --role pserver`, a 1-trainer sync job) whose
  trainer, in this process, trains `steps` steps: half before the flood, half after it. The flood: `peers` distinct fake peers (trainer id, incarnation) over
  `connections` connections, every message proven with the job's secret (a process of
  the job gone wrong: the worst a server must still bound), each a heartbeat, a GET or
  a SEND of a gradient as a trainer the job does not have or an incarnation it does not
  know; then strangers' SETs and GETs and messages proven with another secret. The row
  says how each kind was answered, the server's RSS before the flood, at its peak
  during it and once what it keeps of silent peers is dropped (after its forget time),
  and whether the trained parameters match local training's on the same batches.
- job: a RemoteExecutor job of 2 pservers x 2 trainers (sync) trained `steps` steps
  three times with the same seeds: unprobed, with a flood between its steps (strangers'
  SETs, GETs, LOADs, RUNs, SHUTDOWNs and RESETs to every server, malformed frames,
  messages proven with another secret, `peers` fake peers' heartbeats, GETs and SENDs).
  Then unprobed again: the row says whether the final parameters are equal, the counts
  of answers, and each server's peak RSS in the probed run and the last unprobed one
  (the first compiles what the others load from disk).

Nothing here is timed for a claim: `seconds` says how long the flood took.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import zmq

import fluidps
from bench.workloads import digits_workload
from fluidps import layers
from fluidps.endpoints import pick_free_ports
from fluidps.errors import WireError
from fluidps.executor.launch.processes import stop_group
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message, decode, encode
from fluidps.ops.selected_rows import SelectedRows

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
BATCH_ROWS = 32
READY = " ready on "
QUIET_MS = 10_000  # a flood's connection waits this long for answers still due


def rss(pid: int) -> int:
    """Resident bytes of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE


def workload(steps: int) -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable, list[dict]]:
    """examples/digits_mlp.py's model (64-256-256-10, Adam) and `steps` of its batches of
    BATCH_ROWS digits (bench.workloads)."""
    w = digits_workload(BATCH_ROWS, steps)
    main, startup, loss = w.build()
    return main, startup, loss, [w.batches[i % len(w.batches)] for i in range(steps)]


# -- what a flood sends -------------------------------------------------------------------


def outcome(frames: list, secret: JobSecret | None) -> str:
    """What an answer says, in a word or two (counted by kind)."""
    try:
        reply = decode(frames, secret)
    except WireError:
        try:
            reply = decode(frames)  # an unsigned refusal
        except WireError:
            return "unreadable answer"
    if reply.kind != Kind.ERROR:
        return Kind.Name(reply.kind)
    text = reply.text
    for needle, word in (
        ("without this job's proof", "refused: no proof"),
        ("malformed", "rejected: malformed"),
        ("serves trainers", "refused: no such trainer"),
        ("incarnation", "refused: wrong incarnation"),
        ("restarted", "refused: wrong incarnation"),
        ("cannot set", "refused: bad SET"),
        ("owns no gradient", "refused: unknown gradient"),
    ):
        if needle in text:
            return word
    return "ERROR: " + text[:60]


def drain(sock: zmq.Socket, counts: Counter, secret: JobSecret | None, wait_ms: int) -> int:
    """Count what `sock` was answered until it is quiet for `wait_ms`; how many."""
    got = 0
    while sock.poll(wait_ms):
        counts[outcome(sock.recv_multipart(), secret)] += 1
        got += 1
    return got


def fake_peer_messages(rng: np.random.Generator, count: int, trainers: int) -> list[Message]:
    """`count` messages of distinct fake peers: heartbeats, GETs and SENDs as a trainer id
    the job does not have, or as one it has with an incarnation it does not know."""
    out = []
    for i in range(count):
        trainer = int(rng.integers(trainers, 1 << 30)) if i % 2 else int(rng.integers(0, trainers))
        sender = int(rng.integers(1, 1 << 62))
        kind = (Kind.HEARTBEAT, Kind.GET, Kind.SEND)[i % 3]
        grads = {"fc_0.b_0@GRAD": np.ones(16, np.float32)} if kind == Kind.SEND else {}
        out.append(Message(kind, tensors=grads, trainer_id=trainer, sender=sender, request_id=i + 1, step=1))
    return out


def stranger_messages(params: dict[str, np.ndarray]) -> list[Message]:
    """What a stranger tries on a pserver: SETs of every parameter (dense and as
    SelectedRows), GETs of them, gradients as trainer 0."""
    out = []
    for name, value in params.items():
        rows = SelectedRows(
            np.arange(min(2, value.shape[0])), np.ones((2, *value.shape[1:]), value.dtype), value.shape[0]
        )
        out += [
            Message(Kind.SET, tensors={name: np.full_like(value, 100.0)}),
            Message(Kind.SET, tensors={name: rows}),
            Message(Kind.GET, names=[name]),
            Message(Kind.SEND, tensors={f"{name}@GRAD": np.ones_like(value)}, trainer_id=0, sender=1, step=1),
        ]
    return [replace(m, request_id=i + 1) for i, m in enumerate(out)]


def executor_server_messages() -> list[Message]:
    """What a stranger tries on an executor server: ship and run a program, stop it."""
    program = fluidps.Program()
    with fluidps.program_guard(program, fluidps.Program()):
        layers.scale(layers.data("x", [2]), 2.0)
    blob = program.serialize_to_string()
    messages = [
        Message(Kind.LOAD, text="startup", blobs=[blob]),
        Message(Kind.RUN, text="startup"),
        Message(Kind.SET, tensors={"x": np.zeros((1, 2), np.float32)}),
        Message(Kind.CONFIGURE, text=json.dumps({"incarnation": "1"})),
        Message(Kind.RESET),
        Message(Kind.SHUTDOWN),
    ]
    return [replace(m, request_id=i + 1) for i, m in enumerate(messages)]


def garbage(rng: np.random.Generator, count: int) -> list[list[bytes]]:
    return [
        [rng.bytes(int(rng.integers(0, 512))) for _ in range(int(rng.integers(1, 4)))] for _ in range(count)
    ]


class Flood:
    """Sends messages on fresh DEALER connections and counts what comes back."""

    def __init__(self, context: zmq.Context):
        self.context = context
        self.counts: Counter = Counter()
        self.sent = 0
        self.unanswered = 0

    def send(self, address: str, frames_list: list[list], answer_secret: JobSecret | None) -> None:
        """Send every message on a new connection and count its answers (each message here
        gets one; waiting for the rest ends after QUIET_MS without any)."""
        sock = self.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.connect(address)
        got = 0
        try:
            for frames in frames_list:
                sock.send_multipart(frames)
                self.sent += 1
                got += drain(sock, self.counts, answer_secret, 0)  # answers must not pile up unread
            while got < len(frames_list) and sock.poll(QUIET_MS):
                got += drain(sock, self.counts, answer_secret, 0)
            self.unanswered += len(frames_list) - got
        finally:
            sock.close(linger=0)

    def messages(
        self, address: str, messages: list[Message], secret: JobSecret | None, answer_secret=None
    ) -> None:
        self.send(address, [encode(m, secret) for m in messages], answer_secret)


# -- one pserver ------------------------------------------------------------------------------


def _start_pserver(
    tmp: Path, secret: JobSecret, main: fluidps.Program, startup: fluidps.Program
) -> tuple[subprocess.Popen, str, fluidps.DistributedPlan]:
    """The pserver of a job of one trainer, as a `fluidps serve` process; (process, endpoint, plan)."""
    endpoint = f"127.0.0.1:{pick_free_ports('127.0.0.1', 1)[0]}"
    role = fluidps.RoleInfo(
        "PSERVER", 0, trainers=1, pserver_endpoints=(endpoint,), current_endpoint=endpoint
    )
    pserver = fluidps.transpile_for_role(
        role, main, startup, fluidps.DistributeTranspilerConfig(min_block_size=8)
    )
    command = [sys.executable, "-m", "fluidps", "serve", "--role", "pserver"]
    for option, program in (("--program", pserver.main), ("--startup", pserver.startup)):
        path = tmp / f"pserver.{option[2:]}.pb"  # (the serve process reads its programs from files)
        path.write_bytes(program.serialize_to_string())
        command += [option, str(path)]
    log = tmp / "pserver.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", FLUIDPS_JOB_SECRET=secret.hex(), FLUIDPS_PEER_TIMEOUT="1")
    with open(log, "wb") as out:
        process = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    deadline = time.monotonic() + 120
    while READY not in log.read_text(errors="replace"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_group(process)
            raise SystemExit(f"the pserver did not start:\n{log.read_text(errors='replace')}")
        time.sleep(0.05)
    return process, endpoint, pserver.plan


def flood_pserver(peers: int, connections: int, steps: int, seed: int) -> dict:
    secret = JobSecret.generate()
    rng = np.random.default_rng(seed)
    main, startup, loss, data = workload(steps)
    local = fluidps.Executor()
    local.run(startup)
    want = [float(local.run(main, feed=b, fetch_list=[loss])[0]) for b in data]
    with tempfile.TemporaryDirectory(prefix="fluidps-flood-") as tmp:
        process, endpoint, plan = _start_pserver(Path(tmp), secret, main, startup)
        context = zmq.Context()
        trainer = None
        try:
            settings = RpcSettings(peer_timeout=20.0, secret=secret)
            trainer = fluidps.Executor(runtime_config=RuntimeConfig(rpc=settings))
            trainer.run(plan.trainer_startup)  # (trainer 0's programs: the plan's, not copies)
            program = plan.trainer_program
            half = steps // 2
            got = [float(trainer.run(program, feed=b, fetch_list=[loss.name])[0]) for b in data[:half]]
            time.sleep(1.0)
            start = rss(process.pid)
            flood, peak = Flood(context), start
            address = f"tcp://{endpoint}"
            per = max(peers // connections, 1)
            began = time.monotonic()
            for c in range(connections):
                flood.messages(address, fake_peer_messages(rng, per, trainers=1), secret, secret)
                if c % 10 == 0:
                    peak = max(peak, rss(process.pid))
            params = {p.name: local.scope[p.name] for p in main.all_parameters()}
            other = JobSecret.generate()
            for signer in (None, other):  # strangers, and a process of another job
                flood.messages(address, stranger_messages(params), signer)
            flood.send(address, garbage(rng, 200), secret)
            seconds = time.monotonic() - began
            peak = max(peak, rss(process.pid))
            time.sleep(12.0)  # past what the server keeps of silent peers (peers.py: forget_after)
            after = rss(process.pid)
            got += [float(trainer.run(program, feed=b, fetch_list=[loss.name])[0]) for b in data[half:]]
            probe = RpcClient(context, address, "pserver", settings)
            stats = json.loads(probe.call(Message(Kind.STATS)).text)
            probe.close()
            match = all(
                np.allclose(trainer.scope[p.name], local.scope[p.name], rtol=2e-5, atol=1e-6)
                for p in main.all_parameters()
            )
        finally:
            if trainer is not None:
                trainer.close()
            stop_group(process)
            context.term()
    return {
        "bench": "flood",
        "target": "pserver",
        "fake_peers": per * connections,
        "connections": connections,
        "messages": flood.sent,
        "answers": dict(sorted(flood.counts.items())),
        "unanswered": flood.unanswered,
        "seconds": round(seconds, 2),
        "rss_start_mib": round(start / MIB, 1),
        "rss_peak_mib": round(peak / MIB, 1),
        "rss_after_mib": round(after / MIB, 1),
        "after_vs_start": round(after / start, 3),
        "kept": stats["peers"],
        "rejected": stats["rejected"],
        "unproven": stats["unproven"],
        "losses_equal_local": bool(np.allclose(got, want, rtol=1e-5)),
        "params_match_local": bool(match),  # (to float32 rounding: the pserver's Adam is compiled apart)
    }


# -- a live job ------------------------------------------------------------------------------


def _train_job(steps: int, seed: int, probe: Flood | None, peers: int, rng: np.random.Generator) -> dict:
    """Train a 2x2 sync job `steps` steps (flooded between steps by `probe`): its final
    parameters and each server's peak RSS."""
    main, startup, loss, data = workload(steps)
    config = fluidps.DistributeTranspilerConfig(min_block_size=8)  # every parameter cut across both
    peaks: dict[str, int] = {}
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=2, trainers=2, config=config)) as exe:
        exe.run(startup)
        params = {p.name: np.array(exe.scope[p.name]) for p in main.all_parameters()}
        other = JobSecret.generate()
        for feed in data:
            exe.run(main, feed=feed, fetch_list=[loss])
            peaks = {n: max(peaks.get(n, 0), rss(pid)) for n, pid in exe.server_pids.items()}
            if probe is None:
                continue
            loops = [f"tcp://{ep}" for ep in exe.plan.endpoints]
            for address in loops:
                for signer in (None, other):
                    probe.messages(address, stranger_messages(params), signer)
                probe.send(address, garbage(rng, 20), None)
                probe.messages(address, fake_peer_messages(rng, peers // steps // len(loops), 2), None)
            for address in exe.server_addresses.values():
                for signer in (None, other):
                    probe.messages(address, executor_server_messages(), signer)
        final = {p.name: np.array(exe.scope[p.name]) for p in main.all_parameters()}
        peaks = {n: max(peaks.get(n, 0), rss(pid)) for n, pid in exe.server_pids.items()}
    return {"params": final, "peaks": peaks}


def flood_job(peers: int, steps: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    # Unprobed, probed, unprobed: the first run compiles what the others load from disk,
    # so the probed run's memory is held against the last.
    first = _train_job(steps, seed, None, peers, rng)
    context = zmq.Context()
    try:
        probe = Flood(context)
        began = time.monotonic()
        probed = _train_job(steps, seed, probe, peers, rng)
        seconds = time.monotonic() - began
    finally:
        context.term()
    plain = _train_job(steps, seed, None, peers, rng)
    equal = all(
        np.array_equal(probed["params"][n], v) and np.array_equal(first["params"][n], v)
        for n, v in plain["params"].items()
    )
    return {
        "bench": "flood",
        "target": "job 2x2",
        "fake_peers": (peers // steps // 2) * 2 * steps,
        "messages": probe.sent,
        "answers": dict(sorted(probe.counts.items())),
        "unanswered": probe.unanswered,
        "seconds": round(seconds, 2),
        "rss_peak_mib": {n: round(v / MIB, 1) for n, v in sorted(probed["peaks"].items())},
        "rss_peak_unprobed_mib": {n: round(v / MIB, 1) for n, v in sorted(plain["peaks"].items())},
        "peak_vs_unprobed": {n: round(v / plain["peaks"][n], 3) for n, v in sorted(probed["peaks"].items())},
        "params_equal_unprobed": bool(equal),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="pserver,job")
    parser.add_argument("--peers", type=int, default=100_000)
    parser.add_argument("--connections", type=int, default=200)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for target in args.target.split(","):
        if target == "pserver":
            row = flood_pserver(args.peers, args.connections, args.steps, args.seed)
        elif target == "job":
            row = flood_job(args.peers, args.steps, args.seed)
        else:
            raise SystemExit(f"--target: pserver and/or job, got {target!r}")
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
