"""A message's time over fluidps's transport, between two processes: what `fluidps
calibrate` fits (fluidps.transpiler.cost_model.MachineModel's alpha_s, beta_s, send_cpu_s).

Round trips of STAGE_SEND messages (what pipeline stages send each other) carrying one
float32 tensor, through RpcClient to an RpcServer in another process that answers each
with OK, both with the job's proof, as a job's processes talk; the sizes in turn, so
that the machine's drift touches each alike. Least squares over the sizes gives the
slope (beta) and the round trip of an empty message, half of which is alpha (the answer
is one of those); and what sending an empty message costs the sender (send_cpu_s:
encoding, proving, handing it to ZeroMQ).

    python -m fluidps.executor.transport.link --echo   # (the peer's side: prints its address)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import numpy as np
import zmq

from fluidps.errors import Error
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient, RpcServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message

SIZES = (0, 16 << 10, 256 << 10, 1 << 20, 4 << 20)
_SECRET_ENV = "FLUIDPS_JOB_SECRET"
_IDLE_EXIT_S = 120.0  # an echo peer nobody talks to this long ends itself


def serve_echo() -> None:
    """An RpcServer that answers each request OK (and exits on SHUTDOWN, or when idle)."""
    secret = JobSecret.from_hex(os.environ[_SECRET_ENV], _SECRET_ENV)
    server = RpcServer(zmq.Context(), "tcp://127.0.0.1:0", "calibration peer", RpcSettings(secret=secret))
    print(server.address, flush=True)
    last = time.monotonic()
    running = True
    while running and time.monotonic() - last < _IDLE_EXIT_S:
        for request in server.receive(1.0):
            server.reply(request)
            running = request.msg.kind != Kind.SHUTDOWN
            last = time.monotonic()
    server.close()


def measure_link(sizes: Sequence[int] = SIZES, calls: int = 40) -> dict[str, float | list]:
    """alpha_s and beta_s of a message over fluidps's transport to another process, and
    the median round trip of each size."""
    secret = JobSecret.generate()
    env = {**os.environ, _SECRET_ENV: secret.hex()}
    peer = subprocess.Popen(
        [sys.executable, "-m", "fluidps.executor.transport.link", "--echo"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    context = zmq.Context()
    client = None
    try:
        address = peer.stdout.readline().strip()
        if not address:
            raise Error("the calibration peer process did not start; see its error above")
        client = RpcClient(context, address, "the calibration peer", RpcSettings(secret=secret))
        client.call(Message(Kind.HELLO), timeout=60)
        messages = [
            Message(Kind.STAGE_SEND, tensors={"v": np.ones(size // 4, np.float32)}, text="0")
            for size in sizes
        ]
        for msg in messages:  # (warm: buffers, the peer's first decode)
            client.call(msg, timeout=60)
        samples: list[list[float]] = [[] for _ in sizes]
        for _ in range(calls):  # the sizes in turn: the machine's drift touches each alike
            for msg, taken in zip(messages, samples, strict=True):
                start = time.perf_counter()
                client.call(msg, timeout=60)
                taken.append(time.perf_counter() - start)
        trips = [statistics.median(taken) for taken in samples]
        sends = []  # one end's own work on an empty message: encoding it, proving it, handing it on
        empty = Message(Kind.STAGE_SEND, tensors={"v": np.ones(0, np.float32)}, text="0")
        for _ in range(calls):
            start = time.perf_counter()
            rid = client.request(empty)
            sends.append(time.perf_counter() - start)
            client.wait(rid, 60)
        client.call(Message(Kind.SHUTDOWN), timeout=60)
    finally:
        if client is not None:
            client.close()
        context.destroy(linger=0)
        try:
            peer.wait(10)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
        peer.stdout.close()
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(trips), 1)
    return {
        "alpha_s": max(float(intercept) / 2, 0.0),
        "beta_s": max(float(slope), 0.0),
        "send_cpu_s": statistics.median(sends),
        "round_trips": [[int(s), round(t, 7)] for s, t in zip(sizes, trips, strict=True)],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--echo", action="store_true", required=True, help="serve as the peer")
    parser.parse_args(argv)
    serve_echo()


if __name__ == "__main__":
    main()
