"""Placement by cost model against every split, measured: an unbalanced MLP whose wide
layers come first, on 2 pipeline stages (one process with one thread each), m = 8.

    python -m bench.placement [--wide 3] [--narrow 6] [--wide-width 2048] [--narrow-width 256]
                              [--batch 256] [--microbatches 8] [--steps 8] [--repeats 2] [--quick]

Everything below is measured in one run, in this order:
- "transport": `fluidps calibrate`'s fit of a message over fluidps's transport
  (alpha + beta * bytes) and this machine's rates, next to a raw pyzmq round trip of a
  small frame (bench.bandwidth's peer): what the model's messages are made of;
- "profile": the program's ops timed on a micro-batch's rows (fluidps.executor.op_profile),
  timed again before each run below, whose prediction uses the new times (this machine
  drifts by up to a third between minutes);
- "split": for every cut between layers (stage 0 holds the first `cut` hidden layers),
  the measured step (RemoteExecutor, one process per stage), each stage's measured busy
  time per step (running its programs, not waiting for values) and the model's
  prediction of each, for the same cut (its ops pinned where the guards put them);
- "auto": PipelineOptimizer(num_stages=2) with no device_guard, placed by the same model:
  its cut, measured and predicted, and its step over the best split's and over the split
  with equal layer counts (the default a person writes);
- "planning": seconds to place a program of about 1,000 ops on 4 stages.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

import fluidps  # noqa: E402
from bench.bandwidth import zmq_bandwidth  # noqa: E402
from bench.pipeline import rate  # noqa: E402
from fluidps import layers  # noqa: E402
from fluidps.executor.calibrate import calibrate  # noqa: E402
from fluidps.executor.op_profile import profile_ops  # noqa: E402
from fluidps.transpiler.cost_model import ANALYTIC, CostModel, CostModelWarning  # noqa: E402
from fluidps.transpiler.partition import place_pipeline  # noqa: E402

STAGES = 2
CORES = os.cpu_count() or 1


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
    """The pipeline job's step (ms) and each stage's busy ms per step, over the timed steps."""
    batches = feeds(args, args.batch)
    with fluidps.RemoteExecutor(fluidps.JobDesc()) as exe:
        exe.run(startup)
        settled, compiled, i = 0, None, 0
        while i < args.warmup or settled < 3:  # past the compile: every stage's segments settled
            exe.run(main, feed=batches[i % len(batches)], fetch_list=[loss])
            now = [s["compiled_ops"] for s in exe.stage_stats()]
            settled = settled + 1 if now == compiled and all(now) else 0
            compiled, i = now, i + 1
            if i > 200:
                raise RuntimeError(f"the stages' compiled ops did not settle in 200 steps: {now}")
        before = [s["pipeline"] for s in exe.stage_stats()]
        steps_per_s = rate(
            lambda f: exe.run(main, feed=f, fetch_list=[loss]), batches, args.steps, args.repeats, 0
        )
        after = [s["pipeline"] for s in exe.stage_stats()]
    busy = [
        round((a["busy_s"] - b["busy_s"]) * 1e3 / max(a["steps"] - b["steps"], 1), 2)
        for a, b in zip(after, before, strict=True)
    ]
    return {"step_ms": round(1e3 / steps_per_s, 2), "busy_ms": busy}


def predicted(placement, m: int, measured: dict) -> dict:
    """The model's step and stage times for this placement, and each stage's error
    against the measured busy time (predicted / measured - 1)."""
    per_stage = [m * s * 1e3 for s in placement.stage_s]
    return {
        "predicted_step_ms": round(placement.predicted_step_s * 1e3, 2),
        "predicted_busy_ms": [round(t, 2) for t in per_stage],
        "stage_error": [round(p / b - 1, 3) for p, b in zip(per_stage, measured["busy_ms"], strict=True)],
    }


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
    parser.add_argument("--warmup", type=int, default=6, help="steps before timing (past the compile)")
    parser.add_argument("--profile-steps", type=int, default=10, help="runs of each op timed")
    parser.add_argument("--quick", action="store_true", help="3 small layers, m = 4, few steps (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.wide, args.narrow, args.wide_width, args.narrow_width, args.input_width = 1, 2, 128, 16, 32
        args.batch, args.microbatches, args.steps, args.repeats, args.warmup = 16, 4, 2, 1, 2
        args.profile_steps = 2
    m = args.microbatches
    common = {"cores": CORES, "batch": args.batch, "microbatches": m, "stages": STAGES}

    model, fitted = calibrate(calls=5 if args.quick else 40)
    raw = zmq_bandwidth(4096, 5 if args.quick else 200)
    print(json.dumps({
        "bench": "placement", "row": "transport", "alpha_us": round(model.alpha_s * 1e6, 1),
        "beta_ns_per_byte": round(model.beta_s * 1e9, 4), "fluidps_round_trips_us": [
            [size, round(t * 1e6, 1)] for size, t in fitted["round_trips"]],
        "raw_pyzmq_4k_push_us": round(raw["push"] * 1e6, 1), "gemm_gflops": round(model.gemm_flops / 1e9, 1),
        "bandwidth_gbs": round(model.bandwidth / 1e9, 1), "op_overhead_us": round(model.op_overhead_s * 1e6, 2),
        **common}))  # fmt: skip

    plain, plain_startup, _, _ = build(args, None, None)

    def fresh_cost() -> CostModel:
        """The model with the ops timed now (this machine drifts: each prediction is made
        with times measured right before the run it predicts)."""
        profile = profile_ops(plain, plain_startup, feeds(args, args.batch // m, 1)[0], args.profile_steps, m)
        return CostModel(model, profile)

    start = time.perf_counter()
    cost = fresh_cost()
    print(json.dumps({"bench": "placement", "row": "profile", "signatures": len(cost.profile.seconds),
                      "seconds": round(time.perf_counter() - start, 2), **common}))  # fmt: skip

    config = {"num_microbatches": m}
    hidden = args.wide + args.narrow
    splits = {}
    for cut in range(1, hidden + 1):
        main_program, startup, loss, _ = build(args, cut, config)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CostModelWarning)  # (the loss seed's 1 / m: not in the profile)
            plan = place_pipeline(main_program, STAGES, m, fresh_cost(), args.batch)  # (all pinned: this cut)
        measured = measure(args, main_program, startup, loss)
        splits[cut] = {**measured, **predicted(plan, m, measured)}
        print(json.dumps({"bench": "placement", "row": "split", "cut": cut, **splits[cut], **common}))

    main_program, startup, loss, opt = build(args, None, config, cost)
    placement = opt.placement
    layer_ops = [i for i, t in zip(placement.forward_ops, placement.op_types, strict=True) if t == "mul"]
    auto_cut = sum(1 for i in layer_ops if i < placement.forward_ops[placement.cuts[1]])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CostModelWarning)
        now = place_pipeline(main_program, STAGES, m, fresh_cost(), args.batch)  # (its cut, timed again)
    measured = measure(args, main_program, startup, loss)
    auto = {**measured, **predicted(now, m, measured)}
    best_cut = min(splits, key=lambda c: splits[c]["step_ms"])
    equal_cut = (hidden + 1) // 2  # half of the fc layers (the classifier's included) on each stage
    print(json.dumps({
        "bench": "placement", "row": "auto", "cut_after_layers": auto_cut,
        "cut_op": placement.forward_ops[placement.cuts[1]], **auto,
        "best_cut": best_cut, "best_step_ms": splits[best_cut]["step_ms"],
        "equal_cut": equal_cut, "equal_step_ms": splits[equal_cut]["step_ms"],
        "vs_best": round(auto["step_ms"] / splits[best_cut]["step_ms"], 3),
        "vs_equal": round(auto["step_ms"] / splits[equal_cut]["step_ms"], 3),
        **common}))  # fmt: skip

    ops, seconds = planning_seconds()
    print(
        json.dumps(
            {"bench": "placement", "row": "planning", "ops": ops, "stages": 4, "seconds": round(seconds, 3)}
        )
    )


if __name__ == "__main__":
    main()
