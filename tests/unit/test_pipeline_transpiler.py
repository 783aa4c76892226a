"""Stages in a program (device_guard, the placement rules), PipelineOptimizer, and the
PipelineTranspiler's stage programs, schedules and refusals."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import fluidps
from fluidps import layers
from fluidps.errors import BuilderError, FeedError, UnsupportedError
from fluidps.ir.devices import PipelineConfig, parse_device
from fluidps.ir.graph import STAGE_COLOURS, to_dot
from fluidps.ir.stages import assign_stages
from fluidps.ops import REGISTRY
from fluidps.transpiler.pipeline_plan import schedule


def two_stage_mlp(m: int = 4, optimizer=None, schedule_mode: str = "1F1B"):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        y = layers.data("y", [1], dtype="int64")
        with fluidps.device_guard("stage:0"):
            h = layers.fc(x, 8, act="relu")
        with fluidps.device_guard("stage:1"):
            logits = layers.fc(h, 3)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))  # (no guard: from its inputs)
        inner = optimizer or fluidps.optimizer.SGD(0.1)
        fluidps.optimizer.PipelineOptimizer(inner, num_microbatches=m, schedule_mode=schedule_mode).minimize(
            loss
        )
    return main, startup, loss


def op_types(program) -> list[str]:
    return [op.type for op in program.global_block().ops]


# -- stages in the program -------------------------------------------------------------------


def test_device_guard_sets_paddles_op_device_on_the_ops_built_inside_it_and_nests():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        with fluidps.device_guard("stage:1"):
            a = layers.fc(x, 3)
            with fluidps.device_guard("gpu:0"):
                b = layers.relu(a)
            c = layers.relu(b)
        layers.relu(c)
    devices = [op.attr("op_device") if op.has_attr("op_device") else "" for op in main.global_block().ops]
    assert devices == ["stage:1", "stage:1", "gpu:0", "stage:1", ""]


@pytest.mark.parametrize(
    ("device", "stage"), [("stage:3", 3), ("gpu:2", 2), ("xpu:1", 1), ("gpu", 0), ("cpu", None), ("", None)]
)
def test_paddle_device_strings_name_stages(device, stage):
    assert parse_device(device) == stage


@pytest.mark.parametrize("device", ["stage", "stage:-1", "gpu:x", "tpu:0", "stage: 1"])
def test_a_device_that_is_no_stage_is_refused_by_name(device):
    with (
        pytest.raises(BuilderError, match=f"device_guard: {device!r} is not a device"),
        fluidps.device_guard(device),
    ):
        pass


def test_every_op_gets_a_stage_backward_follows_forward_and_updates_follow_their_parameter():
    main, _, _ = two_stage_mlp()
    ops = main.global_block().ops
    placed = {(op.type, tuple(op.input_arg_names)): op.attr("op_device") for op in ops}
    assert all(op.attr("op_device") in ("stage:0", "stage:1") for op in ops)
    # the loss, built outside any guard, runs where its inputs are made
    assert placed[("mean", ("softmax_with_cross_entropy_0.tmp_1",))] == "stage:1"
    for op in ops:
        if op.type == "sgd":  # where the parameter is read
            assert op.attr("op_device") == (
                "stage:0" if op.input("Param")[0].startswith("fc_0") else "stage:1"
            )
        if op.type == "mul_grad":  # where its forward op runs
            assert op.attr("op_device") == ("stage:0" if op.input("Y")[0] == "fc_0.w_0" else "stage:1")
    assert main.pipeline == PipelineConfig(4, "1F1B", 2)
    assert main.clone().pipeline == main.pipeline and main.clone(for_test=True).pipeline is None


def test_a_program_without_stages_is_refused_rather_than_run_as_one_stage():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        loss = layers.mean(layers.fc(layers.data("x", [4]), 1))
        with pytest.raises(BuilderError, match=r"no op of the program is placed on a stage.*device_guard"):
            fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), num_microbatches=2).minimize(loss)
        # said explicitly, one stage is gradient accumulation
        fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), 2, num_stages=1).minimize(loss)
    assert main.pipeline.num_stages == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_microbatches": 0}, "num_microbatches must be an integer >= 1"),
        ({"num_microbatches": 2, "schedule_mode": "zigzag"}, "schedule_mode must be one of 1F1B, F-then-B"),
        ({"num_microbatches": 2, "num_stages": 0}, "num_stages must be an integer >= 1"),
    ],
)
def test_a_bad_pipeline_configuration_is_refused_by_name(kwargs, message):
    with pytest.raises(BuilderError, match=message):
        fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), **kwargs)


# -- the transpiler ------------------------------------------------------------------------


def test_each_stage_program_holds_its_ops_the_crossings_accumulation_and_updates():
    main, _, _ = two_stage_mlp(m=4)
    before = main.serialize_to_string()
    plan = fluidps.PipelineTranspiler().transpile(main)
    assert main.serialize_to_string() == before  # a pass: the input is left as it was
    first, last = plan.stages
    assert op_types(first.program) == [
        *("mul", "elementwise_add", "relu", "send_v2"),  # forward, and its activation out
        *("recv_v2", "relu_grad", "elementwise_add_grad", "mul_grad", "sum", "sum"),  # gradient in, summed
        *("sgd", "sgd"),  # once a mini-batch (StageRunner zeroes the sums at each step's start)
    ]
    assert op_types(last.program) == [
        *("recv_v2", "mul", "elementwise_add", "softmax_with_cross_entropy", "mean"),
        *(
            "fill_constant",
            "mean_grad",
            "softmax_with_cross_entropy_grad",
            "elementwise_add_grad",
            "mul_grad",
        ),
        *("sum", "sum", "send_v2", "sgd", "sgd"),
    ]
    assert [(c.var, c.src, c.dst, c.phase) for c in plan.crossings] == [
        ("fc_0.tmp_2", 0, 1, "forward"),
        ("fc_0.tmp_2@GRAD", 1, 0, "backward"),
    ]
    seed = next(op for op in last.program.global_block().ops if op.type == "fill_constant")
    assert seed.attr("value") == 0.25  # the loss gradient: 1 / m of it per micro-batch
    sgd = [op for op in first.program.global_block().ops if op.type == "sgd"]
    assert [op.input("Grad") for op in sgd] == [["fc_0.w_0@GRAD@MERGED"], ["fc_0.b_0@GRAD@MERGED"]]
    assert first.params == ("fc_0.w_0", "fc_0.b_0") and last.params == ("fc_1.w_0", "fc_1.b_0")
    assert first.param_bytes == (4 * 8 + 8) * 4 and last.param_bytes == (8 * 3 + 3) * 4
    assert first.feeds == ("x",) and last.feeds == ("y",)
    # a stage's forward and backward programs, the way a schedule runs them
    assert op_types(first.forward) == ["mul", "elementwise_add", "relu", "send_v2"]
    assert op_types(first.optimize) == ["sgd", "sgd"]
    assert "fc_0.tmp_2" in first.stash and "x" in first.stash
    summary = plan.summary(batch_rows=8)
    assert "2 stages, 4 micro-batches, schedule 1F1B" in summary
    assert "fc_0.tmp_2 stage 0 -> 1" in summary and "160" in summary  # 40 parameters of float32 on stage 0


def test_schedules_are_data_and_1f1b_holds_at_most_stages_after_it_plus_one():
    assert schedule("F-then-B", 0, 2, 3) == (("F", 0), ("F", 1), ("F", 2), ("B", 0), ("B", 1), ("B", 2))
    assert schedule("1F1B", 0, 2, 3) == (("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("B", 2))
    assert schedule("1F1B", 1, 2, 3) == (("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2))
    assert schedule("1F1B", 0, 4, 2) == (
        ("F", 0),
        ("F", 1),
        ("B", 0),
        ("B", 1),
    )  # fewer micro-batches than stages
    for stages in (2, 3, 4):
        for m in (1, 2, 5, 8):
            for stage in range(stages):
                live, peak = 0, 0
                for kind, _ in schedule("1F1B", stage, stages, m):
                    live += 1 if kind == "F" else -1
                    peak = max(peak, live)
                assert peak == min(stages - stage, m)


def _placed(main, index, device):
    main.global_block().ops[index].set_attr("op_device", device)


def test_a_stage_with_no_ops_is_refused_naming_it():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        with fluidps.device_guard("stage:0"):
            h = layers.fc(x, 8)
        with fluidps.device_guard("stage:2"):
            loss = layers.mean(layers.fc(h, 1))
        with pytest.raises(UnsupportedError, match=r"pipeline stage 1 has no ops.*device_guard\('stage:1'\)"):
            fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), 2).minimize(loss)


def test_an_activation_that_would_go_back_a_stage_is_refused():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        with fluidps.device_guard("stage:1"):
            h = layers.fc(x, 8)
        with fluidps.device_guard("stage:0"):
            layers.mean(layers.fc(h, 1))
    with pytest.raises(
        UnsupportedError, match=r"on pipeline stage 0 reads 'fc_0.tmp_1', which stage 1 makes"
    ):
        assign_stages(main)


def test_a_variable_written_on_two_stages_is_refused_naming_both_ops():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        with fluidps.device_guard("stage:0"):
            h = layers.relu(x)
        with fluidps.device_guard("stage:1"):
            layers.relu(x)
    block = main.global_block()
    REGISTRY.append_op(block, "relu", {"X": [x.name]}, {"Out": [h.name]}, {"op_device": "stage:1"})
    with pytest.raises(UnsupportedError, match=r"variable 'relu_0.tmp_0' is written on two pipeline stages"):
        assign_stages(main)


def test_a_cut_inside_a_control_flow_block_is_refused():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        with fluidps.device_guard("stage:0"):
            layers.relu(x)
    sub = main.create_block()
    REGISTRY.append_op(sub, "relu", {"X": [x.name]}, {"Out": [x.name]}, {"op_device": "stage:1"})
    main.rollback()
    REGISTRY.append_op(
        main.global_block(),
        "listen_and_serv",
        {},
        {},
        {"endpoint": "127.0.0.1:1", "optimize_blocks": [sub.idx]},
    )
    with pytest.raises(UnsupportedError, match=r"cannot cut inside a control-flow block"):
        assign_stages(main)


def test_sparse_gradients_and_global_clipping_are_refused_with_what_to_do():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [1], dtype="int64")
        with fluidps.device_guard("stage:0"):
            emb = layers.embedding(ids, size=[10, 4], is_sparse=True)
        with fluidps.device_guard("stage:1"):
            loss = layers.mean(layers.fc(emb, 1))
        fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), 2).minimize(loss)
    with pytest.raises(UnsupportedError, match=r"sparse gradient.*is_sparse=False"):
        fluidps.PipelineTranspiler().transpile(main)

    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [4])
        with fluidps.device_guard("stage:0"):
            h = layers.fc(x, 4)
        with fluidps.device_guard("stage:1"):
            loss = layers.mean(layers.fc(h, 1))
        clipped = fluidps.optimizer.SGD(0.1, grad_clip=fluidps.GradientClipByGlobalNorm(1.0))
        with pytest.raises(UnsupportedError, match=r"global-norm clipping.*clip each parameter"):
            fluidps.optimizer.PipelineOptimizer(clipped, 2).minimize(loss)


def test_a_batch_the_micro_batches_cannot_share_is_refused_naming_the_feed():
    main, startup, loss = two_stage_mlp(m=4)
    exe = fluidps.Executor()
    exe.run(startup)
    feed = {"x": np.ones((6, 4), np.float32), "y": np.zeros((6, 1), np.int64)}
    with pytest.raises(FeedError, match=r"feed 'x' has 6 rows, which 4 micro-batches cannot share equally"):
        exe.run(main, feed=feed, fetch_list=[loss])


def test_a_feed_missing_what_a_stage_reads_is_refused_naming_it():
    main, startup, loss = two_stage_mlp(m=2)
    exe = fluidps.Executor()
    exe.run(startup)
    with pytest.raises(FeedError, match=r"stages read 'y' from the feed, which does not hold them: add them"):
        exe.run(main, feed={"x": np.ones((4, 4), np.float32)}, fetch_list=[loss])


def test_the_transpiler_needs_a_pipeline_program():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        fluidps.optimizer.SGD(0.1).minimize(layers.mean(layers.fc(layers.data("x", [4]), 1)))
    with pytest.raises(UnsupportedError, match="no pipeline configuration: minimize its loss with"):
        fluidps.PipelineTranspiler().transpile(main)


# -- seeing the cut ------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120
    )


def test_fluidps_transpile_pipeline_writes_each_stage_and_the_placement(tmp_path):
    main, _, _ = two_stage_mlp(m=2)
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())  # (the file keeps op_device, not m)
    out = tmp_path / "stages"
    result = run_cli(
        "transpile", str(tmp_path / "main.pb"), "--pipeline", "--microbatches", "4", "-o", str(out)
    )
    assert result.returncode == 0, result.stderr
    assert "2 stages, 4 micro-batches, schedule 1F1B" in result.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "placement.json", "placement.txt", "stage_0.dot", "stage_0.pb", "stage_1.dot", "stage_1.pb",
    ]  # fmt: skip
    plan = fluidps.PipelineTranspiler().transpile(main, PipelineConfig(4, "1F1B", 2))
    for s in plan.stages:  # the files are the plan's programs
        assert (out / f"stage_{s.stage}.pb").read_bytes() == s.program.serialize_to_string()
    data = json.loads((out / "placement.json").read_text())
    assert [p["stage"] for p in data["placement"]] == [
        int(op.attr("op_device").split(":")[1]) for op in main.global_block().ops
    ]
    assert data["stages"][0]["schedule"] == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert "    0      0  mul" in (out / "placement.txt").read_text()
    refused = run_cli("transpile", str(tmp_path / "main.pb"), "-o", str(out))
    assert refused.returncode != 0 and "--startup and --pservers are needed" in refused.stderr


def test_fluidps_dot_fills_each_op_with_its_stages_colour_and_a_legend(tmp_path):
    main, _, _ = two_stage_mlp()
    dot = to_dot(main)
    stage_of = {i: int(op.attr("op_device").split(":")[1]) for i, op in enumerate(main.global_block().ops)}
    for i, stage in stage_of.items():
        assert f'"op:0:{i}" [shape=box, style="rounded,filled", fillcolor="{STAGE_COLOURS[stage]}"' in dot
    assert (
        f'"legend:0" [shape=box, style="rounded,filled", fillcolor="{STAGE_COLOURS[0]}", label="stage 0"]'
        in dot
    )
    assert '"legend:0" -> "legend:1" [style=invis]' in dot
    plain = to_dot(fluidps.Program())
    assert "legend" not in plain
