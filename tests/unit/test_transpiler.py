"""DistributeTranspiler: exact program structure per role and mode, placement,
determinism, and programs written by Paddle."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import pytest
from transpiler_models import EPS2, mlp, ops, sparse_model, transpile

import fluidps
from fluidps import layers, optimizer
from helpers import paddle_fixture


def rpc_tail(program, n_forward_backward):
    return ops(program)[n_forward_backward:]


# -- structure -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_mlp_trainer_program(mode):
    main, startup = mlp()
    t, _plan = transpile(main, startup, mode, send_bucket_bytes=0)
    trainer = t.get_trainer_program()
    forward = [
        "mul",
        "elementwise_add",
        "relu",
        "mul",
        "elementwise_add",
        "softmax_with_cross_entropy",
        "mean",
    ]
    # With no bucket, each gradient is sent right after the op that computes it, in
    # backward order: fc_1's weight and bias while fc_0's gradients are still to come.
    # fc_0.w_0 [64, 256] (16384 values) is cut in two; fc_1.w_0 [256, 10] and the biases stay whole.
    backward = [
        "fill_constant", "mean_grad", "softmax_with_cross_entropy_grad",
        "elementwise_add_grad", "send",  # fc_1.b_0@GRAD
        "mul_grad", "send",  # fc_1.w_0@GRAD
        "relu_grad", "elementwise_add_grad", "send",  # fc_0.b_0@GRAD
        "mul_grad", "split_byref", "send",  # fc_0.w_0@GRAD, cut into its two blocks
    ]  # fmt: skip
    barrier = mode == "sync"
    tail = ["send_barrier"] * barrier + ["recv"] + ["fetch_barrier"] * barrier + ["concat"]
    assert ops(trainer) == forward + backward + tail
    assert "adam" not in ops(trainer) and "learning_rate_0" not in trainer.global_block().vars
    block = trainer.global_block().ops
    sends = [op for op in block if op.type == "send"]
    for op in sends:  # each send follows the last op writing what it sends (or the split of it)
        i = block.index(op)
        written = set(block[i - 1].output_arg_names) | set(block[i - 2].output_arg_names)
        assert set(op.input("X")) & written or block[i - 1].type == "send"
    split = next(op for op in block if op.type == "split_byref")
    assert split.output("Out") == ["fc_0.w_0@GRAD.block0", "fc_0.w_0@GRAD.block1"]
    grads = [
        "fc_0.w_0@GRAD.block0",
        "fc_0.w_0@GRAD.block1",
        "fc_0.b_0@GRAD",
        "fc_1.w_0@GRAD",
        "fc_1.b_0@GRAD",
    ]
    sent = [n for op in sends for n in op.input("X")]
    assert sorted(sent) == sorted(n for op in sends for n in op.attr("send_varnames")) == sorted(grads)
    assert all(op.attr("bucket_bytes") == 0 for op in sends)
    # One recv carries every slice, each from its owner.
    recv = next(op for op in block if op.type == "recv")
    params = ["fc_0.w_0.block0", "fc_0.w_0.block1", "fc_0.b_0", "fc_1.w_0", "fc_1.b_0"]
    assert sorted(recv.output("Out")) == sorted(recv.attr("recv_varnames")) == sorted(params)
    owner = dict(zip(recv.attr("recv_varnames"), recv.attr("epmap"), strict=True))
    assert [owner["fc_0.w_0.block0"], owner["fc_0.w_0.block1"]] == ["127.0.0.1:6170", "127.0.0.1:6171"]
    sent_to = {
        name: ep for op in sends for name, ep in zip(op.attr("send_varnames"), op.attr("epmap"), strict=True)
    }
    assert all(sent_to[f"{p.replace('.block', '@GRAD.block')}"] == owner[p] for p in params if "block" in p)
    assert all(sent_to[f"{p}@GRAD"] == owner[p] for p in params if "block" not in p)
    assert recv.attr("staleness") == 0 and recv.attr("sync_mode") == (mode == "sync")


def test_mlp_pserver_programs_sync():
    main, startup = mlp()
    t, _plan = transpile(main, startup, "sync", trainers=3)
    ps, ps_startup = t.get_pserver_programs("127.0.0.1:6170")
    assert ops(ps) == ["listen_and_serv"]
    serve = ps.global_block().ops[0]
    blocks = serve.attr("optimize_blocks")
    assert all(ops(ps, b) == ["sum", "scale", "adam"] for b in blocks)
    assert (
        serve.attr("Fanin") == 3
        and serve.attr("distributed_mode") == 0
        and serve.attr("lr_decay_block_id") == -1
    )
    first = ps.block(blocks[0]).ops
    assert first[0].input("X") == [f"fc_0.w_0@GRAD.block0.trainer_{i}" for i in range(3)]
    assert first[1].attr("scale") == pytest.approx(1 / 3)
    adam = first[2]
    assert adam.input("Param") == ["fc_0.w_0.block0"] and adam.input("Moment1") == [
        "fc_0.w_0_moment1_0.block0"
    ]
    assert ps.global_block().var("fc_0.w_0_moment1_0.block0").shape == (32, 256)
    assert ps.global_block().var("fc_0.w_0_beta1_pow_acc_0.block0").shape == (1,)  # scalars stay whole
    assert serve.attr("grad_to_block_id")[0] == f"fc_0.w_0@GRAD.block0:{blocks[0]}"
    # Startup: the slices' initializers with the slice's shape.
    init = {op.output_arg_names[0]: op for op in ps_startup.global_block().ops}
    assert init["fc_0.w_0.block0"].type == "uniform_random" and init["fc_0.w_0.block0"].attr("shape") == [
        32,
        256,
    ]
    assert init["fc_0.w_0_beta1_pow_acc_0.block0"].attr("value") == pytest.approx(0.9)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_pserver_queues_in_async_modes(mode):
    main, startup = mlp()
    config = {"staleness": 3} if mode == "ssp" else {"send_interval": 2, "recv_interval": 4}
    t, _plan = transpile(main, startup, mode, **config)
    ps = t.get_pserver_program("127.0.0.1:6171")
    serve = ps.global_block().ops[0]
    for block in serve.attr("optimize_blocks"):
        assert ops(ps, block) == ["dequeue", "adam"]
    queues = dict(pair.rsplit(":", 1) for pair in serve.attr("grad_to_queue_block_id"))
    for grad, block in queues.items():
        (enqueue,) = ps.block(int(block)).ops
        assert enqueue.type == "enqueue" and enqueue.attr("queue_name") == grad == enqueue.input("X")[0]
    assert serve.attr("distributed_mode") == {"async": 1, "ssp": 4}[mode]
    trainer = t.get_trainer_program()
    send = next(op for op in trainer.global_block().ops if op.type == "send")
    recv = next(op for op in trainer.global_block().ops if op.type == "recv")
    if mode == "ssp":
        assert recv.attr("staleness") == 3 and serve.attr("staleness") == 3
    else:
        assert send.attr("send_interval") == 2 and recv.attr("recv_interval") == 4


def test_sparse_embedding_travels_as_row_ranges():
    main, startup = sparse_model()
    t, _plan = transpile(main, startup)
    trainer = t.get_trainer_program()
    split = next(op for op in trainer.global_block().ops if op.type == "split_selected_rows")
    assert split.attr("height_sections") == [50000, 50000]
    assert [trainer.global_block().var(n).type for n in split.output("Out")] == [
        fluidps.VarType.SELECTED_ROWS
    ] * 2
    ps = t.get_pserver_program("127.0.0.1:6170")
    serve = ps.global_block().ops[0]
    assert serve.attr("sparse_grad_to_param") == ["embedding_0.w_0@GRAD.block0:embedding_0.w_0.block0"]
    block = int(serve.attr("grad_to_block_id")[0].rsplit(":", 1)[1])
    assert ops(ps, block) == ["sum", "scale", "sgd"]
    assert (
        ps.global_block().var("embedding_0.w_0@GRAD.block0.trainer_1").type == fluidps.VarType.SELECTED_ROWS
    )


def test_learning_rate_schedule_runs_on_the_pservers():
    main, startup = mlp(decay=True, l2=True)
    t, _plan = transpile(main, startup)
    trainer = t.get_trainer_program()
    assert "increment" not in ops(trainer) and "elementwise_pow" not in ops(trainer)
    assert "@LR_DECAY_COUNTER@" not in trainer.global_block().vars
    ps, ps_startup = t.get_pserver_programs("127.0.0.1:6170")
    serve = ps.global_block().ops[0]
    lr_block = serve.attr("lr_decay_block_id")
    assert ops(ps, lr_block) == [
        "increment",
        "cast",
        "scale",
        "floor",
        "fill_constant",
        "elementwise_pow",
        "scale",
    ]
    # Weight decay of each slice runs before its optimizer op, on the slice.
    for block in serve.attr("optimize_blocks"):
        assert ops(ps, block) == ["sum", "scale", "scale", "sum", "adam"]
    assert "@LR_DECAY_COUNTER@" in {n for op in ps_startup.global_block().ops for n in op.output_arg_names}


def test_global_norm_clipping_stays_on_the_trainer():
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [8])
        loss = layers.mean(layers.fc(layers.fc(x, 4), 1))
        optimizer.SGD(0.1, grad_clip=fluidps.GradientClipByGlobalNorm(1.0)).minimize(loss)
    t, plan = transpile(main, startup)
    trainer_ops = ops(t.get_trainer_program())
    # Every send waits for the clipping, which needs every gradient.
    assert "sqrt" in trainer_ops and trainer_ops.index("sqrt") < trainer_ops.index("send")
    assert plan.notes and "global-norm clipping" in plan.notes[0]
    sends = [op for op in t.get_trainer_program().global_block().ops if op.type == "send"]
    assert len(sends) == 4 and all(".clipped_" in name for op in sends for name in op.input("X"))


# -- startup, placement, determinism -----------------------------------------------------


def test_trainer_startup_receives_parameters_instead_of_initializing_them():
    main, startup = mlp()
    t, _plan = transpile(main, startup)
    trainer_startup = t.get_startup_program()
    assert ops(trainer_startup) == ["recv", "fetch_barrier", "concat"]
    assert set(trainer_startup.global_block().vars) >= {"fc_0.w_0", "fc_0.w_0.block0", "fc_1.b_0"}


def test_slices_cover_every_row_once():
    main, startup = sparse_model(vocab=100_003)
    _, plan = transpile(
        main, startup, pservers=",".join(f"127.0.0.1:{6170 + i}" for i in range(3)), min_block_size=100
    )
    slices = plan.slices_of("embedding_0.w_0")
    assert [s.offset for s in slices] == [0, 33335, 66670]
    assert sum(s.rows for s in slices) == 100_003
    assert [s.name for s in slices] == [f"embedding_0.w_0.block{i}" for i in range(3)]


def test_hash_name_placement_uses_crc32():
    main, startup = mlp()
    endpoints = [f"127.0.0.1:{6170 + i}" for i in range(4)]
    _, plan = transpile(main, startup, pservers=",".join(endpoints), split_method="HashName")
    for s in plan.slices:
        assert s.endpoint == endpoints[zlib.crc32(s.name.encode()) % 4]


@pytest.mark.parametrize("n", range(2, 9))
def test_bytes_per_pserver_stay_balanced(n):
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [26], dtype="int64")
        dense = layers.data("dense", [13])
        y = layers.data("y", [1], dtype="int64")
        emb = layers.reshape(layers.embedding_v2(ids, [1_000_000, 8], is_sparse=True), [-1, 208])
        h = layers.fc(layers.concat([emb, dense], axis=1), 64, act="relu")
        h = layers.fc(h, 32, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 2), y))
        optimizer.Adam(0.001, lazy_mode=True).minimize(loss)
    endpoints = ",".join(f"127.0.0.1:{6170 + i}" for i in range(n))
    _, plan = transpile(main, startup, pservers=endpoints, split_method="RoundRobin")
    per = plan.bytes_per_pserver().values()
    assert len(per) == n and max(per) / min(per) <= 1.5


MODELS = {"mlp": mlp, "sparse": sparse_model, "lr_decay": lambda: mlp(decay=True, l2=True)}
MODE_CONFIG = {"sync": {}, "async": {"send_interval": 2}, "ssp": {"staleness": 2}}


def _all_programs(t, plan):
    programs = [plan.trainer_program, plan.trainer_startup]
    programs += [p for ep in plan.endpoints for p in t.get_pserver_programs(ep)]
    return [p.serialize_to_string() for p in programs]


@pytest.mark.parametrize("mode", MODE_CONFIG)
@pytest.mark.parametrize("model", MODELS)
def test_same_input_gives_byte_identical_output(model, mode):
    def run(main, startup):
        return _all_programs(*transpile(main, startup, mode, trainers=2, **MODE_CONFIG[mode]))

    # The same program objects twice, and a freshly built copy (as another process builds it).
    main, startup = MODELS[model]()
    first = run(main, startup)
    assert run(main, startup) == first
    assert run(*MODELS[model]()) == first


@pytest.mark.parametrize("mode", MODE_CONFIG)
@pytest.mark.parametrize("model", MODELS)
def test_input_programs_are_not_modified(model, mode):
    main, startup = MODELS[model]()
    before = (main.serialize_to_string(), startup.serialize_to_string())
    revisions = (main.revision, startup.revision)
    t, plan = transpile(main, startup, mode, trainers=2, **MODE_CONFIG[mode])
    assert plan.trainer_program is not main and plan.trainer_startup is not startup
    assert (main.serialize_to_string(), startup.serialize_to_string()) == before
    assert (main.revision, startup.revision) == revisions
    fluidps.verify(main)
    # Neither do the programs handed out: they are copies.
    t.get_trainer_program().global_block().remove_op(0)
    for ep in plan.endpoints:
        t.get_startup_program(ep).global_block().remove_op(0)
    assert (main.serialize_to_string(), startup.serialize_to_string()) == before


def test_listen_and_serv_knows_its_endpoint_and_pserver_id():
    endpoints = [f"127.0.0.1:{6170 + i}" for i in range(3)]
    main, startup = sparse_model()
    t, plan = transpile(main, startup, pservers=",".join(endpoints), min_block_size=100)
    assert list(plan.endpoints) == endpoints
    for i, ep in enumerate(endpoints):
        (serve,) = t.get_pserver_program(ep).global_block().ops
        assert serve.type == "listen_and_serv"
        assert serve.attr("endpoint") == ep and serve.attr("pserver_id") == i


def test_get_startup_program_with_a_pserver_program():
    main, startup = mlp()
    t, plan = transpile(main, startup)
    for ep in plan.endpoints:
        pserver, pserver_startup = t.get_pserver_programs(ep)
        expected = pserver_startup.serialize_to_string()
        assert t.get_startup_program(ep, pserver).serialize_to_string() == expected
        assert t.get_startup_program(ep).serialize_to_string() == expected
    # Each pserver's startup initializes its own slices, not the other's.
    first, second = (t.get_startup_program(ep).serialize_to_string() for ep in plan.endpoints)
    assert first != second
    assert t.get_startup_program().serialize_to_string() == plan.trainer_startup.serialize_to_string()


def test_getters_hand_out_copies():
    main, startup = mlp()
    t, plan = transpile(main, startup)
    trainer = t.get_trainer_program()
    trainer.global_block().remove_op(0)
    assert len(t.get_trainer_program().global_block().ops) == len(plan.trainer_program.global_block().ops)
    with pytest.raises(fluidps.BuilderError, match="not a pserver of this job"):
        t.get_pserver_program("10.0.0.1:1")


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("build", [mlp, sparse_model, lambda: mlp(decay=True, l2=True)])
def test_every_produced_program_verifies(mode, build):
    main, startup = build()
    _t, plan = transpile(main, startup, mode)
    for program in (
        plan.trainer_program,
        plan.trainer_startup,
        *plan.pserver_programs.values(),
        *plan.pserver_startups.values(),
    ):
        fluidps.verify(program)


def test_a_training_program_written_by_paddle_transpiles():
    path = paddle_fixture("adam_sparse")
    main = fluidps.Program.parse_from_string((path / "main.pb").read_bytes())
    startup = fluidps.Program.parse_from_string((path / "startup.pb").read_bytes())
    t, plan = transpile(main, startup, min_block_size=16)
    assert {s.param for s in plan.slices} == {
        "embedding_0.w_0",
        "fc_0.w_0",
        "fc_0.b_0",
        "fc_1.w_0",
        "fc_1.b_0",
    }
    trainer_ops = ops(t.get_trainer_program())
    assert "adam" not in trainer_ops and trainer_ops[-1] == "concat"
    assert "split_selected_rows" in trainer_ops  # the embedding's sparse gradient
    for ep in plan.endpoints:
        ps = t.get_pserver_program(ep)
        assert all(ops(ps, b)[-1] == "adam" for b in ps.global_block().ops[0].attr("optimize_blocks"))


# -- errors and CLI -------------------------------------------------------------------------


def test_configuration_and_argument_errors():
    with pytest.raises(fluidps.BuilderError, match="split_method"):
        fluidps.DistributeTranspilerConfig(split_method="Random")
    with pytest.raises(fluidps.BuilderError, match="staleness applies to mode 'ssp'"):
        fluidps.DistributeTranspilerConfig(staleness=2)
    with pytest.raises(fluidps.BuilderError, match="send_interval applies to mode 'async'"):
        fluidps.DistributeTranspilerConfig(send_interval=3)
    with pytest.raises(fluidps.UnsupportedError, match="optimizer_state_with_slice"):
        fluidps.DistributeTranspilerConfig(optimizer_state_with_slice=False)
    main, startup = mlp()
    with pytest.raises(fluidps.BuilderError, match="is not host:port"):
        transpile(main, startup, pservers="localhost")
    with pytest.raises(fluidps.BuilderError, match="repeat"):
        transpile(main, startup, pservers="127.0.0.1:1,127.0.0.1:1")
    with pytest.raises(fluidps.BuilderError, match="trainer_id 2 must be in"):
        transpile(main, startup, trainer_id=2)
    forward_only = fluidps.Program()
    with fluidps.program_guard(forward_only, fluidps.Program()):
        layers.fc(layers.data("x", [3]), 2)
    with pytest.raises(fluidps.UnsupportedError, match="no optimizer ops"):
        transpile(forward_only, startup)


def test_transpile_cli_writes_programs_and_placement(tmp_path):
    main, startup = sparse_model()
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())
    (tmp_path / "startup.pb").write_bytes(startup.serialize_to_string())
    out = tmp_path / "job"
    args = ["transpile", str(tmp_path / "main.pb"), "--startup", str(tmp_path / "startup.pb")]
    args += ["--pservers", EPS2, "--trainers", "2", "--mode", "async", "-o", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "pserver 0 127.0.0.1:6170" in result.stdout
    names = {p.name for p in out.iterdir()}
    for stem in (
        "trainer",
        "trainer_startup",
        "pserver_0",
        "pserver_0_startup",
        "pserver_1",
        "pserver_1_startup",
    ):
        assert {f"{stem}.pb", f"{stem}.dot"} <= names
    assert {"placement.txt", "placement.json"} <= names
    placement = json.loads((out / "placement.json").read_text())
    assert placement["mode"] == "async" and len(placement["slices"]) == 4
    text = (out / "placement.txt").read_text()
    per = placement["bytes_per_pserver"]
    assert list(per) == EPS2.split(",") and all(b > 0 for b in per.values())
    total = sum(per.values())
    for i, (ep, nbytes) in enumerate(per.items()):
        assert f"pserver {i} {ep}: {nbytes:,} bytes ({100 * nbytes / total:.1f}%)" in text
    shares = [
        float(line.split(" bytes (", 1)[1].split("%)", 1)[0])
        for line in text.splitlines()
        if line.startswith("pserver ")
    ]
    assert all("ms a step" in line for line in text.splitlines() if line.startswith("pserver "))
    assert len(shares) == 2 and sum(shares) == pytest.approx(100, abs=0.1)
    assert text.rstrip("\n") in result.stdout  # what the command printed
    shown = subprocess.run(
        [sys.executable, "-m", "fluidps", "inspect", str(out / "pserver_0.pb"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert (
        "gradient -> optimize block:" in shown.stdout
        and "gradient -> receive (enqueue) block:" in shown.stdout
    )
    assert "optimize block of embedding_0.w_0@GRAD.block0" in shown.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "fluidps", *args[:4], "--pservers", "nohost", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "is not host:port" in bad.stderr


COMMUNICATION = {
    "split_byref",
    "split_selected_rows",
    "send",
    "send_barrier",
    "recv",
    "fetch_barrier",
    "concat",
}


def _expected_communication(split: str, params: int, concats: int, mode: str) -> list[str]:
    """A send per parameter in backward order (the first layer's, cut by `split`, last)."""
    barrier = mode == "sync"
    return (
        ["send"] * (params - 1)
        + [split, "send"]
        + ["send_barrier"] * barrier
        + ["recv"]
        + ["fetch_barrier"] * barrier
        + ["concat"] * concats
    )


def _merge(mode: str) -> list[str]:
    return ["sum", "scale"] if mode == "sync" else ["dequeue"]


@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
@pytest.mark.parametrize("model", ["mlp", "sparse", "lr_decay"])
def test_exact_op_types_per_role(model, mode):
    """The trainer's communication tail and every pserver block, op type by op type."""
    build = {"mlp": mlp, "sparse": sparse_model, "lr_decay": lambda: mlp(decay=True, l2=True)}[model]
    main, startup = build()
    train_ops = [op.type for op in main.global_block().ops if not op.attr("op_role") & (2 | 16)]
    _, plan = transpile(main, startup, mode, **({"staleness": 1} if mode == "ssp" else {}))
    trainer_ops = ops(plan.trainer_program)
    assert [t for t in trainer_ops if t not in COMMUNICATION] == train_ops
    update = {"mlp": ["adam"], "sparse": ["sgd"], "lr_decay": ["scale", "sum", "adam"]}[model]
    split, params = ("split_selected_rows", 3) if model == "sparse" else ("split_byref", 4)
    assert [t for t in trainer_ops if t in COMMUNICATION] == _expected_communication(split, params, 1, mode)
    queued = mode != "sync"
    for ep in plan.endpoints:
        ps = plan.pserver_programs[ep]
        serve = ps.global_block().ops[0]
        assert ops(ps) == ["listen_and_serv"]
        expected_blocks = []
        if model == "lr_decay":
            expected_blocks.append(
                ["increment", "cast", "scale", "floor", "fill_constant", "elementwise_pow", "scale"]
            )
            assert serve.attr("lr_decay_block_id") == 1
        for _ in plan.slices_on(ep):
            expected_blocks.append(_merge(mode) + update)
            if queued:
                expected_blocks.append(["enqueue"])
        assert [ops(ps, b) for b in range(1, ps.num_blocks)] == expected_blocks
        startup_outputs = [op.output_arg_names[0] for op in plan.pserver_startups[ep].global_block().ops]
        assert {s.name for s in plan.slices_on(ep)} <= set(startup_outputs)


def test_sync_mode_false_means_async_as_in_fluid():
    main, startup = mlp()
    t = fluidps.DistributeTranspiler()
    plan = t.transpile(0, main, EPS2, trainers=2, sync_mode=False, startup_program=startup)
    assert plan.config.mode == "async"
    assert "send_barrier" not in ops(plan.trainer_program)
    serve = plan.pserver_programs["127.0.0.1:6170"].global_block().ops[0]
    assert serve.attr("distributed_mode") == 1


def test_without_slicing_every_parameter_stays_whole(tmp_path):
    main, startup = mlp()
    _, plan = transpile(main, startup, slice_var_up=False)
    params = {p.name for p in main.all_parameters()}
    assert {s.param for s in plan.slices} == params and len(plan.slices) == len(params)
    assert all(s.name == s.param and s.offset == 0 for s in plan.slices)
    assert "split_byref" not in ops(plan.trainer_program) and "concat" not in ops(plan.trainer_program)
    # The command line's --no-slice does the same.
    (tmp_path / "main.pb").write_bytes(main.serialize_to_string())
    (tmp_path / "startup.pb").write_bytes(startup.serialize_to_string())
    done = subprocess.run(
        [sys.executable, "-m", "fluidps", "transpile", str(tmp_path / "main.pb"), "--startup",
         str(tmp_path / "startup.pb"), "--pservers", EPS2, "--trainers", "2", "--no-slice", "-o", str(tmp_path / "out")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    placement = json.loads((tmp_path / "out" / "placement.json").read_text())
    assert sorted(s["param"] for s in placement["slices"]) == sorted(params)
    assert all(s["name"] == s["param"] for s in placement["slices"])
