"""fluidps.profiling: totals by category, and per-step breakdowns between two reports."""

from __future__ import annotations

import threading

from fluidps.profiling import Profile, per_step


def test_a_profile_adds_time_by_category_and_reports_totals():
    profile = Profile()
    profile.add("compute", 0.002)
    profile.add("compute", 0.004)
    with profile.span("send"):
        pass
    profile.step()
    report = profile.report()
    assert (
        report["steps"] == 1
        and report["ms"]["compute"] == 6.0
        and report["calls"] == {"compute": 2, "send": 1}
    )
    assert report["ms"]["send"] >= 0
    assert profile.report(steps=7)["steps"] == 7


def test_per_step_divides_what_happened_between_two_reports():
    profile = Profile()
    profile.add("compute", 1.0)
    profile.step()
    before = profile.report()
    for _ in range(4):
        profile.step()
        profile.add("compute", 0.002)
        profile.add("recv", 0.001)
    steps = per_step(before, profile.report())
    assert steps["steps"] == 4
    assert list(steps["ms_per_step"]) == ["compute", "recv"]  # most time first
    assert steps["ms_per_step"] == {"compute": 2.0, "recv": 1.0}
    assert steps["calls_per_step"] == {"compute": 1.0, "recv": 1.0}


def test_a_profile_counts_every_addition_from_many_threads():
    profile = Profile()

    def work():
        for _ in range(1000):
            profile.add("optimize", 0.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert profile.report()["calls"]["optimize"] == 4000
