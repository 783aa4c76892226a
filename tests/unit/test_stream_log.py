"""fluidps.io.StreamLog: the embedded segment log a streaming job reads from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from fluidps.errors import StreamError
from fluidps.io import StreamLog, StreamSource, open_stream
from fluidps.io.stream_log import HEADER


def clicks(rows: int, start: int = 0) -> dict[str, np.ndarray]:
    ids = np.arange(start, start + rows, dtype=np.int64)
    return {"ids": np.stack([ids, ids * 7], axis=1), "dense": (ids[:, None] * 0.5).astype(np.float32),
            "label": (ids % 2).astype(np.int64)}  # fmt: skip


RECORD = 16 + 2 * 8 + 4 + 8 + 4  # bytes: offset, time; ids int64[2], dense float32[1], label int64; crc


def test_appended_records_read_back_by_offset_across_segments(tmp_path):
    log = StreamLog(tmp_path / "log", segment_bytes=HEADER.size + 10 * RECORD)  # ten records a segment
    assert (log.start_offset(), log.end_offset(), log.fields) == (0, 0, None)
    offsets = [log.append(clicks(5, start), timestamp=1000.0 + start) for start in range(0, 35, 5)]
    assert np.concatenate(offsets).tolist() == list(range(35))
    assert log.end_offset() == 35 and len(log.segments()) == 4  # a segment rolls once it is full
    assert [f.describe() for f in log.fields.values()] == [
        "ids int64[2]",
        "dense float32[1]",
        "label int64[]",
    ]

    got = log.read(3, 25)  # across three segments
    assert got.offsets.tolist() == list(range(3, 28)) and got.next_offset == 28 and not got.bad
    want = clicks(25, 3)
    for name in want:
        np.testing.assert_array_equal(got.fields[name], want[name])
        assert got.fields[name].dtype == want[name].dtype
    assert got.timestamps[0] == 1000.0 and got.timestamps[-1] == 1025.0  # each append's time
    tail = log.read(30, 100)  # fewer at the end
    assert tail.offsets.tolist() == list(range(30, 35)) and tail.next_offset == 35
    end = log.read(35, 10)
    assert len(end) == 0 and end.next_offset == 35 and end.fields["ids"].shape == (0, 2)

    again = StreamLog(tmp_path / "log")  # another reader, from the files alone
    assert again.end_offset() == 35 and again.settings["segment_bytes"] == HEADER.size + 10 * RECORD
    assert again.read(0, 35).fields["label"].tolist() == (np.arange(35) % 2).tolist()
    assert isinstance(again, StreamSource) and isinstance(open_stream(f"log:{tmp_path / 'log'}"), StreamLog)


def test_records_that_do_not_match_the_fields_are_refused_by_name(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(clicks(2))
    good = clicks(1)
    with pytest.raises(StreamError, match=r"missing \['label'\], unknown \['labels'\]"):
        log.append({"ids": good["ids"], "dense": good["dense"], "labels": good["label"]})
    with pytest.raises(StreamError, match=r"field 'ids' is int64\[2\] a record, got int64\[3\]"):
        log.append({**good, "ids": np.zeros((1, 3), np.int64)})
    with pytest.raises(StreamError, match="field 'label' holds int64; float64 does not convert"):
        log.append({**good, "label": np.array([0.5])})
    with pytest.raises(StreamError, match="one row per record"):
        log.append({**good, "label": np.array([0, 1])})
    with pytest.raises(
        StreamError, match=r"timestamp must be one time for all 1 records or one a record, got \(2,\)"
    ):
        log.append(good, timestamp=[1.0, 2.0])
    log.append({**good, "label": np.array([1], np.int32)})  # converts without loss: taken
    assert log.end_offset() == 3 and log.read(2, 1).fields["label"].tolist() == [1]
    with pytest.raises(StreamError, match="holds records of ids int64"):
        StreamLog(tmp_path / "log", fields={"x": np.zeros(3, np.float32)})
    with pytest.raises(StreamError, match="fields hold numbers"):
        StreamLog(tmp_path / "other").append({"name": np.array(["a"])})
    for start, count in ((-1, 1), (0, -1), (True, 1)):
        with pytest.raises(StreamError, match=r"read\(start, count\) takes integers >= 0"):
            log.read(start, count)
    with pytest.raises(StreamError, match=r"offset 4 is past its end \(3\)"):
        log.read(4, 1)
    with pytest.raises(StreamError, match="timestamps must be finite"):
        log.append(good, timestamp=float("nan"))


def test_a_damaged_record_is_handed_back_aside_and_the_rest_are_read(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(clicks(10))
    (_, segment), size = log.segments()[0], RECORD
    data = bytearray(segment.read_bytes())
    data[HEADER.size + 4 * size + 20] ^= 0xFF  # a bit flipped in record 4's fields
    data[HEADER.size + 7 * size : HEADER.size + 7 * size + 8] = (99).to_bytes(8, "little")  # 7 says 99
    segment.write_bytes(bytes(data))
    got = log.read(0, 10)
    assert got.offsets.tolist() == [0, 1, 2, 3, 5, 6, 8, 9] and got.next_offset == 10
    assert [(b.offset, b.reason) for b in got.bad] == [
        (4, "its CRC does not match"),
        (7, "its CRC does not match"),  # (the CRC covers the offset too)
    ]
    assert got.fields["ids"][:, 0].tolist() == [0, 1, 2, 3, 5, 6, 8, 9] and len(got.bad[0].raw) == RECORD

    moved = bytearray(data[HEADER.size + 2 * RECORD : HEADER.size + 3 * RECORD])  # record 2, whole
    data[HEADER.size + 3 * RECORD : HEADER.size + 4 * RECORD] = moved  # written again where 3 was
    segment.write_bytes(bytes(data))
    assert [(b.offset, b.reason) for b in log.read(3, 1).bad] == [(3, "it says offset 2")]


def test_a_segment_cut_short_by_a_crash_reports_its_missing_records_and_reads_on(tmp_path):
    log = StreamLog(tmp_path / "log", segment_bytes=HEADER.size + 4 * RECORD, sync=False)
    for start in range(0, 12, 4):
        log.append(clicks(4, start))
    _, (_, second), _ = log.segments()
    os.truncate(second, HEADER.size + 2 * RECORD)  # its last two records never reached the disk
    got = log.read(0, 12)
    assert got.offsets.tolist() == [0, 1, 2, 3, 4, 5, 8, 9, 10, 11] and got.next_offset == 12
    assert [(b.offset, b.reason) for b in got.bad] == [
        (6, "its segment ends before it (cut short by a crash)"),
        (7, "its segment ends before it (cut short by a crash)"),
    ]


def test_a_tail_torn_by_a_dead_appender_is_cut_off_and_offsets_stay_dense(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(clicks(3))
    _, segment = log.segments()[0]
    with open(segment, "ab") as f:
        f.write(b"\x01" * (RECORD // 2))  # half a record: its appender died
    assert log.end_offset() == 3 and log.read(0, 10).offsets.tolist() == [0, 1, 2]
    assert log.append(clicks(2, 3)).tolist() == [3, 4]
    got = log.read(0, 10)
    assert got.offsets.tolist() == [0, 1, 2, 3, 4] and not got.bad


def test_retention_removes_whole_old_segments_and_says_which_offsets_are_gone(tmp_path):
    size = RECORD
    log = StreamLog(
        tmp_path / "log", segment_bytes=HEADER.size + 5 * size, retain_bytes=3 * (HEADER.size + 5 * size)
    )
    for start in range(0, 50, 5):
        log.append(clicks(5, start))
    assert log.start_offset() == 35 and log.end_offset() == 50 and len(log.segments()) == 3
    with pytest.raises(StreamError, match=r"offsets 0\.\.34 were retired by retention; it now starts at 35"):
        log.read(0, 5)
    assert log.read(35, 100).offsets.tolist() == list(range(35, 50))

    aged = StreamLog(tmp_path / "aged", segment_bytes=HEADER.size + 5 * size, retain_seconds=3600)
    aged.append(clicks(5), timestamp=0.0)  # appended long ago (the records' own time)
    aged.append(clicks(5, 5), timestamp=1.0)
    aged.append(clicks(5, 10))  # now: the older, full segments go
    assert aged.start_offset() == 10 and aged.read(10, 5).offsets.tolist() == list(range(10, 15))
    aged.configure(segment_bytes=HEADER.size + 5 * size, retain_seconds=None)  # lift the limit
    assert StreamLog(tmp_path / "aged").settings["retain_seconds"] is None
    with pytest.raises(StreamError, match="retain_bytes must be a number > 0 or None"):
        StreamLog(tmp_path / "x", retain_bytes=-1)
    with pytest.raises(StreamError, match="segment_bytes must be an integer above 16"):
        StreamLog(tmp_path / "y", segment_bytes=8)


def test_consumer_groups_keep_their_offsets(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(clicks(10))
    assert log.committed("trainers") == 0 and log.groups() == {}
    log.commit("trainers", 6)
    log.commit("audit", 10)
    assert StreamLog(tmp_path / "log").committed("trainers") == 6
    assert log.groups() == {"audit": 10, "trainers": 6}
    with pytest.raises(StreamError, match="cannot commit offset 11"):
        log.commit("trainers", 11)
    with pytest.raises(StreamError, match=r"consumer group '\.\./x'"):
        log.commit("../x", 1)
    (tmp_path / "log" / "groups" / "not a group.json").write_text("{}")  # a stray file: not a group
    assert log.groups() == {"audit": 10, "trainers": 6}
    (tmp_path / "log" / "groups" / "trainers.json").write_text("{broken")
    with pytest.raises(StreamError, match="cannot read consumer group 'trainers'"):
        log.committed("trainers")


def test_a_damaged_manifest_or_a_foreign_segment_is_an_error_naming_the_file(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(clicks(2))
    _, segment = log.segments()[0]
    segment.write_bytes(b"NOTALOG!" + segment.read_bytes()[8:])
    with pytest.raises(StreamError, match=f"{segment} is not a version 1 fluidps stream segment"):
        log.read(0, 1)
    manifest = tmp_path / "log" / "stream.json"
    manifest.write_text(json.dumps({"format": "fluidps-stream", "version": 1, "fields": []}))
    with pytest.raises(StreamError, match="'fields' must be a non-empty list"):
        StreamLog(tmp_path / "log")
    (tmp_path / "file").write_text("")
    with pytest.raises(StreamError, match="is a file; a log is a directory"):
        StreamLog(tmp_path / "file")
    with pytest.raises(StreamError, match=r"expected log:DIR .* or redis://HOST:PORT/STREAM"):
        open_stream("kafka://somewhere")


def test_appenders_in_several_processes_get_dense_offsets_and_lose_nothing(tmp_path):
    path = tmp_path / "log"
    StreamLog(path, fields={"writer": np.int64(0), "n": np.int64(0)})
    script = textwrap.dedent(f"""
        import sys
        import numpy as np
        from fluidps.io import StreamLog
        log = StreamLog({str(path)!r}, sync=False)
        writer = int(sys.argv[1])
        for n in range(0, 200, 4):
            log.append({{"writer": np.full(4, writer), "n": np.arange(n, n + 4)}})
    """)
    writers = [subprocess.Popen([sys.executable, "-c", script, str(w)]) for w in range(3)]
    try:
        assert [w.wait(timeout=120) for w in writers] == [0, 0, 0]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
    log = StreamLog(path)
    got = log.read(0, 1000)
    assert log.end_offset() == 600 and got.offsets.tolist() == list(range(600)) and not got.bad
    for w in range(3):  # each writer's records, all of them, in its order
        assert got.fields["n"][got.fields["writer"] == w].tolist() == list(range(200))


def test_tail_yields_records_as_they_are_appended(tmp_path):
    log = StreamLog(tmp_path / "log")
    log.append(clicks(3))
    seen: list[int] = []
    appended = threading.Event()

    def append_later() -> None:
        appended.wait(timeout=30)
        StreamLog(tmp_path / "log").append(clicks(2, 3))

    writer = threading.Thread(target=append_later)
    writer.start()
    try:
        for records, _ in zip(log.tail(1, poll_s=0.01), range(4), strict=False):  # (at most 4 reads)
            seen += records.offsets.tolist()
            appended.set()
            if len(seen) == 4:
                break
    finally:
        appended.set()
        writer.join(timeout=30)
    assert seen == [1, 2, 3, 4] and os.path.isdir(tmp_path / "log")


def fluidps_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fluidps", *args], capture_output=True, text=True, timeout=120
    )


def test_the_stream_commands_append_tail_and_describe_a_log(tmp_path):
    np.savez(tmp_path / "clicks.npz", **clicks(12))
    log = str(tmp_path / "log")
    appended = fluidps_cli("stream", "append", log, str(tmp_path / "clicks.npz"), "--batch", "5",
                           "--segment-bytes", str(HEADER.size + 5 * RECORD))  # fmt: skip
    assert appended.returncode == 0, appended.stderr
    assert appended.stdout.strip() == f"appended 12 records to {log}: offsets 0..11"
    StreamLog(log).commit("trainers", 8)

    tail = fluidps_cli("stream", "tail", log, "--count", "3")  # the last three
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert [r["offset"] for r in lines] == [9, 10, 11] and lines[0]["ids"] == [9, 63]
    assert lines[0]["dense"] == [4.5] and lines[0]["label"] == 1 and lines[0]["time"] > 0
    middle = fluidps_cli("stream", "tail", log, "--from", "2", "--count", "2")
    assert [json.loads(line)["offset"] for line in middle.stdout.splitlines()] == [2, 3]

    info = fluidps_cli("stream", "info", log)
    assert info.returncode == 0, info.stderr
    assert (
        "ids int64[2], dense float32[1], label int64[]; offsets 0..11 (the next is 12) in 3 segment(s)"
        in (info.stdout)
    )
    assert "retention: none" in info.stdout and "group trainers: committed 8, lag 4" in info.stdout
    missing = fluidps_cli("stream", "info", str(tmp_path / "nothing"))
    assert missing.returncode == 2 and "is not a stream log" in missing.stderr


def test_reads_while_an_appender_rolls_segments_see_every_record_once(tmp_path):
    log = StreamLog(tmp_path / "log", segment_bytes=HEADER.size + 3 * RECORD, sync=False)
    done = threading.Event()
    failures: list[BaseException] = []

    def append_all() -> None:
        try:
            writer = StreamLog(tmp_path / "log", sync=False)
            for start in range(0, 300, 2):  # a new segment every other append
                writer.append(clicks(2, start))
        except BaseException as e:  # (reported below, in the test's thread)
            failures.append(e)
        finally:
            done.set()

    log.append(clicks(1, -1))  # offset 0 holds id -1: the fields exist before the reader starts
    appender = threading.Thread(target=append_all)
    appender.start()
    seen, offset = [], 0
    try:
        while not (done.is_set() and offset == log.end_offset()):
            records = log.read(offset, 7)
            assert not records.bad
            seen += records.fields["ids"][:, 0].tolist()
            offset = records.next_offset
    finally:
        appender.join(timeout=120)
    assert not failures and seen == list(range(-1, 300))


def test_the_compiled_crc_of_each_record_is_zlibs():
    import zlib

    from fluidps.io.crc import crc32_rows

    rows = np.random.default_rng(3).integers(0, 256, (40, 41), dtype=np.uint8)
    for length in (0, 1, 7, 8, 9, 16, 23, 37):
        want = [zlib.crc32(row[:length].tobytes()) for row in rows]
        assert crc32_rows(rows, length).tolist() == want, length


def test_windows_end_where_their_records_do(tmp_path):
    """advance and read_range: where a window of a count of records ends, and its records."""
    from fluidps.io.stream import read_range

    log = StreamLog(
        tmp_path / "log",
        segment_bytes=HEADER.size + 10 * RECORD,
        retain_bytes=3 * (HEADER.size + 10 * RECORD),
    )
    log.append(clicks(25))
    assert log.advance(3, 10, 25) == (13, 10) and log.advance(20, 10, 25) == (25, 5)
    assert log.advance(3, 10, 8) == (8, 5) and log.advance(25, 10, 25) == (25, 0)
    window = read_range(log, 8, 23)  # across two segments
    assert window.offsets.tolist() == list(range(8, 23)) and window.next_offset == 23
    log.append(clicks(20, 25))  # retention retires the first segments
    first = log.start_offset()
    assert first > 5 and log.advance(5, 10, 45) == (first + 10, 10)  # from the first one held
    assert read_range(log, first - 5, first + 5).offsets.tolist() == list(range(first, first + 5))
