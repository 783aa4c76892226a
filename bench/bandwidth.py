"""bench.distributed's bandwidth rows: pushing and pulling one parameter through
fluidps (exe.scope) next to one raw pyzmq frame, in the same run; and what the job's
proof costs a message (`proof` rows: round trips through fluidps's transport to a server
subprocess, with the job's secret and without, in alternating rounds)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable

import numpy as np
import zmq

import fluidps
from bench.sparse_update import median_ms
from fluidps import layers, optimizer
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message

CORES = os.cpu_count() or 1
MIB = 1 << 20


# The raw pyzmq peer: a ROUTER that acknowledges a pushed frame with b"ok" and answers
# b"pull" with the same-sized buffer, copy=False both ways. It prints its address.
ZMQ_PEER = """
import sys, zmq
size = int(sys.argv[1])
ctx = zmq.Context()
s = ctx.socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind("tcp://127.0.0.1:0")
print(s.getsockopt(zmq.LAST_ENDPOINT).decode(), flush=True)
payload = bytearray(size)
while True:
    ident, kind, *rest = s.recv_multipart(copy=False)
    kind = bytes(kind.buffer)
    if kind == b"stop":
        s.send_multipart([ident, b"ok"])
        break
    if kind == b"pull":
        s.send_multipart([ident, payload], copy=False)
    else:
        s.send_multipart([ident, b"ok"])
s.close()
ctx.term()
"""


# fluidps's transport without the rest: an RpcServer subprocess that acknowledges each
# request, with the job's secret from FLUIDPS_JOB_SECRET or, without one, insecure.
RPC_PEER = """
import os, zmq
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.rpc import RpcServer
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind
text = os.environ.get("FLUIDPS_JOB_SECRET", "")
secret = JobSecret.from_hex(text, "FLUIDPS_JOB_SECRET") if text else None
server = RpcServer(zmq.Context(), "tcp://127.0.0.1:0", "peer", RpcSettings(secret=secret, insecure=not text))
print(server.address, flush=True)
running = True
while running:
    for request in server.receive(1.0):
        server.reply(request)
        running = request.msg.kind != Kind.SHUTDOWN
server.close()
"""


def bandwidth_row(op: str, path: str, nbytes: int, seconds: float, repeats: int, **extra) -> dict:
    return {
        "bench": "bandwidth",
        "op": op,
        "path": path,
        "bytes": nbytes,
        "mib_per_s": round(nbytes / MIB / seconds, 1),
        "ms": round(seconds * 1e3, 2),
        "repeats": repeats,
        **extra,
        "cores": CORES,
    }


def _end(context: zmq.Context, wait: float = 10.0) -> None:
    """Terminate `context`, its sockets closed. Seen once on a loaded machine: term()
    never returned after the DEALER closed with LINGER 0 and its zero-copy sends were
    answered; a bench goes on (its process ends soon) rather than hang."""
    ender = threading.Thread(target=context.destroy, kwargs={"linger": 0}, daemon=True)
    ender.start()
    ender.join(wait)
    if ender.is_alive():
        print(f"bench.bandwidth: a ZeroMQ context did not terminate within {wait:g} s; left", file=sys.stderr)


def _reap(peer: subprocess.Popen) -> None:
    """Wait for a peer subprocess told to stop (killed if it does not within 10 s)."""
    try:
        peer.wait(10)
    except subprocess.TimeoutExpired:
        peer.kill()
        peer.wait()
    peer.stdout.close()


def median_seconds(run: Callable[[], None], repeats: int) -> float:
    """Median seconds of `repeats` timed runs after two warm-up runs."""
    return median_ms(run, repeats, warmup=2) / 1e3


def zmq_bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    """Median seconds of a push and of a pull of one `nbytes` frame to a ROUTER subprocess."""
    peer = subprocess.Popen([sys.executable, "-c", ZMQ_PEER, str(nbytes)], stdout=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30_000)
    try:
        sock.connect(peer.stdout.readline().strip())
        payload = np.ones(nbytes // 4, dtype=np.float32)

        def push() -> None:
            sock.send_multipart([b"push", payload], copy=False)
            sock.recv_multipart(copy=False)

        def pull() -> None:
            sock.send(b"pull")
            (frame,) = sock.recv_multipart(copy=False)
            assert len(frame.buffer) == nbytes

        out = {"push": median_seconds(push, repeats), "pull": median_seconds(pull, repeats)}
        sock.send(b"stop")
        sock.recv()
    finally:
        sock.close()
        ctx.term()
        _reap(peer)
    return out


def fluidps_bandwidth(nbytes: int, repeats: int) -> dict[str, float]:
    """Median seconds of exe.scope[name] (pull) and exe.scope[name] = v (push) for a
    [1024, nbytes / 4096] float32 parameter held by the one pserver of a 1x1 job."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [1024])
        out = layers.fc(x, nbytes // 4 // 1024, param_attr=fluidps.ParamAttr(name="bw.w"), bias_attr=False)
        loss = layers.mean(out)
        optimizer.SGD(0.01).minimize(loss)
    job = fluidps.JobDesc(pservers=1, trainers=1, mode="sync")
    with fluidps.RemoteExecutor(job) as exe:
        exe.run(startup)
        exe.run(main, feed={"x": np.ones((2, 1024), np.float32)}, fetch_list=[loss])  # deploys
        value = np.asarray(exe.scope["bw.w"]).copy()
        assert value.nbytes == nbytes

        def pull() -> None:
            exe.scope.invalidate()  # gathered values are cached until the next step or write
            exe.scope["bw.w"]

        def push() -> None:
            exe.scope["bw.w"] = value

        return {"pull": median_seconds(pull, repeats), "push": median_seconds(push, repeats)}


def rpc_round_trips(secret: JobSecret | None, sizes: list[int], calls: int) -> dict[int, float]:
    """Median seconds of a SEND of each size (one float32 tensor) answered by an RpcServer
    subprocess, through fluidps's RpcClient: proven with `secret`, or unproven (None)."""
    env = dict(os.environ, FLUIDPS_JOB_SECRET=secret.hex() if secret else "")
    peer = subprocess.Popen([sys.executable, "-c", RPC_PEER], stdout=subprocess.PIPE, text=True, env=env)
    context = zmq.Context()
    client = None
    try:
        settings = RpcSettings(secret=secret, insecure=secret is None)
        client = RpcClient(context, peer.stdout.readline().strip(), "the peer", settings)
        out = {}
        for size in sizes:
            msg = Message(Kind.SEND, tensors={"g": np.ones(size // 4, np.float32)})
            out[size] = median_seconds(lambda msg=msg: client.call(msg), calls)
        client.call(Message(Kind.SHUTDOWN))
    finally:
        if client is not None:
            client.close()
        _end(context)
        _reap(peer)
    return out


def bench_proof(nbytes: int, repeats: int, rounds: int = 3) -> None:
    """`proof` rows: a small and an `nbytes` SEND's round trip with the job's proof and
    without, `rounds` alternating rounds of `repeats` calls each (medians of the rounds)."""
    sizes = [4096, nbytes]
    times: dict[bool, list[dict[int, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for proven in (True, False):
            times[proven].append(rpc_round_trips(JobSecret.generate() if proven else None, sizes, repeats))
    for size in sizes:
        proven = statistics.median(t[size] for t in times[True])
        plain = statistics.median(t[size] for t in times[False])
        row = {
            "bench": "proof",
            "message": f"SEND of {size} bytes, answered",
            "bytes": size,
            "with_proof_us": round(proven * 1e6, 1),
            "without_proof_us": round(plain * 1e6, 1),
            "ratio": round(proven / plain, 3),
            "rounds": rounds,
            "repeats": repeats,
            "cores": CORES,
        }
        print(json.dumps(row), flush=True)


def bench_bandwidth(nbytes: int, repeats: int) -> None:
    raw = zmq_bandwidth(nbytes, repeats)
    ours = fluidps_bandwidth(nbytes, repeats)
    for op in ("pull", "push"):
        sent = "pserver (the trainer pulls it before its next step)" if op == "push" else "pserver"
        print(
            json.dumps(
                bandwidth_row(
                    op,
                    "fluidps exe.scope",
                    nbytes,
                    ours[op],
                    repeats,
                    to=sent,
                    vs_pyzmq=round(raw[op] / ours[op], 3),
                    processes=3,  # this client, the pserver and the trainer
                )
            ),
            flush=True,
        )
        print(
            json.dumps(
                bandwidth_row(
                    op, "pyzmq copy=False", nbytes, raw[op], repeats, to="ROUTER subprocess", processes=2
                )
            ),
            flush=True,
        )
