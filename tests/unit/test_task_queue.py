"""The coordinator's task queue: leases, failures, discards, passes and snapshots.

A Hypothesis state machine drives random interleavings of trainers acquiring,
finishing, failing, dying (timeouts), restarting, late reports from trainers
thought dead, and coordinator restarts from a snapshot, and checks the
accounting after every step: each task is in exactly one queue, no task is
counted done twice in a pass, and every finished pass counted each of its
tasks done exactly once or discarded it.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fluidps.errors import Error
from fluidps.executor.tasks.task_queue import Lease, QueueConfig, TaskQueue
from fluidps.io.dataset import Task


def tasks(n: int) -> list[Task]:
    return [Task(i, i // 4, (i % 4) * 10, (i % 4) * 10 + 10) for i in range(n)]


def queue(n=6, passes=1, timeout=10.0, max_failures=2, shuffle=False) -> TaskQueue:
    config = QueueConfig("fp", records_per_task=10, passes=passes, shuffle=shuffle, seed=7)
    return TaskQueue(config, tasks(n), timeout=timeout, max_failures=max_failures)


def test_a_pass_hands_out_every_task_once_then_waits_then_finishes():
    q = queue(n=3)
    a, b = q.acquire(0, "w0", now=0), q.acquire(1, "w1", now=0)
    assert isinstance(a, Lease) and (a.task, b.task) == (0, 1)
    assert q.acquire(0, "w0", now=1) == a  # a trainer holds one task at a time: asking again is idempotent
    assert q.finish(a.id, "w0", samples=10, loss=2.0)
    c = q.acquire(0, "w0", now=2)
    assert c.task == 2
    assert q.acquire(2, "w2", now=2) == "wait"  # todo is empty, but tasks are pending
    assert q.finish(b.id, "w1", samples=10, loss=1.0) and q.finish(c.id, "w0", samples=10)
    assert q.finished and q.acquire(0, "w0", now=3) == "finished"
    (summary,) = q.history
    assert summary["done"] == [0, 1, 2] and summary["samples"] == 30 and summary["loss"] == pytest.approx(1.5)
    assert not q.finish(a.id, "w0")  # a second report of a finished task changes nothing


def test_failures_requeue_until_the_threshold_then_discard_and_the_job_goes_on():
    q = queue(n=2, max_failures=2)
    lease = q.acquire(0, "w0", now=0)
    other = q.acquire(1, "w1", now=0)  # holds task 1 meanwhile
    for attempt in range(3):
        assert lease.task == 0 and lease.attempt == attempt
        outcome = q.fail(lease.id, "w0", "the trainer crashed")
        assert outcome == ("discarded" if attempt == 2 else "requeued")
        lease = q.acquire(0, "w0", now=0)
    assert q.discarded == {0: "the trainer crashed"} and q.failures[0] == 3
    assert lease == "wait"  # nothing left to hand out but task 1 is pending
    q.finish(other.id, "w1", samples=10)
    assert q.finished and q.history[0]["done"] == [1] and q.history[0]["discarded"] == [0]


def test_a_lease_that_times_out_goes_to_another_trainer_and_the_late_report_is_ignored():
    q = queue(n=1, timeout=5.0)
    slow = q.acquire(0, "w0", now=0)
    assert q.acquire(1, "w1", now=4) == "wait"
    taken_over = q.acquire(1, "w1", now=6)  # trainer 0's lease expired at 5
    assert isinstance(taken_over, Lease) and taken_over.task == slow.task and taken_over.attempt == 1
    assert not q.finish(slow.id, "w0", samples=10)  # trainer 0 wakes up: not counted
    assert q.fail(slow.id, "w0", "late") == "stale"
    assert q.finish(taken_over.id, "w1", samples=10)
    assert q.history[0]["done"] == [0] and q.history[0]["samples"] == 10


def test_renewing_keeps_a_slow_trainer_s_lease():
    q = queue(n=1, timeout=5.0)
    lease = q.acquire(0, "w0", now=0)
    assert q.renew(lease.id, "w0", now=4)
    assert q.expire(now=8) == [] and q.pending[0] is lease
    assert not q.renew(lease.id, "someone else", now=8)


def test_a_lease_may_allow_longer_than_the_queue_s_timeout_and_says_so_when_it_expires():
    """The coordinator stretches a slow trainer's lease (or gives a new one its warm-up
    allowance): the deadline is as far as it allowed, and the expiry names it."""
    q = queue(n=1, timeout=5.0, max_failures=0)
    lease = q.acquire(0, "w0", now=0, allowed=12.0)
    assert q.expire(now=11) == [] and lease.allowed == 12.0
    assert q.renew(lease.id, "w0", now=11, allowed=20.0) and q.expire(now=30) == []
    assert "allowed" not in str(q.to_snapshot())  # a restored queue starts every lease afresh
    ((late, outcome),) = q.expire(now=31.5)
    assert late is lease and outcome == "discarded" and q.discarded == {0: "timed out after 20 s"}


def test_a_restarted_trainer_gives_its_old_task_back_with_a_failure():
    q = queue(n=2)
    old = q.acquire(0, "first incarnation", now=0)
    new = q.acquire(0, "second incarnation", now=1)
    assert q.failures[old.task] == 1 and new.task == 1  # the old task went to the back of todo
    assert not q.finish(old.id, "first incarnation")
    assert q.todo == type(q.todo)([old.task])


def test_release_returns_a_task_without_a_failure():
    q = queue(n=2)
    lease = q.acquire(0, "w0", now=0)
    assert q.release(lease.id, "w0") and q.failures == {} and q.todo[0] == lease.task


def test_passes_reshuffle_the_surviving_tasks():
    q = queue(n=8, passes=3, shuffle=True)
    orders: list[list[int]] = [[] for _ in range(3)]
    while (lease := q.acquire(0, "w", now=0)) != "finished":
        orders[q.pass_index].append(lease.task)
        q.finish(lease.id, "w", samples=1)
    assert len(orders) == 3 and all(sorted(o) == list(range(8)) for o in orders)
    assert len({tuple(o) for o in orders}) == 3  # each pass in a new order
    assert [h["pass"] for h in q.history] == [0, 1, 2]
    assert queue(n=8, passes=3, shuffle=True)._order(1) == q._order(1)  # the same in every process


def test_everything_discarded_finishes_the_job():
    q = queue(n=1, passes=3, max_failures=0)
    lease = q.acquire(0, "w", now=0)
    assert q.fail(lease.id, "w", "poison") == "discarded"
    assert q.finished and q.acquire(0, "w", now=0) == "finished"


def test_snapshot_round_trip_through_json_keeps_pending_leases():
    q = queue(n=5, passes=2, shuffle=True)
    a = q.acquire(0, "w0", now=0)
    b = q.acquire(1, "w1", now=0)
    q.finish(a.id, "w0", samples=10, loss=0.5)
    q.fail(b.id, "w1", "boom")
    c = q.acquire(1, "w1", now=0)
    restored = TaskQueue.from_snapshot(json.loads(json.dumps(q.to_snapshot())), now=100)
    assert restored.to_snapshot() == q.to_snapshot()
    assert restored.pending[c.task].deadline == 100 + restored.timeout  # the deadline restarts
    assert restored.finish(c.id, "w1", samples=10)  # the trainer reports to the restarted coordinator


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.pop("todo"),
        lambda s: s.update(version=99),
        lambda s: s.update(done=[*s["done"], *s["todo"][:1]]),  # a task in two queues
        lambda s: s.update(todo=s["todo"][1:]),  # a task in none
        lambda s: s.update(pending=[{"id": "x"}]),
        lambda s: s.update(config={"passes": 1}),
    ],
)
def test_a_damaged_snapshot_is_refused(damage):
    q = queue(n=4)
    q.acquire(0, "w", now=0)
    snapshot = q.to_snapshot()
    damage(snapshot)
    with pytest.raises(Error, match=r"not a valid coordinator snapshot|snapshot version"):
        TaskQueue.from_snapshot(snapshot, now=0)


def test_bad_settings_are_refused():
    with pytest.raises(Error):
        QueueConfig("fp", records_per_task=0)
    with pytest.raises(Error):
        TaskQueue(QueueConfig("fp", 1), tasks(2), timeout=0)


# -- every interleaving keeps the books ------------------------------------------------------

TRAINERS = 3


class Coordinated(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.q = queue(n=7, passes=2, timeout=5.0, max_failures=2, shuffle=True)
        self.now = 0.0
        self.incarnation = [0] * TRAINERS
        self.held: dict[int, Lease] = {}  # trainer -> the lease it believes it holds
        self.finished_passes: list[dict] = []

    def worker(self, trainer: int) -> str:
        return f"t{trainer}.{self.incarnation[trainer]}"

    @rule(trainer=st.integers(0, TRAINERS - 1))
    def acquire(self, trainer: int) -> None:
        got = self.q.acquire(trainer, self.worker(trainer), self.now)
        if isinstance(got, Lease):
            self.held[trainer] = got

    @rule(trainer=st.integers(0, TRAINERS - 1))
    def finish(self, trainer: int) -> None:
        lease = self.held.pop(trainer, None)
        if lease is not None:
            done_before, pass_before = list(self.q.done), self.q.pass_index
            counted = self.q.finish(lease.id, lease.worker, samples=lease.task + 1)
            assert not counted or lease.task not in done_before
            if counted and self.q.pass_index == pass_before:
                assert self.q.done[-1] == lease.task

    @rule(trainer=st.integers(0, TRAINERS - 1))
    def fail(self, trainer: int) -> None:
        lease = self.held.pop(trainer, None)
        if lease is not None:
            self.q.fail(lease.id, lease.worker, "crashed")

    @rule(trainer=st.integers(0, TRAINERS - 1))
    def restart(self, trainer: int) -> None:
        """The trainer process dies and comes back: it forgets its lease (a stale copy stays
        around to report late)."""
        self.incarnation[trainer] += 1

    @rule(trainer=st.integers(0, TRAINERS - 1))
    def late_report(self, trainer: int) -> None:
        """An old incarnation reports its lease after a restart: it counts exactly when the
        lease is still current (the coordinator has not yet heard of the restart, nor
        timed it out); otherwise nothing changes."""
        lease = self.held.get(trainer)
        if lease is not None and lease.worker != self.worker(trainer):
            now_held = self.q.pending.get(lease.task)
            current = now_held is not None and (now_held.id, now_held.worker) == (lease.id, lease.worker)
            done_before, pass_before = list(self.q.done), self.q.pass_index
            assert self.q.finish(lease.id, lease.worker) == current
            if not current:
                assert self.q.done == done_before
            elif self.q.pass_index == pass_before:
                assert self.q.done == [*done_before, lease.task]
            del self.held[trainer]

    @rule(seconds=st.floats(0.5, 8.0))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.q.expire(self.now)

    @rule()
    def coordinator_restarts(self) -> None:
        snapshot = json.loads(json.dumps(self.q.to_snapshot()))
        self.q = TaskQueue.from_snapshot(snapshot, self.now)

    @invariant()
    def books_balance(self) -> None:
        q = self.q
        q._check()
        assert len(q.done) == len(set(q.done))
        assert set(q.done).isdisjoint(q.discarded)
        for summary in q.history:  # a finished pass: each task done once or discarded
            assert len(summary["done"]) == len(set(summary["done"]))
            assert set(summary["done"]) | set(summary["discarded"]) == {t.id for t in q.tasks}
            assert set(summary["done"]).isdisjoint(summary["discarded"])

    @precondition(lambda self: not self.q.finished)
    @rule()
    def drive_to_the_end(self) -> None:
        """Healthy trainers finish the job from any state."""
        for _ in range(200):
            if self.q.finished:
                break
            self.now += 6.0  # every stale lease expires
            self.q.expire(self.now)
            got = self.q.acquire(0, self.worker(0), self.now)
            if isinstance(got, Lease):
                assert self.q.finish(got.id, got.worker, samples=1)
        assert self.q.finished and 1 <= len(self.q.history) <= 2  # 1: everything was discarded


TestCoordinated = Coordinated.TestCase
TestCoordinated.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
