"""Placement by cost model: the exact search against brute force, the costs of a program's
cuts against a direct count, PipelineOptimizer placing what no device_guard placed, and
every bad input said by name."""

from __future__ import annotations

import dataclasses
import itertools
import json
import warnings

import numpy as np
import pytest

import fluidps
from fluidps import layers
from fluidps.cli.calibrate_cmd import ROUND_CONSTANTS, calibrate_machine, with_medians
from fluidps.errors import BuilderError, Error, UnsupportedError
from fluidps.executor.measure.op_profile import profile_ops
from fluidps.ir.stages import phase
from fluidps.transpiler.cost_model import (
    ANALYTIC,
    CostModel,
    CostModelWarning,
    MachineModel,
    OpProfile,
    load_machine,
    load_profile,
    machine_id,
    op_signature,
)
from fluidps.transpiler.partition import best_cuts, place_pipeline, placed, step_seconds, unit_of_ops
from fluidps.transpiler.stage_costs import evaluate, units_of

# -- the exact search ----------------------------------------------------------------------


def counted(stage_times, wait_factor, slowed=None):
    """Each stage's time as the step counts it next to the slowest: its ops (`slowed`, the
    part of each time that waiting slows; default all of it) slower (MachineModel.wait_factor)."""
    slowest = max(stage_times)
    slowed = stage_times if slowed is None else slowed
    return [
        t + x * (wait_factor - 1) * (1 - t / slowest) if slowest > 0 else t
        for t, x in zip(stage_times, slowed, strict=True)
    ]


def brute_force(times, p, m, allowed, fill, wait_factor=1.0, slowed=None):
    """Every cut of n units into p stages: the least predicted step, and every cut reaching it."""
    n = times.shape[0] - 1
    best, argbest = None, []
    for inner in itertools.combinations(range(1, n), p - 1):
        cuts = (0, *inner, n)
        pairs = list(itertools.pairwise(cuts))
        if allowed is not None and not all(allowed[k, a, b] for k, (a, b) in enumerate(pairs)):
            continue
        ops = None if slowed is None else [slowed[a, b] for a, b in pairs]
        stage = counted([times[a, b] for a, b in pairs], wait_factor, ops)
        step = step_seconds(stage, m, sum(fill[a, b] for a, b in pairs))
        if best is None or step < best - 1e-9:
            best, argbest = step, [cuts]
        elif abs(step - best) <= 1e-9:
            argbest.append(cuts)
    return best, argbest


def chain(rng, n, with_ops=False):
    """Stage times of a chain of n units: integer compute (zeros and ties on purpose) plus
    integer messages at each cut, and integer fills (and the compute part of each time)."""
    compute = rng.integers(0, 4, n).astype(float)
    messages = rng.integers(0, 3, n + 1).astype(float)
    prefix = np.concatenate([[0.0], np.cumsum(compute)])
    ops = prefix[None, :] - prefix[:, None]
    times = ops + messages[:, None] + messages[None, :]
    fill = rng.integers(0, 3, (n + 1, n + 1)).astype(float)
    return (times, fill, ops) if with_ops else (times, fill)


@pytest.mark.parametrize("seed", range(8))
def test_the_cuts_are_those_of_brute_force_for_chains_up_to_12_units_and_4_stages(seed):
    rng = np.random.default_rng(seed)
    for case in range(60):
        n, p, m = int(rng.integers(1, 13)), int(rng.integers(1, 5)), int(rng.integers(1, 10))
        times, fill = chain(rng, n)
        fill = fill if case % 3 else np.zeros_like(fill)
        allowed = rng.random((p, n + 1, n + 1)) > 0.2 if case % 2 else None
        found = best_cuts(times, p, m, allowed, fill)
        best, argbest = brute_force(times, p, m, allowed, fill)
        if best is None:
            assert found is None, (n, p, m)
            continue
        cuts, step = found
        assert step == pytest.approx(best, abs=1e-9) and cuts in argbest, (n, p, m, cuts, argbest)


@pytest.mark.parametrize("wait_factor", [1.3, 2.0])
@pytest.mark.parametrize("seed", range(4))
def test_with_a_wait_factor_the_cuts_are_within_the_bound_of_brute_force(seed, wait_factor):
    rng = np.random.default_rng(seed)
    exact = 0
    for case in range(60):
        n, p, m = int(rng.integers(1, 13)), int(rng.integers(1, 5)), int(rng.integers(1, 10))
        times, fill, ops = chain(rng, n, with_ops=True)
        fill = fill if case % 3 else np.zeros_like(fill)
        allowed = rng.random((p, n + 1, n + 1)) > 0.2 if case % 2 else None
        slowed = ops if case % 4 < 2 else None  # the factor slows the ops only, or all the time
        found = best_cuts(times, p, m, allowed, fill, wait_factor, slowed)
        best, argbest = brute_force(times, p, m, allowed, fill, wait_factor, slowed)
        if best is None:
            assert found is None, (n, p, m)
            continue
        cuts, step = found
        pairs = list(itertools.pairwise(cuts))
        part = None if slowed is None else [slowed[a, b] for a, b in pairs]
        counted_step = step_seconds(
            counted([times[a, b] for a, b in pairs], wait_factor, part), m, sum(fill[a, b] for a, b in pairs)
        )
        assert step == pytest.approx(counted_step, abs=1e-9)  # it reports what its cuts count
        assert best - 1e-9 <= step <= best * (1 + (wait_factor - 1) * (p - 1) / (4 * m)) + 1e-9, (n, p, m)
        exact += cuts in argbest
    assert exact > 0  # (and mostly it is the optimum itself)


def test_all_zero_costs_still_give_every_stage_a_unit_and_too_many_stages_none():
    times = np.zeros((6, 6))
    cuts, step = best_cuts(times, 3, 4)
    assert step == 0 and len(cuts) == 4 and all(b > a for a, b in itertools.pairwise(cuts))
    assert best_cuts(np.zeros((3, 3)), 3, 4) is None  # 2 units, 3 stages


def test_the_step_weighs_the_slowest_stage_by_the_micro_batches_after_the_first():
    prefix = np.concatenate([[0.0], np.cumsum([5.0, 1.0, 1.0, 5.0])])
    times = np.maximum(prefix[None, :] - prefix[:, None], 0)
    for m in (2, 8):  # balanced (6 | 6) beats 5 | 7 and 7 | 5 once the slowest stage counts
        cuts, step = best_cuts(times, 2, m)
        assert cuts == (0, 2, 4) and step == 12 + (m - 1) * 6


# -- a program's costs ---------------------------------------------------------------------


def unbalanced_mlp(guards=None, pipeline=None, widths=(256, 256, 256, 16, 16, 16, 16, 16, 16)):
    """64 inputs, hidden layers of `widths` (heavy first), 10 classes. `guards`: layer index ->
    stage for a device_guard. `pipeline`: PipelineOptimizer keyword arguments (else plain SGD)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 5
    guards = guards or {}
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [64])
        y = layers.data("y", [1], dtype="int64")
        h = x
        for i, width in enumerate(widths):
            with fluidps.device_guard(f"stage:{guards[i]}" if i in guards else None):
                h = layers.fc(h, width, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 10), y))
        inner = fluidps.optimizer.Adam(0.01)
        opt = fluidps.optimizer.PipelineOptimizer(inner, **pipeline) if pipeline else inner
        opt.minimize(loss)
    return main, startup, loss, opt


def test_each_grad_op_goes_with_the_forward_op_whose_output_gradient_it_reads():
    main, *_ = unbalanced_mlp()
    block = main.global_block()
    units, unit_of = unit_of_ops(block)
    for i, op in enumerate(block.ops):
        if op.type == "mul_grad":
            (out_grad,) = op.input("Out@GRAD")
            maker = next(
                u for u, j in enumerate(units) if out_grad[: -len("@GRAD")] in block.ops[j].output_arg_names
            )
            assert block.ops[units[unit_of[i]]].type == "mul" and unit_of[i] == maker
        if op.type == "adam":
            assert block.ops[units[unit_of[i]]].type in (
                "mul",
                "elementwise_add",
            )  # its parameter's first reader


def test_a_stage_pays_for_each_value_crossing_its_cuts_and_a_skip_connection_only_where_it_lands():
    """h1 = fc(x); h2 = fc(h1); out = h2 + h1: cutting after h2's fc sends h1 and h2 (and
    their gradients back); the model's message work equals that count."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [8])
        h1 = layers.fc(x, 64)
        h2 = layers.fc(h1, 64)
        loss = layers.mean(layers.elementwise_add(h2, h1))
        fluidps.optimizer.SGD(0.1).minimize(loss)
    machine = MachineModel(1e12, 1e12, 0.0, 0.0, 0.0, alpha_s=0.0, beta_s=1.0, send_cpu_s=0.0)  # 1 s a byte
    rows = 4
    block = main.global_block()
    forward = [i for i, op in enumerate(block.ops) if phase(op) == "forward"]
    for cut_after in range(1, len(forward)):
        guards = {i: int(k >= cut_after) for k, i in enumerate(forward)}
        pinned = main.clone()
        for i, stage in guards.items():
            pinned.global_block().ops[i].set_attr("op_device", f"stage:{stage}")
        plan = place_pipeline(pinned, 2, 1, CostModel(machine), rows)
        made = {}
        for k, i in enumerate(forward):
            for name in block.ops[i].output_arg_names:
                made.setdefault(name, k)
        crossing = {
            name
            for k, i in enumerate(forward)
            for name in block.ops[i].input_arg_names
            if name in made and made[name] < cut_after <= k
        }
        expected = sum(2 * rows * 64 * 4 for _ in crossing)  # float32 [rows, 64], and its gradient
        assert plan.message_s == (expected, expected), (cut_after, sorted(crossing))


def test_placement_balances_the_heavy_layers_and_no_split_between_layers_predicts_better():
    model = CostModel(ANALYTIC)
    widths = (1024,) * 3 + (32,) * 6  # the work is the products: 64 x 1024, then 1024 x 1024 twice
    config = {"num_microbatches": 4, "num_stages": 2, "batch_size": 256, "cost_model": model}
    main, _, _, opt = unbalanced_mlp(pipeline=config, widths=widths)
    auto = opt.placement
    by_layers = []
    for cut in range(1, 10):  # every split between hidden layers, its ops pinned by device_guards
        guarded, *_ = unbalanced_mlp(guards={i: int(i >= cut) for i in range(9)}, widths=widths)
        by_layers.append(place_pipeline(guarded, 2, 4, model, 256).predicted_step_s)
    assert auto.predicted_step_s <= min(by_layers) + 1e-12
    equal = by_layers[4]  # five fc layers on each stage, as a person would split ten
    assert auto.predicted_step_s < 0.8 * equal
    stages = {op.attr("op_device") for op in main.global_block().ops if op.has_attr("op_device")}
    assert stages == {"stage:0", "stage:1"}


def test_a_placed_pipeline_trains_as_the_plain_program():
    model = CostModel(ANALYTIC)
    plain, plain_startup, plain_loss, _ = unbalanced_mlp()
    main, startup, loss, opt = unbalanced_mlp(
        pipeline={"num_microbatches": 4, "num_stages": 2, "batch_size": 16, "cost_model": model}
    )
    assert main.pipeline.num_stages == 2 and opt.placement.num_stages == 2
    rng = np.random.default_rng(0)
    feeds = [{"x": rng.random((16, 64), np.float32), "y": rng.integers(0, 10, (16, 1))} for _ in range(4)]
    assert_trains_alike((plain, plain_startup, plain_loss), (main, startup, loss), feeds)


def assert_trains_alike(reference, placed_one, feeds):
    """Each (main, startup, loss) trained locally on `feeds`: the same losses, step by step."""
    local, piped = fluidps.Executor(), fluidps.Executor()
    local.run(reference[1])
    piped.run(placed_one[1])
    for feed in feeds:
        (a,) = local.run(reference[0], feed=feed, fetch_list=[reference[2]])
        (b,) = piped.run(placed_one[0], feed=feed, fetch_list=[placed_one[2]])
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_guarded_ops_keep_their_stage_and_the_rest_are_placed_around_them():
    model = CostModel(ANALYTIC)
    config = {"num_microbatches": 2, "num_stages": 3, "batch_size": 8, "cost_model": model}
    main, _, _, opt = unbalanced_mlp(guards={0: 0, 8: 2}, pipeline=config)
    block = main.global_block()
    devices = [op.attr("op_device") for op in block.ops if op.type == "mul" and op.has_attr("op_device")]
    assert devices[0] == "stage:0" and devices[8] == "stage:2"
    assert devices == sorted(devices)  # contiguous, in order
    assert opt.placement.num_stages == 3 and "stage:1" in devices


def test_guards_out_of_order_more_stages_than_ops_and_an_impossible_memory_cap_are_refused():
    model = CostModel(ANALYTIC)
    with pytest.raises(UnsupportedError, match="device_guards in order"):
        unbalanced_mlp(
            guards={0: 1, 5: 0},
            pipeline={"num_microbatches": 2, "num_stages": 2, "batch_size": 8, "cost_model": model},
        )
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        layers.mean(layers.data("x", [4]))
    with pytest.raises(UnsupportedError, match="3 pipeline stages need at least 3 forward ops"):
        place_pipeline(main, 3, 1, model, 8)
    plain, *_ = unbalanced_mlp()
    with pytest.raises(UnsupportedError, match=r"memory cap of 1,000 bytes.*largest stage keeps"):
        place_pipeline(plain, 2, 2, model, 8, memory_cap=1000)
    with pytest.raises(UnsupportedError, match="cannot be cut into 3 equal micro-batches"):
        place_pipeline(plain, 2, 3, model, 8)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a positive integer"),
        ({"batch_size": 2.5}, "batch_size must be a positive integer"),
        ({"memory_cap": -1}, "memory_cap must be a positive number of bytes"),
    ],
)
def test_bad_placement_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(BuilderError, match=message):
        fluidps.optimizer.PipelineOptimizer(fluidps.optimizer.SGD(0.1), 2, num_stages=2, **kwargs)


def test_a_memory_cap_moves_the_cut_where_it_fits():
    plain, *_ = unbalanced_mlp()
    model = CostModel(ANALYTIC)
    free = place_pipeline(plain, 2, 4, model, 64)
    cap = int(max(free.memory_bytes) * 0.999)  # the fastest placement no longer fits
    capped = place_pipeline(plain, 2, 4, model, 64, memory_cap=cap)
    assert max(capped.memory_bytes) <= cap and capped.unit_stages != free.unit_stages
    assert capped.predicted_step_s >= free.predicted_step_s


# -- the model's files and warnings --------------------------------------------------------


def test_an_uncalibrated_or_foreign_calibration_warns_once_and_uses_the_analytic_model(tmp_path):
    with pytest.warns(CostModelWarning, match="no transport calibration .* run `fluidps calibrate`"):
        assert load_machine(tmp_path / "none.json") is ANALYTIC
    foreign = MachineModel(
        1e11, 1e10, 1e-6, 1e-5, 3e-4, 1e-4, 1e-9, 1e-5, machine="another CPU x64", calibrated=True
    )
    path = foreign.save(tmp_path / "calibration.json")
    with pytest.warns(CostModelWarning, match="measured on 'another CPU x64', not this machine"):
        assert load_machine(path) is ANALYTIC
    mine = MachineModel(
        1e11, 1e10, 1e-6, 1e-5, 3e-4, 1e-4, 1e-9, 1e-5, wait_factor=1.4, machine=machine_id(), calibrated=True
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_machine(mine.save(path)) == mine
        older = json.loads(path.read_text())  # a calibration from before wait_factor was measured
        del older["wait_factor"]
        path.write_text(json.dumps(older))
        assert load_machine(path).wait_factor == 1.0


def test_a_stage_waiting_for_a_busier_one_is_slower_the_more_it_waits():
    plain, *_ = unbalanced_mlp()
    steady = MachineModel(1e11, 1e10, 1e-6, 1e-5, 3e-4, 1e-4, 1e-9, 1e-5)
    waiting = dataclasses.replace(steady, wait_factor=1.5)
    for stages, m in ((2, 4), (3, 8)):
        plain_units, waiting_units = (units_of(plain, CostModel(c), 64 // m, m) for c in (steady, waiting))
        placement = place_pipeline(plain, stages, m, CostModel(waiting), 64)
        before = evaluate(plain_units, placement.unit_stages, stages, m, "1F1B")
        after = evaluate(waiting_units, placement.unit_stages, stages, m, "1F1B")
        times = [c + s for c, s in zip(before.compute_s, before.message_s, strict=True)]
        slowest, run = max(times), plain_units.run_s
        assert after.message_s == before.message_s
        assert list(after.compute_s) == pytest.approx(
            [
                run + (c - run) * (1 + 0.5 * (1 - t / slowest))
                for c, t in zip(before.compute_s, times, strict=True)
            ],
            rel=1e-9,
        )  # the slowest stage keeps its time; the others' ops count slower, the more they wait
        assert after.step_s == pytest.approx(placement.predicted_step_s, rel=1e-9)
        other = place_pipeline(plain, stages, m, CostModel(steady), 64)  # no better, counted the same way
        assert (
            placement.predicted_step_s <= evaluate(waiting_units, other.unit_stages, stages, m, "1F1B").step_s
        )
    for factor in (0.9, 2.5):
        with pytest.raises(Error, match=rf"wait_factor must be a number from 1 to 2, got {factor}"):
            dataclasses.replace(steady, wait_factor=factor)


def test_the_constants_of_several_rounds_are_their_medians_and_the_rates_are_kept():
    measured = MachineModel(1e11, 1e10, 1e-6, 1e-5, 3e-4, 1e-4, 1e-9, 1e-5, calibrated=True)
    rounds = [  # one slow minute in the middle round (the send), another in the last (the factor)
        {"alpha_s": 3e-4, "beta_s": 5e-10, "send_cpu_s": 7e-5, "stage_overhead_s": 3.0e-4,
         "stage_byte_s": 1.2e-9, "wait_factor": 1.3, "round_trips": []},
        {"alpha_s": 7e-4, "beta_s": 6e-10, "send_cpu_s": 2.1e-4, "stage_overhead_s": 2.9e-4,
         "stage_byte_s": 1.1e-9, "wait_factor": 1.35, "round_trips": []},
        {"alpha_s": 2.5e-4, "beta_s": 5.5e-10, "send_cpu_s": 1e-4, "stage_overhead_s": 3.4e-4,
         "stage_byte_s": 1.4e-9, "wait_factor": 1.7, "round_trips": []},
    ]  # fmt: skip
    model = with_medians(measured, rounds)
    assert (model.alpha_s, model.beta_s, model.wait_factor) == (
        3e-4,
        5e-10,
        1.35,
    )  # (alpha and beta: one round's)
    # a stage's own cost and a send, from the round whose sum (a micro-batch's: 440, 710 and
    # 540 us) is the median: the last; not 300 us and 100 us from two rounds
    assert (model.send_cpu_s, model.stage_overhead_s, model.stage_byte_s) == (1e-4, 3.4e-4, 1.4e-9)
    assert (
        dataclasses.replace(model, **{name: getattr(measured, name) for name in ROUND_CONSTANTS}) == measured
    )
    assert with_medians(measured, rounds[:1]).send_cpu_s == 7e-5  # one round: its own numbers
    with pytest.raises(Error, match="at least one round"):
        with_medians(measured, [])
    with pytest.raises(Error, match="at least one round, got rounds=0"):
        calibrate_machine(rounds=0)


def test_damaged_calibration_and_profile_files_are_errors_naming_them(tmp_path):
    bad = tmp_path / "calibration.json"
    bad.write_text("{not json")
    with pytest.raises(Error, match=f"cannot read {bad}"):
        load_machine(bad)
    bad.write_text(json.dumps({"format": 1, "kind": "op_profile", "machine": "m", "seconds": {}}))
    with pytest.raises(Error, match="not a fluidps calibration"):
        load_machine(bad)
    bad.write_text(
        json.dumps({"format": 1, "kind": "op_profile", "machine": machine_id(), "seconds": {"a": -1}})
    )
    with pytest.raises(Error, match="times must be seconds >= 0"):
        load_profile(bad)
    with pytest.raises(Error, match="no op profile at"):
        load_profile(tmp_path / "missing.json")
    with pytest.raises(Error, match="gemm_flops must be a positive number"):
        MachineModel(0, 1e10, 0, 0, 0, 0, 0, 0)
    stored = MachineModel(1e11, 1e10, 1e-6, 1e-5, 3e-4, 1e-4, 1e-9, 1e-5, machine=machine_id()).save(bad)
    bad.write_text(stored.read_text().replace('"wait_factor": 1.0', '"wait_factor": 2.5'))
    with pytest.raises(
        Error, match=rf"{bad}: not a fluidps calibration \(.*wait_factor .*\); run `fluidps calibrate`"
    ):
        load_machine(bad)


def test_a_profile_of_another_program_or_machine_is_said_and_set_aside(tmp_path):
    plain, *_ = unbalanced_mlp()
    other, other_startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(other, other_startup):
        loss = layers.mean(layers.fc(layers.data("z", [3]), 2))
        fluidps.optimizer.SGD(0.1).minimize(loss)
    profile = profile_ops(other, other_startup, {"z": np.ones((4, 3), np.float32)}, steps=2)
    with pytest.warns(CostModelWarning, match=r"holds \w+ of the program's \d+ ops at 4 rows"):
        place_pipeline(plain, 2, 2, CostModel(ANALYTIC, profile), 8)
    foreign = OpProfile("another CPU x64", profile.seconds)
    path = foreign.save(tmp_path / "profile.json")
    with pytest.warns(CostModelWarning, match="op profile .* measured on 'another CPU x64'"):
        assert load_profile(path) is None


def test_a_profile_times_every_op_by_signature_and_merges_on_disk(tmp_path):
    plain, startup, *_ = unbalanced_mlp()
    rows = 8
    feed = {"x": np.ones((rows, 64), np.float32), "y": np.zeros((rows, 1), np.int64)}
    profile = profile_ops(plain, startup, feed, steps=2)
    block = plain.global_block()
    assert {op_signature(block, op, rows) for op in block.ops} == set(profile.seconds)
    assert all(t >= 0 for t in profile.seconds.values()) and profile.machine == machine_id()
    path = profile.save(tmp_path / "profile.json")
    OpProfile(machine_id(), {"extra|x|y": 1.0}).save(path)
    merged = load_profile(path)
    assert set(merged.seconds) == set(profile.seconds) | {"extra|x|y"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every op measured: nothing to warn about
        plan = place_pipeline(plain, 2, 1, CostModel(ANALYTIC, merged), rows)
    assert plan.predicted_step_s > 0


def test_placed_returns_a_pipeline_program_and_leaves_its_input_alone():
    plain, *_ = unbalanced_mlp()
    before = plain.serialize_to_string()
    plan = place_pipeline(plain, 2, 4, CostModel(ANALYTIC), 32)
    out = placed(plain, plan)
    assert plain.serialize_to_string() == before
    assert out.pipeline.num_stages == 2 and out.pipeline.num_microbatches == 4
    assert fluidps.PipelineTranspiler().transpile(out).num_stages == 2


# -- pservers by cost ----------------------------------------------------------------------


def one_large_many_small(hashed_vocab: int | None = None):
    """A [256, 1024] weight and 36 small parameters of three sizes in turn, Adam."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [256])
        big = layers.fc(x, 1024)
        h = x
        for i in range(18):
            h = layers.fc(h, (192, 24, 8)[i % 3], act="relu")
        loss = layers.elementwise_add(layers.mean(big), layers.mean(h))
        if hashed_vocab:
            ids = layers.data("ids", [1], dtype="int64")
            emb = layers.embedding(ids, size=[hashed_vocab, 8], is_sparse=True, is_distributed=True)
            loss = layers.elementwise_add(loss, layers.mean(emb))
        fluidps.optimizer.Adam(0.01).minimize(loss)
    return main, startup


ENDPOINTS = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"


def transpiled(main, startup, **config):
    config = fluidps.DistributeTranspilerConfig(**config)
    return fluidps.DistributeTranspiler(config).transpile(0, main, ENDPOINTS, startup_program=startup)


def test_cost_placement_balances_the_pservers_predicted_load_and_reports_it():
    main, startup = one_large_many_small()
    by_cost = transpiled(main, startup, split_method="cost")  # (the lower-case spelling too)
    assert by_cost.config.split_method == "Cost"
    round_robin = transpiled(main, startup)
    loads, rr = list(by_cost.loads().values()), list(round_robin.loads().values())
    assert sum(loads) == pytest.approx(sum(rr))  # the same blocks, placed otherwise
    assert max(loads) <= 1.1 * sum(loads) / 3 and max(loads) <= max(rr)
    assert "predicted" in by_cost.summary() and "ms a step" in by_cost.summary()
    assert by_cost.to_dict()["predicted_ms_per_pserver"] == {
        ep: pytest.approx(t * 1e3, abs=1e-5) for ep, t in by_cost.loads().items()
    }
    again = transpiled(main, startup, split_method="Cost")  # every process must place alike
    assert [s.endpoint for s in again.slices] == [s.endpoint for s in by_cost.slices]
    # a block's load: its update ops over its rows and its two messages, larger blocks more
    big = [s for s in by_cost.slices if s.param == "fc_0.w_0"]
    small = next(s for s in by_cost.slices if s.nbytes < big[0].nbytes)
    assert big[0].load_s > small.load_s > 0


def test_cost_placement_keeps_a_tables_block_k_on_pserver_k_and_balances_around_it():
    main, startup = one_large_many_small(hashed_vocab=90_000)
    plan = transpiled(main, startup, split_method="Cost")
    table = [s for s in plan.slices if s.distributed]
    assert [s.endpoint for s in table] == ENDPOINTS.split(",")
    assert max(plan.loads().values()) <= 1.1 * sum(plan.loads().values()) / 3


# -- programs that are not one chain -------------------------------------------------------


def two_towers(pipeline=None):
    """Two towers of three layers each over one input, built interleaved (a layer of one,
    then of the other), joined by a sum: cut anywhere in program order, both towers'
    activations cross; a tower a stage sends one."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 4
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [32])
        y = layers.data("y", [1], dtype="int64")
        a = b = x
        for _ in range(3):
            a = layers.fc(a, 256, act="relu")
            b = layers.fc(b, 256, act="relu")
        logits = layers.fc(layers.elementwise_add(a, b), 4)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))
        inner = fluidps.optimizer.SGD(0.05)
        opt = fluidps.optimizer.PipelineOptimizer(inner, **pipeline) if pipeline else inner
        opt.minimize(loss)
    return main, startup, loss, opt


def test_two_towers_are_placed_one_a_stage_by_list_scheduling_and_train_as_the_plain_program():
    # messages dear next to compute (1 ns a byte): sending one tower's output beats two
    machine = MachineModel(5e10, 5e9, 1e-6, 1e-5, 1e-4, 1e-4, 1e-9, 1e-5)
    config = {"num_microbatches": 4, "num_stages": 2, "batch_size": 64, "cost_model": CostModel(machine)}
    main, startup, loss, opt = two_towers(config)
    placement = opt.placement
    assert placement.method == "list"
    block = main.global_block()
    towers = {}
    for i in placement.forward_ops:  # each tower's muls: every other fc before the join
        op = block.ops[i]
        if op.type == "mul" and op.input("Y")[0] in {f"fc_{k}.w_0" for k in range(6)}:
            k = int(op.input("Y")[0].split("_")[1].split(".")[0])
            towers.setdefault(k % 2, set()).add(placement.op_stages()[i])
    assert sorted(towers.values(), key=min) == [{0}, {1}]  # one tower on each stage
    chain_only, *_ = two_towers()
    plain = place_pipeline(chain_only, 2, 4, CostModel(machine), 64)
    assert plain.method == "list" and placement.predicted_step_s == pytest.approx(plain.predicted_step_s)

    reference, reference_startup, reference_loss, _ = two_towers()
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.random((64, 32), np.float32), "y": rng.integers(0, 4, (64, 1))} for _ in range(3)]
    assert_trains_alike((reference, reference_startup, reference_loss), (main, startup, loss), feeds)


def test_a_chain_keeps_its_exact_cuts_when_list_scheduling_does_no_better():
    plain, *_ = unbalanced_mlp()
    placement = place_pipeline(plain, 2, 4, CostModel(ANALYTIC), 64)
    assert placement.method == "cuts"
    stages = list(placement.unit_stages)
    assert stages == sorted(stages)  # a run of ops in program order each
