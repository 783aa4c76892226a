"""What the shape guard costs a local step, measured in one process.

    python -m bench.guard [--steps 300] [--windows 16] [--executor interpreted,compiled]

The same executor runs the same model in windows of `steps` steps, alternating (in
pairs whose order alternates) between the guard as it is and the guard replaced by no-ops
(fluidps.executor.shape_guard.ShapeGuard's checks; a compiled segment's own comparisons
of its inputs' shapes stay, a few integer comparisons in its compiled code). One JSON row
per model and executor: the median step time of each, the median of the windows' ratios
(guarded / unguarded) and their range. Pairs of windows a few milliseconds apart share the
machine's state, which separate runs on a small machine do not.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import fluidps  # noqa: E402
from bench.local import classifier_program  # noqa: E402
from fluidps.executor import shape_guard  # noqa: E402
from fluidps.executor.compiler import Compiler, ModuleCache  # noqa: E402

MODELS = {"tiny": [64, 10], "digits_mlp": [64, 256, 256, 10]}
BATCH = 64


@contextmanager
def guard_off() -> Iterator[None]:
    """The guard's checks as no-ops, for the windows that measure a step without them."""
    checks = shape_guard.ShapeGuard.check_env, shape_guard.ShapeGuard.check_args
    shape_guard.ShapeGuard.check_env = lambda self, env: None
    shape_guard.ShapeGuard.check_args = lambda self, args, env: None
    try:
        yield
    finally:
        shape_guard.ShapeGuard.check_env, shape_guard.ShapeGuard.check_args = checks


def measure(model: str, executor: str, steps: int, windows: int) -> dict:
    main, startup, loss, batches = classifier_program(MODELS[model], BATCH)
    cache = tempfile.mkdtemp(prefix="fluidps-bench-guard-")
    try:
        compiled = executor == "compiled"
        exe = fluidps.Executor(compile=Compiler(ModuleCache(cache), compile_after=2) if compiled else False)
        exe.run(startup)

        def window() -> float:
            began = time.perf_counter()
            for i in range(steps):
                exe.run(main, feed=batches[i % len(batches)], fetch_list=[loss])
            return (time.perf_counter() - began) / steps

        window()  # warm: kernels, the compiled block, the guard's first signatures
        on, off = [], []
        for w in range(windows):
            for guarded in (True, False) if w % 2 else (False, True):
                if guarded:
                    on.append(window())
                else:
                    with guard_off():
                        off.append(window())
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    ratios = [a / b for a, b in zip(on, off, strict=True)]
    return {
        "bench": "guard",
        "workload": model,
        "executor": executor,
        "ops": len(main.global_block().ops),
        "step_us_guarded": round(statistics.median(on) * 1e6, 1),
        "step_us_unguarded": round(statistics.median(off) * 1e6, 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "windows": windows,
        "steps": steps,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="steps in a window")
    parser.add_argument("--windows", type=int, default=16, help="pairs of windows, guarded and not")
    parser.add_argument("--models", default="tiny,digits_mlp")
    parser.add_argument("--executor", default="interpreted,compiled")
    args = parser.parse_args(argv)
    for model in args.models.split(","):
        for executor in args.executor.split(","):
            print(json.dumps(measure(model, executor, args.steps, args.windows)), flush=True)


if __name__ == "__main__":
    main()
