"""send_v2 and recv_v2: a value crossing from one pipeline stage to another.

fluidps.PipelineTranspiler puts a send_v2 on the stage that makes an activation
(or, going back, a gradient) and a recv_v2 on the stage that reads it, with
Paddle's op names and attributes (`peer`: the other stage). Which micro-batch a
value belongs to is the stage channel's business (the runtime's `stages`, set by
whoever runs the stage: fluidps.executor.pipeline): ops never see the schedule.
"""

from __future__ import annotations

from fluidps.ops.defs import Bool, In, Int, Ints, Out
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.registry import OpFamily

family = OpFamily("pipeline")

_PEER = (Int("ring_id", 0), Int("peer", 0, lambda p: p >= 0, "peer (a stage) must be >= 0"))

family.define(
    "send_v2",
    inputs=[In("X")],
    attrs=[*_PEER, Bool("use_calc_stream", False), Bool("dynamic_shape", False)],
)
family.define(
    "recv_v2",
    outputs=[Out("Out")],
    attrs=[
        *_PEER,
        Ints("out_shape", []),
        Int("dtype", 5),
        Bool("use_calc_stream", False),
        Bool("dynamic_shape", False),
    ],
)


@family.kernel("send_v2")
def _send_v2_kernel(op: KernelOp) -> Runner:
    name, peer, stages = op.input("X"), op.attr("peer"), op.runtime.stages

    def run(env: Env) -> None:
        stages.send(peer, name, env[name])

    return run


@family.kernel("recv_v2")
def _recv_v2_kernel(op: KernelOp) -> Runner:
    name, peer, stages = op.output("Out"), op.attr("peer"), op.runtime.stages

    def run(env: Env) -> None:
        env[name] = stages.recv(peer, name)

    return run
