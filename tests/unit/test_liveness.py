"""A peer's silence allowance: the configured timeout is a floor that stretches with the
gaps seen between the peer's messages, with a warm-up allowance until its first step."""

from __future__ import annotations

import pytest

from fluidps.executor.transport.liveness import CEILING, STRETCH, SilenceClock


def _warm(floor: float = 4.0, warmup: float = 120.0) -> SilenceClock:
    clock = SilenceClock(floor, warmup, now=0.0)
    clock.warm = True
    return clock


def test_until_its_first_step_a_peer_has_the_warm_up_allowance():
    clock = SilenceClock(4.0, 120.0, now=0.0)
    clock.heard(1.0)
    clock.heard(30.0)  # compiling: no gap is taken from before it is warm
    assert not clock.expired(100.0) and clock.expired(151.0)
    assert clock.allowance(first_step=False) == 4.0  # not waiting for a step: the floor
    clock.warm = True
    assert clock.allowance() == 4.0 and not clock.gaps


def test_the_allowance_stretches_with_the_longest_recent_gap_and_is_capped():
    clock = _warm()
    for t in (0.5, 1.0, 1.5):
        clock.heard(t)
    assert clock.allowance() == 4.0  # heartbeats 0.5 s apart: the floor
    assert clock.stretch_report() is None
    clock.heard(4.5)  # a 3 s gap: a slow machine, not a dead one
    assert clock.allowance() == STRETCH * 3.0
    assert not clock.expired(4.5 + 11.0) and clock.expired(4.5 + 12.5)
    report = clock.stretch_report()
    assert report is not None and "12.0 s (configured 4 s)" in report and "3.00 s apart" in report
    assert clock.stretch_report() is None  # said once until it grows again
    clock.heard(4.5 + 30.0)
    assert clock.allowance() == CEILING * 4.0  # a dead peer is still found


def test_the_window_forgets_old_gaps():
    clock = _warm()
    clock.heard(3.0)
    assert clock.allowance() == 12.0
    t = 3.0
    for _ in range(64):
        t += 0.5
        clock.heard(t)
    assert clock.allowance() == 4.0


def test_a_client_s_wait_does_not_count_the_time_between_waits_as_a_gap():
    clock = _warm()
    clock.heard(1.0)
    clock.restart(500.0)  # idle between two waits
    clock.heard(500.2)
    assert clock.allowance() == 4.0 and clock.silent_for(501.0) == pytest.approx(0.8)
