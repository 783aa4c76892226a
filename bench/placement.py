"""Placement by cost model against every split, measured: an unbalanced MLP whose wide
layers come first, on 2 pipeline stages (one process with one thread each), m = 8.

    python -m bench.placement [--wide 3] [--narrow 6] [--wide-width 2048] [--narrow-width 256]
                              [--batch 256] [--microbatches 8] [--steps 8] [--repeats 2]
                              [--rounds 3] [--quick]

Everything below is measured in one run, in this order:
- "transport": `fluidps calibrate`'s measure (fluidps.cli.calibrate_cmd.calibrate_machine):
  this machine's rates, and in `--rounds` interleaved rounds a message over fluidps's
  transport (alpha + beta * bytes), a stage's own cost a micro-batch and a byte, and the
  wait factor, each the median of its rounds; next to a raw pyzmq round trip of a small
  frame (bench.bandwidth's peer): what the model's messages are made of;
- "profile": the program's ops timed on a micro-batch's rows (fluidps.executor.measure.op_profile),
  next to a busy neighbor for each other stage that shares this host. Both are measured
  again before each run below, whose prediction uses each op's median time over the
  last three profiles (this machine drifts by up to a third between minutes: the op
  times follow it, and the median keeps one slow minute from setting them) and the
  medians of every round so far (one round is noisy);
- "split": for every cut between layers (stage 0 holds the first `cut` hidden layers),
  the measured step (RemoteExecutor, one process per stage), each stage's measured busy
  time per step (running its programs, not waiting for values) and the model's
  prediction of each, for the same cut (its ops pinned where the guards put them);
- "auto": PipelineOptimizer(num_stages=2) with no device_guard, placed by the same model:
  its cut, measured and predicted, and its step over the best split's and over the split
  with equal layer counts (the default a person writes), those two measured again right
  after it (the machine drifts between the first pass and now);
- "repeat": the best, the equal and the last split (every layer on stage 0), each stage's
  busy time measured in the first pass and again at the end: how far the same measure
  moves within one run, next to the predictions' errors;
- "pservers": each of 3 pservers' predicted load a step under round-robin and under
  split_method="Cost", for a model of one large and 36 small parameters (sliced, and whole);
- "planning": seconds to place a program of about 1,000 ops on 4 stages.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from bench.bandwidth import zmq_bandwidth  # noqa: E402
from fluidps import layers  # noqa: E402
from fluidps.cli.calibrate_cmd import calibrate_machine, measure_round, with_medians  # noqa: E402
from fluidps.cli.stage_timing import time_stages  # noqa: E402
from fluidps.executor.measure.op_profile import profile_ops  # noqa: E402
from fluidps.transpiler.cost_model import (  # noqa: E402
    ANALYTIC,
    CostModel,
    CostModelWarning,
    MachineModel,
    OpProfile,
)
from fluidps.transpiler.partition import place_pipeline  # noqa: E402

STAGES = 2
CORES = os.cpu_count() or 1
NEIGHBORS = min(STAGES, CORES) - 1  # the other stages that run on this host while one works
PROFILES_KEPT = 3  # the profiles whose median op times a prediction uses (the last ones)


def build(args, cut: int | None, pipeline: dict | None, cost: CostModel | None = None):
    """The MLP: `wide` layers of wide_width, `narrow` of narrow_width, a 10-way classifier;
    `cut`: the hidden layers on stage 0 (None: no guards, placed by `cost` when pipelined)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 1
    widths = [args.wide_width] * args.wide + [args.narrow_width] * args.narrow
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [args.input_width])
        y = layers.data("y", [1], dtype="int64")
        h = x
        for i, width in enumerate(widths):
            with fluidps.device_guard(None if cut is None else f"stage:{int(i >= cut)}"):
                h = layers.fc(h, width, act="relu")
        with fluidps.device_guard(None if cut is None else f"stage:{STAGES - 1}"):
            loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 10), y))
        inner = fluidps.optimizer.SGD(0.001)
        if pipeline is None:
            inner.minimize(loss)
            opt = None
        else:
            opt = fluidps.optimizer.PipelineOptimizer(
                inner, **pipeline, num_stages=STAGES, batch_size=args.batch, cost_model=cost
            )
            opt.minimize(loss)
    return main, startup, loss, opt


def feeds(args, rows: int, count: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        {
            "x": rng.normal(size=(rows, args.input_width)).astype("float32"),
            "y": rng.integers(0, 10, (rows, 1)).astype("int64"),
        }
        for _ in range(count)
    ]


def measure(args, main, startup, loss) -> dict:
    """The pipeline job's median step (ms) and each stage's busy ms a step, past the compile."""
    step, busy = time_stages(main, startup, feeds(args, args.batch), args.steps * args.repeats, [loss])
    return {"step_ms": round(step * 1e3, 2), "busy_ms": [round(b * 1e3, 2) for b in busy]}


def predicted(placement, m: int, measured: dict, machine: MachineModel) -> dict:
    """The model's step and stage times for this placement, and each stage's error
    against the measured busy time (predicted / measured - 1)."""
    per_stage = [m * s * 1e3 for s in placement.stage_s]
    return {
        "constants": constants(machine),
        "predicted_step_ms": round(placement.predicted_step_s * 1e3, 2),
        "predicted_busy_ms": [round(t, 2) for t in per_stage],
        "stage_error": [round(p / b - 1, 3) for p, b in zip(per_stage, measured["busy_ms"], strict=True)],
    }


def constants(model: MachineModel) -> dict:
    """What a stage pays every micro-batch and message besides its ops, as the model has it."""
    return {
        "alpha_us": round(model.alpha_s * 1e6, 1),
        "send_cpu_us": round(model.send_cpu_s * 1e6, 1),
        "stage_overhead_us": round(model.stage_overhead_s * 1e6, 1),
        "stage_ns_per_byte": round(model.stage_byte_s * 1e9, 4),
        "wait_factor": round(model.wait_factor, 3),
    }


def median_profile(profiles: list[OpProfile]) -> OpProfile:
    """Each op's median time over `profiles` (of one program, on one machine)."""
    return OpProfile(
        profiles[-1].machine,
        {
            key: statistics.median(p.seconds[key] for p in profiles if key in p.seconds)
            for key in profiles[-1].seconds
        },
    )


def round_constants(model: MachineModel, measured: dict) -> dict:
    """One round's constants (measure_round's), as `constants` reports them."""
    return constants(dataclasses.replace(model, **{k: v for k, v in measured.items() if k != "round_trips"}))


def planning_seconds() -> tuple[int, float]:
    """(ops, seconds) of placing a ~1,000-op MLP on 4 stages with the analytic model."""
    main, _ = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, fluidps.Program()):
        h = layers.data("x", [64])
        y = layers.data("y", [1], dtype="int64")
        for _ in range(110):
            h = layers.fc(h, 64, act="relu")
        loss = layers.mean(layers.softmax_with_cross_entropy(layers.fc(h, 10), y))
        fluidps.optimizer.SGD(0.01).minimize(loss)
    start = time.perf_counter()
    place_pipeline(main, 4, 8, CostModel(ANALYTIC), 256)
    return len(main.global_block().ops), time.perf_counter() - start


def pserver_rows() -> list[dict]:
    """Each pserver's predicted load a step over 3 pservers, round-robin against "Cost", for
    a model with one large parameter (256 x 1024) and 36 small ones of three sizes in turn,
    Adam; with parameters cut into blocks (the default) and kept whole."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [256])
        big = layers.fc(x, 1024)
        h = x
        for i in range(18):
            h = layers.fc(h, (192, 24, 8)[i % 3], act="relu")
        loss = layers.elementwise_add(layers.mean(big), layers.mean(h))
        fluidps.optimizer.Adam(0.01).minimize(loss)
    endpoints = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"
    rows = []
    for slice_up in (True, False):
        row = {"sliced": slice_up}
        for method in ("RoundRobin", "Cost"):
            config = fluidps.DistributeTranspilerConfig(split_method=method, slice_var_up=slice_up)
            plan = fluidps.DistributeTranspiler(config).transpile(0, main, endpoints, startup_program=startup)
            loads = list(plan.loads().values())
            largest_block = max(s.load_s for s in plan.slices)
            row[method] = {
                "loads_ms": [round(t * 1e3, 3) for t in loads],
                "max_over_mean": round(max(loads) / (sum(loads) / len(loads)), 3),
                "largest_block_over_mean": round(largest_block / (sum(loads) / len(loads)), 3),
            }
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--wide", type=int, default=3)
    parser.add_argument("--narrow", type=int, default=6)
    parser.add_argument("--input-width", type=int, default=512)
    parser.add_argument("--wide-width", type=int, default=2048)
    parser.add_argument("--narrow-width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=10, help="runs of each op timed")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of the constants measured first (a prediction takes the medians of every round so far)",
    )
    parser.add_argument(
        "--quick", action="store_true",
        help="3 small layers, m = 4, few steps, the constants measured once (a smoke run)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.quick:
        args.wide, args.narrow, args.wide_width, args.narrow_width, args.input_width = 1, 2, 128, 16, 32
        args.batch, args.microbatches, args.steps, args.repeats = 16, 4, 2, 1
        args.profile_steps, args.rounds = 2, 1
    m = args.microbatches
    common = {"cores": CORES, "batch": args.batch, "microbatches": m, "stages": STAGES}

    calls, job_steps = (5, 5) if args.quick else (40, 20)
    model, rounds = calibrate_machine(calls, args.rounds, job_steps)
    raw = zmq_bandwidth(4096, 5 if args.quick else 200)
    print(json.dumps({
        "bench": "placement", "row": "transport", **constants(model),
        "beta_ns_per_byte": round(model.beta_s * 1e9, 4), "fluidps_round_trips_us": [
            [size, round(t * 1e6, 1)] for size, t in rounds[0]["round_trips"]],
        "raw_pyzmq_4k_push_us": round(raw["push"] * 1e6, 1), "gemm_gflops": round(model.gemm_flops / 1e9, 1),
        "bandwidth_gbs": round(model.bandwidth / 1e9, 1), "op_overhead_us": round(model.op_overhead_s * 1e6, 2),
        "rounds": [round_constants(model, r) for r in rounds],
        **common}))  # fmt: skip

    plain, plain_startup, _, _ = build(args, None, None)

    profiles: list[OpProfile] = []

    def fresh_cost() -> CostModel:
        """The model with each op's time the median of its last PROFILES_KEPT profiles, one
        taken now (this machine drifts: a prediction uses op times measured right before
        the run it predicts; and one profile can catch a slow minute the run then misses),
        and the per-micro-batch constants the medians of every round so far, one more
        measured now (one round is noisy: its wait factor read 1.0-1.7 in one run)."""
        if not args.quick:  # (a smoke run keeps its one round: a round is four small jobs)
            rounds.append(measure_round(model, calls, job_steps))
        profiles.append(
            profile_ops(
                plain, plain_startup, feeds(args, args.batch // m, 1)[0], args.profile_steps, m, NEIGHBORS
            )
        )
        return CostModel(with_medians(model, rounds), median_profile(profiles[-PROFILES_KEPT:]))

    def last_round() -> dict:
        """The constants of the round measured last (the prediction used every round's medians)."""
        return round_constants(model, rounds[-1])

    start = time.perf_counter()
    cost = fresh_cost()
    print(json.dumps({"bench": "placement", "row": "profile", "signatures": len(cost.profile.seconds),
                      "neighbors": NEIGHBORS,
                      "seconds_with_a_round": round(time.perf_counter() - start, 2), **common}))  # fmt: skip

    config = {"num_microbatches": m}
    hidden = args.wide + args.narrow
    splits = {}
    for cut in range(1, hidden + 1):
        main_program, startup, loss, _ = build(args, cut, config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CostModelWarning)  # (the loss seed's 1 / m: not in the profile)
            now = fresh_cost()
            plan = place_pipeline(main_program, STAGES, m, now, args.batch)  # (all pinned: this cut)
        measured = measure(args, main_program, startup, loss)
        splits[cut] = {**measured, **predicted(plan, m, measured, now.machine), "round": last_round()}
        print(json.dumps({"bench": "placement", "row": "split", "cut": cut, **splits[cut], **common}))

    main_program, startup, loss, opt = build(args, None, config, cost)
    placement = opt.placement
    layer_ops = [i for i, t in zip(placement.forward_ops, placement.op_types, strict=True) if t == "mul"]
    first_of_stage_1 = placement.ops_of(1)[0]
    auto_cut = sum(1 for i in layer_ops if i < first_of_stage_1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostModelWarning)
        now = fresh_cost()
        plan = place_pipeline(main_program, STAGES, m, now, args.batch)  # (its cut, timed again)
    measured = measure(args, main_program, startup, loss)
    auto = {**measured, **predicted(plan, m, measured, now.machine), "round": last_round()}
    best_cut = min(splits, key=lambda c: splits[c]["step_ms"])
    equal_cut = (hidden + 1) // 2  # half of the fc layers (the classifier's included) on each stage
    # The splits were measured minutes apart, and this machine drifts by up to a third: the
    # best and the equal split are measured again right after the automatic one, and the
    # ratios are of these three (the first pass's steps are reported too).
    repeated = {"best": best_cut, "equal": equal_cut, "last": hidden}  # (the last: every layer on stage 0)
    again = {which: measure(args, *build(args, cut, config)[:3]) for which, cut in repeated.items()}
    print(json.dumps({
        "bench": "placement", "row": "auto", "cut_after_layers": auto_cut,
        "cut_op": first_of_stage_1, "method": placement.method, **auto,
        "best_cut": best_cut, "best_step_ms": again["best"]["step_ms"],
        "equal_cut": equal_cut, "equal_step_ms": again["equal"]["step_ms"],
        "first_pass_best_step_ms": splits[best_cut]["step_ms"], "first_pass_equal_step_ms": splits[equal_cut]["step_ms"],
        "vs_best": round(auto["step_ms"] / again["best"]["step_ms"], 3),
        "vs_equal": round(auto["step_ms"] / again["equal"]["step_ms"], 3),
        **common}))  # fmt: skip

    # The same stages measured twice in this run, minutes apart: how far a measure of this
    # machine moves by itself (what no prediction made before a run can do better than).
    moved = {
        which: {
            "cut": cut,
            "first_busy_ms": splits[cut]["busy_ms"],
            "again_busy_ms": again[which]["busy_ms"],
            "again_over_first": [
                round(b / a, 3) for a, b in zip(splits[cut]["busy_ms"], again[which]["busy_ms"], strict=True)
            ],
        }
        for which, cut in repeated.items()
    }
    largest = max(abs(r - 1) for row in moved.values() for r in row["again_over_first"])
    print(
        json.dumps(
            {"bench": "placement", "row": "repeat", **moved, "largest_move": round(largest, 3), **common}
        )
    )

    for row in pserver_rows():
        print(json.dumps({"bench": "placement", "row": "pservers", **row, "cores": CORES}))

    ops, seconds = planning_seconds()
    print(
        json.dumps(
            {"bench": "placement", "row": "planning", "ops": ops, "stages": 4, "seconds": round(seconds, 3)}
        )
    )


if __name__ == "__main__":
    main()
