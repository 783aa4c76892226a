"""WindowQueue: a stream's records cut into windows and leased as tasks (pure state)."""

from __future__ import annotations

import json

import pytest

from fluidps.errors import Error
from fluidps.executor.tasks.window_queue import (
    CUT_AHEAD,
    DISCARDED_KEPT,
    UNSAVED_MAX,
    Awaiting,
    Window,
    WindowConfig,
    WindowQueue,
)


def dense(end: int):
    """advance() over offsets 0, 1, 2, ... up to `end` (a segment log's)."""
    return lambda start, count: (min(start + count, end), min(start + count, end) - start)


def queue(records: int = 10, seconds: float | None = None, **kw) -> WindowQueue:
    return WindowQueue(WindowConfig("log:clicks", "trainers", records, seconds), 0, **kw)


def test_windows_close_on_their_record_count():
    q = queue(10)
    assert q.offer(25, 0.0, dense(25)) == [Window(0, 0, 10), Window(1, 10, 20)]  # 20..25 waits
    assert q.offer(25, 99.0, dense(25)) == []  # no time limit: it waits for ten records
    assert q.offer(31, 99.5, dense(31)) == [Window(2, 20, 30)]
    assert (q.next_start, q.committed) == (30, 0)


def test_windows_also_close_when_their_first_record_has_waited_window_seconds():
    q = queue(1000, seconds=1.0)
    assert q.offer(5, 10.0, dense(5)) == []
    assert q.offer(7, 10.5, dense(7)) == []
    assert q.offer(9, 11.0, dense(9)) == [Window(0, 0, 9)]  # a second after the first was seen
    assert q.offer(12, 11.2, dense(12)) == []  # a new window starts waiting now
    assert q.offer(12, 12.1, dense(12)) == []
    assert q.offer(12, 12.2, dense(12)) == [Window(1, 9, 12)]


def test_sparse_offsets_are_counted_by_records_not_by_their_numbers():
    offsets = list(range(0, 100, 5))  # (a Redis stream's ids are not dense)

    def advance(start: int, count: int) -> tuple[int, int]:
        after = [o for o in offsets if o >= start][:count]
        return (after[-1] + 1, len(after)) if after else (start, 0)

    q = queue(4)
    windows = q.offer(offsets[-1] + 1, 0.0, advance)
    assert [(w.start, w.stop) for w in windows] == [(0, 16), (16, 36), (36, 56), (56, 76), (76, 96)]


def test_the_committed_offset_moves_past_windows_done_in_order_only():
    q = queue(10)
    q.offer(30, 0.0, dense(30))
    a, b, c = (q.acquire(t, f"w{t}", 1.0) for t in range(3))
    assert [q.window(le) for le in (a, b, c)] == [Window(0, 0, 10), Window(1, 10, 20), Window(2, 20, 30)]
    assert q.acquire(3, "w3", 1.0) == "wait"
    assert q.finish(b.id, "w1", 10) and q.committed == 0  # window 0 is not done
    assert q.status()["done_ahead"] == 1
    assert q.finish(a.id, "w0", 10) and q.committed == 20
    assert q.finish(c.id, "w2", 10) and q.committed == 30 and q.records == 30 and not q.windows


def test_failed_expired_and_restarted_windows_go_back_and_a_late_report_is_not_counted():
    q = queue(10, timeout=5.0, max_failures=1)
    q.offer(20, 0.0, dense(20))
    first = q.acquire(0, "w0", 0.0)
    assert q.fail(first.id, "w0", "its step raised") == "requeued"
    again = q.acquire(1, "w1", 1.0)
    assert q.window(again) == Window(0, 0, 10) and again.attempt == 1
    second = q.acquire(0, "w0", 1.0)  # window 1
    assert q.acquire(0, "w0b", 2.0).task == 1  # trainer 0 restarted: its window is requeued, taken again
    assert not q.finish(second.id, "w0", 10)  # the old process's report: not counted
    assert q.expire(6.5) == [(again, "discarded")]  # second failure of window 0: past max_failures
    assert q.committed == 10 and q.status()["discarded"] == {"0": "timed out after 5 s"}  # (not trained on)
    assert q.status()["discarded_windows"] == 1
    (lease,) = q.pending.values()
    assert q.finish(lease.id, "w0b", 10) and q.committed == 20  # past the discarded window too
    assert q.records == 10


def test_stop_finishes_the_windows_in_hand_and_gives_the_rest_back_to_the_stream():
    q = queue(10)
    q.offer(60, 0.0, dense(60))
    first, second, third = (q.acquire(k, f"w{k}", 0.0) for k in range(3))
    assert q.fail(second.id, "w1", "its step failed") == "requeued"  # the offset waits for it
    q.stop()  # windows 3..5, which nobody holds, go back; window 1 is still owed
    assert q.next_start == 30 and q.offer(90, 1.0, dense(90)) == []  # and no more are cut
    again = q.acquire(4, "w4", 1.0)
    assert q.window(again).id == 1 and q.acquire(5, "w5", 1.0) == "wait" and not q.drained
    for lease, worker in ((first, "w0"), (again, "w4"), (third, "w2")):
        assert q.finish(lease.id, worker, 10)
    assert q.acquire(5, "w5", 2.0) == "stopped" and q.drained and q.committed == 30


def test_windows_are_cut_a_few_ahead_of_the_trainers():
    q = queue(10)
    assert len(q.offer(10 * (CUT_AHEAD + 5), 0.0, dense(10 * (CUT_AHEAD + 5)))) == CUT_AHEAD
    lease = q.acquire(0, "w0", 0.0)
    assert len(q.offer(10 * (CUT_AHEAD + 5), 0.0, dense(10 * (CUT_AHEAD + 5)))) == 1  # as they take them
    assert q.finish(lease.id, "w0", 10) and q.committed == 10


def test_a_snapshot_restores_the_queue_and_a_broken_one_is_refused():
    q = queue(10)
    q.offer(40, 0.0, dense(40))
    done = q.acquire(0, "w0", 0.0)
    ahead = q.acquire(1, "w1", 0.0)
    pending = q.acquire(2, "w2", 0.0)
    q.finish(ahead.id, "w1", 10)
    assert q.finish(done.id, "w0", 10) and q.committed == 20
    snapshot = json.loads(json.dumps(q.to_snapshot()))  # (as the coordinator writes it)
    back = WindowQueue.from_snapshot(snapshot, now=100.0)
    assert back.status() == q.status() and back.windows == q.windows and list(back.todo) == list(q.todo)
    assert back.pending[2].id == pending.id and back.pending[2].deadline == 160.0
    assert back.finish(pending.id, "w2", 10) and back.committed == 30
    assert back.offer(40, 100.0, dense(40)) == [] and back.acquire(0, "w0", 100.0).task == 3

    broken = dict(snapshot, windows=[[2, 25, 30], [3, 30, 40]])  # a gap after the committed offset
    with pytest.raises(Error, match="window 2 does not follow offset 20"):
        WindowQueue.from_snapshot(broken, 0.0)
    with pytest.raises(Error, match="not a valid window snapshot"):
        WindowQueue.from_snapshot({"version": 1, "kind": "windows"}, 0.0)
    with pytest.raises(Error, match="next_window 3 is not past its windows"):
        WindowQueue.from_snapshot(dict(snapshot, next_window=3), 0.0)
    with pytest.raises(Error, match=r"windows \[2\] are not each in exactly one of todo, pending"):
        WindowQueue.from_snapshot(dict(snapshot, done=[2]), 0.0)
    with pytest.raises(Error, match="window_records must be an integer >= 1, got 0"):
        WindowConfig("log:x", "g", 0)
    with pytest.raises(Error, match="consumer group 'a b'"):
        WindowConfig("log:x", "a b", 10)


def test_windows_that_expire_together_go_back_oldest_first_and_a_drain_survives_a_restart():
    q = queue(10, timeout=5.0)
    q.offer(30, 0.0, dense(30))
    for trainer in range(3):
        q.acquire(trainer, f"w{trainer}", 0.0)
    assert [w for _, w in q.expire(5.0)] == ["requeued"] * 3
    assert list(q.todo) == [0, 1, 2]  # the committed offset waits for window 0: it goes first
    q.stop()
    back = WindowQueue.from_snapshot(json.loads(json.dumps(q.to_snapshot())), now=10.0)
    assert back.stopping and back.offer(50, 10.0, dense(50)) == []  # still draining


def test_an_endless_stream_keeps_the_latest_discarded_windows_and_counts_the_rest():
    q = queue(1, max_failures=0)
    for window in range(DISCARDED_KEPT + 10):
        q.offer(DISCARDED_KEPT + 10, 0.0, dense(DISCARDED_KEPT + 10))
        lease = q.acquire(0, "w0", 0.0)
        assert q.fail(lease.id, "w0", f"bad window {window}") == "discarded"
    status = q.status()
    assert status["discarded_windows"] == DISCARDED_KEPT + 10 and q.committed == DISCARDED_KEPT + 10
    assert len(status["discarded"]) == DISCARDED_KEPT and status["discarded"][str(DISCARDED_KEPT + 9)] == (
        f"bad window {DISCARDED_KEPT + 9}"
    )
    back = WindowQueue.from_snapshot(json.loads(json.dumps(q.to_snapshot())), 0.0)
    assert back.status() == status


def test_a_final_offer_cuts_to_its_end_a_few_at_a_time_then_ends():
    q = queue(10)
    end = 10 * CUT_AHEAD + 25
    assert len(q.offer(end, 0.0, dense(end), final=True)) == CUT_AHEAD and not q.ended
    leases = [q.acquire(k, f"w{k}", 0.0) for k in range(CUT_AHEAD)]
    assert [(w.start, w.stop) for w in q.offer(end, 0.0, dense(end), final=True)] == [
        (10 * CUT_AHEAD, 10 * CUT_AHEAD + 10), (10 * CUT_AHEAD + 10, 10 * CUT_AHEAD + 20),
        (10 * CUT_AHEAD + 20, end),  # the last one short
    ]  # fmt: skip
    assert q.ended and not q.stopping and not q.drained
    for k, lease in enumerate(leases):
        q.finish(lease.id, f"w{k}", 10)
    for k in range(3):
        q.finish(q.acquire(k, f"w{k}", 0.0).id, f"w{k}", 10)
    assert q.acquire(0, "w0", 0.0) == "stopped" and q.drained and q.committed == end


def test_postponed_deadlines_keep_leases_a_stalled_coordinator_could_not_renew():
    q = queue(10, timeout=5.0)
    q.offer(20, 0.0, dense(20))
    lease = q.acquire(0, "w0", 0.0)
    q.postpone(10.0)  # the loop was held 10 s: nobody's renewal could be read
    assert q.expire(12.0) == [] and q.expire(15.0) == [(lease, "requeued")]


def test_windows_saved_by_the_pservers_commit_once_their_checkpoints_hold_them():
    q = queue(10, saved_by_pservers=True)
    q.offer(50, 0.0, dense(50))
    leases = [q.acquire(k, f"w{k}", 0.0) for k in range(4)]
    zero, one = {0: [3, "a0"], 1: [5, "b0"]}, {0: [3, "a0"]}
    assert q.finish(leases[0].id, "w0", 10, note=zero) and q.committed == 0  # done, not yet saved
    assert q.finish(leases[1].id, "w1", 10, note=one) and q.finish(
        leases[2].id, "w2", 10, exact=False, note=one
    )
    assert q.finish(leases[3].id, "w3", 0, note=one)  # (no records: nothing sent, nothing to wait for)
    assert q.awaiting() == {0: Awaiting(zero, True), 10: Awaiting(one, True), 20: Awaiting(one, False)}
    assert q.status()["awaiting_checkpoints"] == 3 and q.records == 30
    q.saved([10, 20])
    assert q.committed == 0  # windows 1 and 2 are saved, but window 0 is not
    snapshot = json.loads(json.dumps(q.to_snapshot()))
    back = WindowQueue.from_snapshot(snapshot, 0.0)
    assert back.awaiting() == {0: Awaiting(zero, True)} and back.status() == q.status()

    assert [(w.start, w.stop) for w in back.reopen([0])] == [(0, 10)]  # a restored pserver lost it
    assert (
        back.records == 20 and back.trained == 30 and back.status()["replayed"] == 1 and back.committed == 0
    )
    again = back.acquire(5, "w5", 0.0)
    assert again.task == 0  # first, before the windows waiting in todo
    back.finish(again.id, "w5", 10, note={0: [4, "a1"], 1: [6, "b0"]})
    back.saved([0])
    assert back.committed == 40 and back.records == 30 and back.trained == 40


def test_a_drained_queue_waits_for_windows_the_pservers_have_not_saved():
    q = queue(10, saved_by_pservers=True)
    q.offer(10, 0.0, dense(10), final=True)
    lease = q.acquire(0, "w0", 0.0)
    q.finish(lease.id, "w0", 10, note={})
    assert q.acquire(0, "w0", 0.0) == "wait" and not q.drained  # it may go out again
    q.saved([0])
    assert q.acquire(0, "w0", 0.0) == "stopped" and q.drained and q.committed == 10


def test_no_more_windows_are_cut_while_too_many_wait_for_the_pservers():
    q = queue(1, saved_by_pservers=True)
    end = UNSAVED_MAX + CUT_AHEAD + 20
    while len(q.unsaved) < UNSAVED_MAX:
        q.offer(end, 0.0, dense(end))
        q.finish(q.acquire(0, "w0", 0.0).id, "w0", 1)
    cut = q.next_start
    assert q.offer(end, 0.0, dense(end)) == [] and q.next_start == cut  # (those cut before still go out)
    q.saved(list(range(cut)))
    assert q.committed == UNSAVED_MAX and q.offer(end, 0.0, dense(end))
