"""Which trainers a pserver waits for (fluidps.executor.ps.membership)."""

from __future__ import annotations

import pytest

from fluidps.errors import TransportError
from fluidps.executor.ps.membership import DONE, LIVE, LOST, PAUSED, Claim, Membership

A, B, C = 0xA1, 0xB2, 0xC3  # incarnations (message senders)


def _c(trainer: int, sender: int) -> bytes:
    """A connection of `trainer`'s incarnation `sender` (a ZeroMQ routing id)."""
    return f"c{trainer}-{sender:x}".encode()


def _running(trainers: int, elastic: bool, steps: list[int]) -> Membership:
    """Every trainer admitted with its first incarnation and `steps[t]` SENDs counted."""
    m = Membership(trainers, elastic=elastic)
    for t in range(trainers):
        m.admit(t, 0x100 + t, _c(t, 0x100 + t))
        for step in range(1, steps[t] + 1):  # a trainer's steps count from 1
            m.tick(t, step)
    assert [m.clock(t) for t in range(trainers)] == steps
    return m


# -- admission ----------------------------------------------------------------------------


@pytest.mark.parametrize("elastic", [False, True])
def test_first_incarnation_is_admitted(elastic: bool):
    m = Membership(2, elastic=elastic)
    assert m.live == m.active == {0, 1}
    m.admit(0, A, _c(0, A))
    m.admit(0, A, _c(0, A))  # its later messages too
    with pytest.raises(TransportError, match="must carry its incarnation"):
        m.admit(0, 0, _c(0, 0))  # a message without a sender
    assert m.members[0].sender == A
    assert m.members[0].state == LIVE
    assert m.live == {0, 1}
    assert m.events == []


def test_second_incarnation_is_refused_when_not_elastic():
    m = _running(2, elastic=False, steps=[3, 5])
    with pytest.raises(TransportError, match="not elastic") as err:
        m.admit(0, A, _c(0, A))
    assert "trainer 0" in str(err.value)
    assert m.members[0].sender == 0x100
    assert m.clock(0) == 3
    m.admit(0, 0x100, _c(0, 0x100))  # the first incarnation goes on
    assert m.live == {0, 1}


def test_elastic_restart_replaces_the_old_incarnation_it_names():
    m = _running(3, elastic=True, steps=[7, 4, 9])
    m.admit(0, A, b"new", replaces=0x100)
    assert m.members[0].sender == A
    assert m.members[0].state == LIVE
    assert m.clock(0) == 4  # level with the slowest other live trainer, not back to 0
    assert m.live == {0, 1, 2}
    assert len(m.events) == 1 and "trainer 0" in m.events[0] and "restarted" in m.events[0]

    with pytest.raises(TransportError, match="evicted"):
        m.admit(0, 0x100, _c(0, 0x100))  # the old incarnation, still sending
    m.admit(0, A, b"new")  # the new one goes on
    # its first SEND counts one step, whatever the trainer's own step number
    assert m.tick(0, 50)
    assert m.clock(0) == 5


def test_elastic_restart_joins_at_the_slowest_clock_of_live_trainers_only():
    m = _running(3, elastic=True, steps=[7, 2, 9])
    m.pause(1)  # paused at 2: nobody waits for it, so it does not set the level
    m.admit(0, A, _c(0, A), replaces=0x100)
    assert m.clock(0) == 9


def test_elastic_restart_of_the_only_trainer_keeps_its_clock():
    m = _running(1, elastic=True, steps=[6])
    m.admit(0, A, _c(0, A), replaces=0x100)
    assert m.clock(0) == 6


def test_an_elastic_claim_that_does_not_name_the_live_holder_waits_until_it_is_evicted():
    m = _running(2, elastic=True, steps=[3, 5])
    for replaces in (0, 0xDEAD):  # none, or not the holder
        with pytest.raises(Claim) as claim:
            m.admit(0, A, b"new", replaces)
        assert (claim.value.trainer, claim.value.holder) == (0, 0x100)
    assert m.members[0].sender == 0x100 and m.events == []  # nothing changed
    m.admit(0, 0x100, _c(0, 0x100))  # the holder goes on
    m.lose(0, "silent")
    m.admit(0, A, b"new")  # now it may join
    assert m.members[0].sender == A and m.members[0].state == LIVE


def test_a_connection_speaks_for_the_incarnation_of_its_first_message():
    m = _running(2, elastic=True, steps=[3, 5])
    m.admit(0, 0x100, b"keepalive-0")  # another socket of the same process
    conn = _c(0, 0x100)
    for trainer, sender in ((1, 0x100), (0, A), (1, 0x101)):  # a corrupted or forged header
        with pytest.raises(TransportError, match="a connection speaks for one incarnation"):
            m.admit(trainer, sender, conn, replaces=0x100)
    assert [m.members[t].sender for t in (0, 1)] == [0x100, 0x101] and m.events == []
    m.admit(0, A, b"restarted", replaces=0x100)  # a restart its launcher vouched for
    with pytest.raises(TransportError, match="evicted"):
        m.admit(0, 0x100, conn)  # the old incarnation's connections are refused
    m.admit(0, A, b"restarted")


@pytest.mark.parametrize("elastic", [False, True])
def test_trainers_a_launcher_announced_cannot_be_claimed_by_another_incarnation(elastic: bool):
    m = Membership(2, elastic=elastic, expected=[A, B])
    with pytest.raises(TransportError, match=r"trainer 0 of this job is incarnation a1 .* not c3: refused"):
        m.admit(0, C, _c(0, C))  # before trainer 0 spoke
    m.admit(0, A, _c(0, A))
    m.admit(1, B, _c(1, B))
    assert [m.members[t].sender for t in (0, 1)] == [A, B] and m.events == []
    with pytest.raises(TransportError, match="incarnations were given for 2 trainers"):
        Membership(2, elastic=elastic, expected=[A])


def test_a_restart_its_launcher_vouched_for_replaces_a_trainer_that_never_spoke():
    m = Membership(1, elastic=True, expected=[A])
    m.admit(0, B, _c(0, B), replaces=A)  # trainer 0 died before its first message
    assert m.members[0].sender == B and "restarted" in m.events[0]


# -- pause, resume, complete -----------------------------------------------------------------


def test_pause_and_resume():
    m = _running(3, elastic=False, steps=[2, 6, 8])
    m.pause(0)
    assert m.members[0].state == PAUSED
    assert m.live == {1, 2}
    assert m.active == {0, 1, 2}
    assert m.slowest() == 6  # the paused trainer is not waited for

    m.resume(0)
    assert m.members[0].state == LIVE
    assert m.live == {0, 1, 2}
    assert m.clock(0) == 6  # at least the slowest live clock
    assert m.tick(0, 100)  # the first SEND after resuming counts as one step
    assert m.clock(0) == 7


def test_resume_keeps_a_clock_ahead_of_the_others():
    m = _running(2, elastic=False, steps=[9, 4])
    m.pause(0)
    m.resume(0)
    assert m.clock(0) == 9


def test_resume_of_a_live_trainer_changes_nothing():
    m = _running(2, elastic=False, steps=[1, 4])
    m.resume(0)
    assert m.clock(0) == 1
    assert not m.tick(0, 0)  # its step history is kept: step 0 was counted


def test_complete():
    m = _running(2, elastic=False, steps=[3, 4])
    m.complete(0)
    assert m.members[0].state == DONE
    assert m.live == {1} and m.active == {1}
    m.pause(0)  # pausing a finished trainer leaves it finished
    assert m.members[0].state == DONE
    m.resume(0)
    assert m.members[0].state == DONE
    m.complete(1)
    assert m.active == set()


# -- losing trainers ---------------------------------------------------------------------------


def test_lose_in_an_elastic_job_evicts():
    m = _running(3, elastic=True, steps=[3, 8, 5])
    m.lose(0, "silent for 30 s")
    assert m.members[0].state == LOST
    assert m.live == {1, 2} and m.active == {1, 2}
    assert any("trainer 0" in e and "evicted" in e and "silent for 30 s" in e for e in m.events)
    with pytest.raises(TransportError, match="evicted"):
        m.admit(0, 0x100, _c(0, 0x100))

    m.admit(0, A, _c(0, A))  # a restarted process rejoins
    assert m.members[0].state == LIVE
    assert m.live == {0, 1, 2}
    assert m.clock(0) == 5  # the slowest other live clock
    assert any("trainer 0" in e and "rejoins" in e for e in m.events)
    assert m.tick(0, 0)
    assert m.clock(0) == 6
    with pytest.raises(TransportError, match="evicted"):
        m.admit(0, 0x100, _c(0, 0x100))  # still refused after the rejoin


def test_lose_in_a_non_elastic_job_marks_lost():
    m = _running(2, elastic=False, steps=[3, 4])
    m.lose(1, "silent for 30 s")
    assert m.members[1].state == LOST
    assert m.live == {0} and m.active == {0}
    assert any("trainer 1" in e and "lost" in e and "silent for 30 s" in e for e in m.events)
    with pytest.raises(TransportError, match="declared lost"):
        m.admit(1, 0x101, _c(1, 0x101))
    with pytest.raises(TransportError, match="not elastic"):
        m.admit(1, B, _c(1, B))
    assert m.members[1].state == LOST


def test_events_record_restarts_and_evictions_in_order():
    m = _running(2, elastic=True, steps=[1, 1])
    m.admit(0, A, _c(0, A), replaces=0x100)
    m.lose(1, "why-1")
    m.admit(1, B, _c(1, B))
    m.admit(1, C, _c(1, C), replaces=B)
    assert len(m.events) == 4
    assert "trainer 0" in m.events[0] and "restarted" in m.events[0]
    assert "trainer 1" in m.events[1] and "evicted" in m.events[1] and "why-1" in m.events[1]
    assert "trainer 1" in m.events[2] and "rejoins" in m.events[2] and f"{B:x}" in m.events[2]
    assert "trainer 1" in m.events[3] and "restarted" in m.events[3]
    assert f"{B:x}" in m.events[3] and f"{C:x}" in m.events[3]


# -- clocks ------------------------------------------------------------------------------------


def test_tick_counts_step_deltas_and_ignores_old_steps():
    m = Membership(1, elastic=False)
    m.admit(0, A, _c(0, A))
    assert m.tick(0, 3)  # a new trainer's first SEND (uploading every 3 steps) counts its steps
    assert m.clock(0) == 3
    assert m.tick(0, 4)
    assert m.clock(0) == 4
    assert m.tick(0, 7)  # skipped steps count
    assert m.clock(0) == 7
    assert not m.tick(0, 7)  # repeated
    assert not m.tick(0, 5)  # older
    assert m.clock(0) == 7
    m.pause(0)
    m.resume(0)
    assert m.tick(0, 40)  # after a pause, the first SEND counts one step, whatever its number
    assert m.clock(0) == 8
    assert m.tick(0, 41)
    assert m.clock(0) == 9


def test_slowest_over_live_trainers():
    m = _running(3, elastic=True, steps=[5, 2, 7])
    assert m.slowest() == 2
    m.pause(1)
    assert m.slowest() == 5
    m.complete(0)
    assert m.slowest() == 7
    m.lose(2, "gone")
    assert m.live == set()
    assert m.slowest() is None
    m.resume(1)
    assert m.slowest() == 2


def test_slowest_is_none_when_every_trainer_is_done():
    m = _running(2, elastic=False, steps=[1, 2])
    m.complete(0)
    m.complete(1)
    assert m.slowest() is None


def test_lost_trainer_is_not_waited_for():
    m = _running(2, elastic=False, steps=[1, 9])
    m.lose(0, "gone")
    assert m.slowest() == 9
    assert m.members[0].state == LOST
