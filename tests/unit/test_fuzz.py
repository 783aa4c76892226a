"""The fuzz tier: random and mutated programs end in a clean result or a fluidps.Error.

tests/fuzz_programs.py makes programs (forward, grad and optimizer ops; mismatched
shapes, bad attributes, wrong dtypes) and runs them through verify and the executors
in worker processes, with numba's bounds checks on: a crash is a failed test naming the
seed and the program, not a dead test runner. CI runs a seeded subset; the full run is
`python -m bench.fuzz --programs 20000`.
"""

from __future__ import annotations

import fuzz_programs
from hypothesis import given, settings
from hypothesis import strategies as st

import fluidps
from fluidps.ir.verify import shapes_compatible

CI_PROGRAMS, CI_SEED = 1500, 43  # 30-40 s on two shared cores; bench.fuzz runs 20,000


def _explain(failure: dict) -> str:
    seed, index = failure["seed"], failure["index"]
    return (
        f"seed {seed}, program {index}: {failure['outcome']} (made again by "
        f"fuzz_programs.Maker().case({seed}, {index}))\n{failure.get('detail', '')[-1500:]}\n"
        f"{fuzz_programs.describe(seed, index)[:3000]}"
    )


def test_fuzzed_programs_end_clean_or_in_a_fluidps_error():
    report = fuzz_programs.fuzz(CI_PROGRAMS, CI_SEED, jobs=2)
    assert not report.failures, "\n\n".join(_explain(f) for f in report.failures[:5])
    assert sum(report.counts.values()) == CI_PROGRAMS
    # The programs reach every stage: some run clean, some verify refuses, some the run refuses.
    assert min(report.counts["clean"], report.counts["VerifyError"], report.counts["ExecutionError"]) > 0


def test_a_worker_killed_by_a_signal_is_reported_with_its_program(monkeypatch):
    monkeypatch.setenv("FLUIDPS_FUZZ_FAULT", "abort:3")
    report = fuzz_programs.fuzz(6, seed=0, jobs=1)
    assert report.counts["signal:SIGABRT"] == 1 and sum(report.counts.values()) == 6  # the rest ran
    (failure,) = report.failures
    assert (failure["seed"], failure["index"], failure["dies_alone"]) == (0, 3, 3)


def test_a_program_that_hangs_is_a_timeout_and_the_rest_still_run(monkeypatch):
    monkeypatch.setenv("FLUIDPS_FUZZ_FAULT", "hang:0")
    report = fuzz_programs.fuzz(2, seed=0, jobs=1, timeout=10)
    assert report.counts["timeout"] == 1 and sum(report.counts.values()) == 2
    assert [f["index"] for f in report.failures] == [0]


_dims = st.lists(st.sampled_from([-1, 0, 1, 2, 3]), min_size=0, max_size=3).map(tuple)


@settings(max_examples=150, deadline=None)
@given(
    op_type=st.sampled_from(["relu_grad", "sigmoid_grad", "square_grad", "exp_grad"]), out=_dims, grad=_dims
)
def test_verify_takes_a_gradient_exactly_when_it_fits_its_variable(op_type, out, grad):
    main = fluidps.Program()
    block = main.global_block()
    for name, shape in (("v", out), ("g", grad), ("dx", out)):
        block.create_var(name, shape=shape, dtype="float32")
    source = "X" if op_type == "square_grad" else "Out"
    block._append_op_unchecked(op_type, {source: "v", "Out@GRAD": "g"}, {"X@GRAD": "dx"})
    problems = fluidps.check(main)
    mismatch = [p for p in problems if "Out@GRAD (g " in p and "does not match" in p]
    assert bool(mismatch) == (not shapes_compatible(out, grad)), problems
