"""What a pipeline stage keeps of its peers' STAGE_SEND messages: only another stage's
values of this step (or the next: a launched peer may be a step ahead) and one of its
micro-batches, and a bounded number of them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zmq

from fluidps.errors import Error
from fluidps.executor.pipeline import channel as stage_channel
from fluidps.executor.pipeline.channel import RemoteStageChannel
from fluidps.executor.transport.settings import RpcSettings
from fluidps.executor.transport.wire import Kind, Message


@pytest.fixture
def channel():
    context = zmq.Context()
    ends = ["tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "tcp://127.0.0.1:3"]
    channel = RemoteStageChannel(1, ends, RpcSettings(heartbeat_interval=0.05), context, micro_batches=2)
    yield channel
    channel.close()
    context.term()


def sent(src: str, step: int = 0, micro_batch: int = 0, **tensors) -> Message:
    return Message(Kind.STAGE_SEND, tensors=tensors, text=src, step=step, micro_batch=micro_batch)


def test_a_peers_value_waits_for_the_micro_batch_it_belongs_to(channel):
    channel.deliver(sent("0", micro_batch=1, h=np.ones(3, np.float32)))
    channel.deliver(sent("0", micro_batch=0, h=np.zeros(3, np.float32)))
    channel.micro_batch = 0
    np.testing.assert_array_equal(channel.recv(0, "h"), np.zeros(3))
    channel.micro_batch = 1
    np.testing.assert_array_equal(channel.recv(0, "h"), np.ones(3))


def test_a_value_of_the_next_step_waits_for_that_step(channel):
    channel.deliver(sent("0", step=1, h=np.ones(3, np.float32)))
    channel.deliver(sent("0", step=0, h=np.zeros(3, np.float32)))
    np.testing.assert_array_equal(channel.recv(0, "h"), np.zeros(3))
    channel.next_step()
    np.testing.assert_array_equal(channel.recv(0, "h"), np.ones(3))
    with pytest.raises(Error, match="for step 0, micro-batch 0: this stage is at step 1"):
        channel.deliver(sent("0", step=0, h=np.ones(1)))


@pytest.mark.parametrize(
    ("msg", "message"),
    [
        (sent("1", h=np.ones(1)), "not another stage"),
        (sent("7", h=np.ones(1)), "not another stage"),
        (sent("x", h=np.ones(1)), "not another stage"),
        (sent("0"), "without values"),
        (sent("0", step=2, h=np.ones(1)), "for step 2, micro-batch 0: this stage is at step 0"),
        (sent("0", micro_batch=2, h=np.ones(1)), "micro-batch 2: this stage is at step 0 of 2 micro-batches"),
    ],
)
def test_what_is_no_peers_value_of_this_step_is_refused(channel, msg, message):
    with pytest.raises(Error, match=message):
        channel.deliver(msg)


def test_a_peer_cannot_make_a_stage_keep_values_without_bound(channel, monkeypatch):
    monkeypatch.setattr(stage_channel, "MAX_WAITING", 3)
    for name in ("a", "b", "c"):
        channel.deliver(sent("0", **{name: np.ones(1)}))
    with pytest.raises(Error, match="3 values wait here already"):
        channel.deliver(sent("2", d=np.ones(1)))


@pytest.mark.timeout(60)
def test_a_stage_waiting_for_a_peer_that_is_gone_says_which_within_the_peer_timeout():
    context = zmq.Context()
    nobody = "tcp://127.0.0.1:9"  # (the discard port: nothing answers there)
    settings = RpcSettings(heartbeat_interval=0.05, peer_timeout=1.0, warmup_timeout=1.5)
    channel = RemoteStageChannel(1, [nobody, "tcp://127.0.0.1:2"], settings, context, micro_batches=1)
    try:
        with pytest.raises(
            Error,
            match=r"stage 1 waited for 'h' \(step 0, micro-batch 0\) from stage 0, which never answered",
        ):
            channel.recv(0, "h")
    finally:
        channel.close()
        context.term()


def test_a_stage_waiting_for_a_value_hears_at_once_that_its_server_stopped(channel):
    threading.Timer(0.2, channel.stop_hearing, args=("its server stopped: ZMQError: boom",)).start()
    with pytest.raises(
        Error, match=r"stage 1 waited for 'h' from stage 0, but it no longer hears its peers: .*boom"
    ):
        channel.recv(0, "h")
