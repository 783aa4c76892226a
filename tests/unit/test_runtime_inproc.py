"""A whole sync job in one process (pservers on threads, the trainer here) matches local
training; the Runtime and its pieces; gradient queues."""

from __future__ import annotations

import pathlib
import re
import uuid

import numpy as np
import pytest
import zmq
from job_harness import PserverThreads
from rpc_harness import SECRET, Net, free_port

import fluidps
from fluidps.errors import ExecutionError, PeerLostError, RemoteError, TransportError
from fluidps.executor.executor import PreparedProgram
from fluidps.executor.ps.host import GradientQueue
from fluidps.executor.runtime import Runtime, RuntimeConfig
from fluidps.executor.transport.rpc import RpcClient
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message
from helpers import build_mlp

# Generous for live peers on a loaded machine; the dead-pserver test uses DEAD.
SETTINGS = RpcSettings(heartbeat_interval=0.1, peer_timeout=20.0, request_timeout=120.0, secret=SECRET)
DEAD = SETTINGS.with_(peer_timeout=1.0)
# The hang guard (a pytest timeout) of waits the 1 s peer timeout ends, which would
# otherwise run into the 120 s request timeout.
NOT_HUNG = DEAD.request_timeout / 2
STEPS = 5


def endpoints(kind: str) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    if kind == "inproc":
        return [f"inproc://ps0-{tag}", f"inproc://ps1-{tag}"]
    if kind == "ipc":  # unix sockets: a short path (their names are limited to about 100 bytes)
        return [f"ipc:///tmp/fluidps-{tag}-ps{i}.sock" for i in range(2)]
    return [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]


def sgd_mlp():
    main, startup, loss = build_mlp(hidden=16, classes=3)
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.SGD(0.1).minimize(loss)
    return main, startup, loss


@pytest.fixture
def job_endpoints(request):
    eps = endpoints(request.param)
    yield eps
    for ep in eps:  # unix socket files outlive their sockets
        if ep.startswith("ipc://"):
            pathlib.Path(ep.removeprefix("ipc://")).unlink(missing_ok=True)


@pytest.mark.parametrize("job_endpoints", ["inproc", "ipc", "tcp"], indirect=True)
def test_sync_job_in_one_process_matches_local_training(job_endpoints):
    main, startup, loss = sgd_mlp()
    eps = job_endpoints
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(min_block_size=8))
    t.transpile(0, main, ",".join(eps), trainers=1, startup_program=startup)
    # the parameters are sliced over both pservers
    assert all(t.get_pserver_programs(ep)[0].global_block().vars for ep in eps)
    servers = PserverThreads(t, eps, SETTINGS)
    exe = servers.trainer_executor()
    try:
        exe.run(t.get_trainer_startup_program())  # fetches the pservers' initial parameters
        params = [p.name for p in main.all_parameters()]
        assert len(params) == 6
        initial = {name: np.array(exe.scope[name], copy=True) for name in params}
        local = fluidps.Executor()
        local.run(startup)
        for name in params:
            local.scope[name] = initial[name].copy()
        rng = np.random.default_rng(0)
        trainer = t.get_trainer_program()
        for _ in range(STEPS):
            feed = {
                "x": rng.normal(size=(4, 64)).astype("float32"),
                "y": rng.integers(0, 3, (4, 1)).astype("int64"),
            }
            (remote_loss,) = exe.run(trainer, feed=feed, fetch_list=[loss])
            (local_loss,) = local.run(main, feed=feed, fetch_list=[loss])
            np.testing.assert_allclose(remote_loss, local_loss, rtol=1e-6, atol=1e-7)
        for name in params:
            np.testing.assert_allclose(exe.scope[name], local.scope[name], rtol=1e-6, atol=1e-7, err_msg=name)
        assert all(not np.array_equal(exe.scope[n], initial[n]) for n in params)  # they trained
    finally:
        problems = exe.close()  # COMPLETE: the pserver loops end
        servers.join()
    assert problems == []


@pytest.mark.timeout(NOT_HUNG)
def test_trainer_without_pservers_fails_naming_the_pserver():
    main, startup, _ = sgd_mlp()
    eps = endpoints("inproc")
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(min_block_size=8))
    t.transpile(0, main, ",".join(eps), trainers=1, startup_program=startup)
    exe = fluidps.Executor(runtime_config=RuntimeConfig(rpc=DEAD, context=zmq.Context()))
    try:
        with pytest.raises(
            ExecutionError, match=r"\(recv\) failed: pserver inproc://ps\d-.* has not answered"
        ) as info:
            exe.run(t.get_trainer_startup_program())
        assert isinstance(info.value.__cause__, PeerLostError)  # the peer timeout, not the request timeout
    finally:
        problems = exe.close()  # waits at most a peer timeout per pserver (the hang guard fails it otherwise)
    # One problem per pserver, each naming it: the one found dead is not waited for again.
    assert len(problems) == 2 and all(p.startswith("inproc://ps") for p in problems)
    assert any("stopped answering earlier" in p for p in problems)
    assert all(re.search("stopped answering earlier|has not answered|did not answer", p) for p in problems)


# -- Runtime ---------------------------------------------------------------------------------


@pytest.mark.timeout(NOT_HUNG)
def test_a_runtime_makes_its_pieces_when_first_used():
    runtime = Runtime(RuntimeConfig(rpc=DEAD))
    assert runtime.trainer is runtime.trainer and runtime.pserver is runtime.pserver
    assert runtime.readers is runtime.readers and runtime.has_readers
    assert runtime.pserver.queue("w@GRAD") is runtime.pserver.queue("w@GRAD")
    assert runtime.pserver_loops == []
    own = runtime.context_for("127.0.0.1:6174")
    assert runtime.context_for("ipc:///tmp/x.sock") is own
    with pytest.raises(TransportError, match=r"inproc://ps0: .*same RuntimeConfig\(context="):
        runtime.context_for("inproc://ps0")  # it could reach nobody in another runtime
    trainer = runtime.trainer
    endpoint = f"127.0.0.1:{free_port()}"  # nobody listens: close reports it within the peer timeout
    client = trainer.client(endpoint, trainer_id=2)
    assert trainer.client(endpoint) is client
    assert client.peer == f"pserver {endpoint}" and client.trainer_id == 2 and trainer.trainer_id == 2
    trainer.begin_step()
    assert trainer.step == 1
    problems = runtime.close()  # a peer timeout, not the request timeout (it names the silence)
    assert len(problems) == 1 and problems[0].startswith(f"{endpoint}: pserver {endpoint}")
    assert runtime.close() == []


def test_runtimes_sharing_a_context_reach_each_other_over_inproc():
    context = zmq.Context()
    try:
        first, second = (Runtime(RuntimeConfig(rpc=DEAD, context=context)) for _ in range(2))
        assert first.context_for("inproc://ps0") is context is second.context_for("tcp://127.0.0.1:1")
        assert first.sender != second.sender  # two participants, two incarnations
        assert first.close() == [] and second.close() == []
        assert not context.closed  # the config's context is the caller's to close
    finally:
        context.term()


def test_a_local_reader_needs_no_trainer_and_no_zeromq_context(tmp_path):
    runtime = Runtime(RuntimeConfig())
    readers = runtime.readers
    assert readers.coordinator is None and readers.samples_read() is None
    assert readers.idle_trainer() is False  # waiting for a task with no pservers to tell: nothing to do
    assert runtime._trainer is None and runtime._context is None
    assert runtime.close() == []


# -- gradient queues -------------------------------------------------------------------------


def test_gradient_queue_is_fifo():
    queue = GradientQueue()
    assert len(queue) == 0
    with pytest.raises(TransportError, match="dequeue from an empty gradient queue"):
        queue.pop()
    for i in range(3):
        queue.put(i)
    assert len(queue) == 3
    assert [queue.pop() for _ in range(3)] == [0, 1, 2]
    assert len(queue) == 0


# -- one exchange per step: sends and the fetch barrier are settled at the next wait ------


class HoldingPserver:
    """Holds SENDs of gradients alone unanswered until the trainer's next message of another
    kind (a SEND carrying a barrier or a GET, a GET, a COMPLETE) arrives, then answers them
    all: a trainer that waited on its gradients would hang there (and fail on its request
    timeout)."""

    def __init__(self, net: Net, endpoint: str, reject: str = ""):
        self.reject = reject
        self.harness = net.serve(endpoint, SETTINGS, handler=self.handle)

    def handle(self, request):
        msg = request.msg
        if msg.kind == Kind.SEND and not (msg.names or msg.barrier):
            return None
        for held in self.harness.held:
            if self.reject and self.reject in held.msg.tensors:
                self.harness.server.error(held, f"owns no gradient named {self.reject!r}")
            else:
                self.harness.server.reply(held)
        self.harness.held.clear()
        if msg.names:
            return Message(Kind.VALUES, tensors={n: np.full(2, 7.0, np.float32) for n in msg.names})
        return Message(Kind.OK)


def test_a_step_is_one_message_per_pserver(net):
    eps = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    pservers = [HoldingPserver(net, ep) for ep in eps]
    runtime = Runtime(RuntimeConfig(rpc=SETTINGS))
    trainer = runtime.trainer
    try:
        trainer.begin_step()
        grads = [(eps[i % 2], f"w{i}@GRAD", np.full(3, i, np.float32)) for i in range(4)]
        trainer.send(grads[:2], trainer_id=0, bucket_bytes=1 << 20)  # held: under the bucket size
        trainer.send(grads[2:], trainer_id=0, bucket_bytes=1 << 20)
        trainer.send_barrier(eps, trainer_id=0)  # held too: it rides on the GET
        values = trainer.get([(eps[i % 2], f"w{i}") for i in range(4)], trainer_id=0)
        assert [v.tolist() for v in values] == [[7.0, 7.0]] * 4
        trainer.fetch_barrier(eps, trainer_id=0)  # sends nothing
        trainer.end_step()
        trainer.begin_step()
        trainer.send(grads, trainer_id=0)  # bucket 0: at once, not waited for
        trainer.send_barrier(eps, trainer_id=0)
        trainer.end_step()  # no GET this step: the barrier goes alone, not waited for
    finally:
        assert runtime.close() == []  # ...but the COMPLETE waits, after them
    for i, pserver in enumerate(pservers):
        delivered = pserver.harness.delivered
        assert [Kind.Name(m.kind) for m in delivered] == ["SEND", "SEND", "SEND", "COMPLETE"]
        step, grads_only, barrier_only = delivered[:3]
        # Step 1: its gradients, its barrier and its GET are one message per pserver.
        assert sorted(step.tensors) == [f"w{j}@GRAD" for j in (i, i + 2)]
        assert step.barrier and step.names == [f"w{j}" for j in (i, i + 2)] and step.step == 1
        assert sorted(grads_only.tensors) == sorted(step.tensors) and not grads_only.barrier
        assert barrier_only.barrier and not barrier_only.tensors and not barrier_only.names
        assert grads_only.step == barrier_only.step == 2


def test_a_rejected_gradient_fails_the_next_wait_naming_the_pserver(net):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    HoldingPserver(net, endpoint, reject="typo@GRAD")
    runtime = Runtime(RuntimeConfig(rpc=SETTINGS))
    trainer = runtime.trainer
    try:
        trainer.begin_step()
        trainer.send([(endpoint, "typo@GRAD", np.ones(2, np.float32))], trainer_id=0)
        trainer.send_barrier([endpoint], trainer_id=0)
        with pytest.raises(RemoteError, match=rf"pserver {endpoint} .*owns no gradient named 'typo@GRAD'"):
            trainer.get([(endpoint, "w")], trainer_id=0)
    finally:
        assert runtime.close() == []


def test_a_communication_op_built_without_a_runtime_names_itself():
    main, startup, _ = sgd_mlp()
    t = fluidps.DistributeTranspiler()
    t.transpile(0, main, "127.0.0.1:6174", trainers=1, startup_program=startup)
    with pytest.raises(ExecutionError, match=r"op #\d+ \(send\): op 'send' takes part in a distributed job"):
        PreparedProgram(t.get_trainer_program(), [])  # an Executor would have given it one


@pytest.mark.parametrize("job_endpoints", ["inproc", "tcp"], indirect=True)
def test_a_value_set_on_a_pserver_is_its_own(job_endpoints):
    """A SET's value is kept without a copy when it came over TCP (the frame is the
    pserver's memory) and copied over inproc (the frame may be the sender's array): either
    way, what the sender does with its array afterwards, and what the pserver's optimizer
    does to its value, do not reach each other."""
    # A 512 x 512 weight: its frames are past zmq's copy threshold.
    main, startup, loss = build_mlp(hidden=512, classes=3)
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.SGD(0.1).minimize(loss)
    eps = job_endpoints
    t = fluidps.DistributeTranspiler(fluidps.DistributeTranspilerConfig(slice_var_up=False))
    t.transpile(0, main, ",".join(eps), trainers=1, startup_program=startup)
    servers = PserverThreads(t, eps, SETTINGS)
    exe = servers.trainer_executor()
    client = None
    try:
        exe.run(t.get_trainer_startup_program())
        whole = max(t.plan.slices, key=lambda s: s.rows * (s.shape[1] if len(s.shape) > 1 else 1))
        assert np.prod(whole.shape) * 4 > zmq.COPY_THRESHOLD
        sent = np.full(whole.shape, 0.001, np.float32)  # small: the softmax is not saturated
        client = RpcClient(servers.context, whole.endpoint, "pserver", SETTINGS)
        client.call(Message(Kind.SET, tensors={whole.name: sent}))
        sent[...] = 7.0  # the sender reuses its array
        (got,) = client.call(Message(Kind.GET, names=[whole.name])).tensors.values()
        got = np.array(got, copy=True)  # (over inproc, a reply may be the pserver's array itself)
        np.testing.assert_array_equal(got, np.full(whole.shape, 0.001, np.float32))
        exe.run(t.get_trainer_startup_program())  # the trainer pulls it, then trains on it
        feed = {"x": np.ones((4, 64), np.float32), "y": np.zeros((4, 1), np.int64)}
        exe.run(t.get_trainer_program(), feed=feed, fetch_list=[loss])
        (after,) = client.call(Message(Kind.GET, names=[whole.name])).tensors.values()
        assert not np.array_equal(after, got)  # the optimizer updated the pserver's value...
        np.testing.assert_array_equal(sent, np.full(whole.shape, 7.0, np.float32))  # ...not the sender's
    finally:
        if client is not None:
            client.close()
        problems = exe.close()
        servers.join()
    assert problems == []
