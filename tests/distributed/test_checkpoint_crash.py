"""A pserver killed (kill -9) while it writes a checkpoint leaves the previous one as the
newest intact checkpoint: a real writer process, killed at random moments."""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import fluidps
from fluidps.io.checkpoints import latest, scan

SHAPE = (2048, 4096)  # 32 MiB of float32: a save takes tens of milliseconds

WRITER = f"""
import sys
import numpy as np

import fluidps
from fluidps.io.checkpoints import CheckpointStore, scan

directory = sys.argv[1]
store = CheckpointStore(directory, 0, keep=3)
while True:
    n = max((c.count for c in scan(directory) if c.pserver_id == 0), default=0) + 1
    values = {{"w": np.full({SHAPE}, n, np.float32), "n": np.array(n, np.int64)}}
    c = store.save(values, {{}}, step=n, reason="periodic")
    print(c.count, flush=True)
"""


def _read_counts(proc: subprocess.Popen, deadline: float, at_least: int) -> list[int]:
    """Counts the writer printed, reading until there are `at_least` (bounded by `deadline`)."""
    fd = proc.stdout.fileno()
    buf = b""
    while buf.count(b"\n") < at_least:
        left = deadline - time.monotonic()
        assert left > 0, f"the writer printed {buf!r} before the deadline"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"the writer exited with {proc.wait(timeout=30)} after printing {buf!r}"
            buf += chunk
    return [int(x) for x in buf.split()]


def test_kill_during_writes_leaves_the_previous_checkpoint(tmp_path: Path):
    directory = tmp_path / "ckpt"
    rng = random.Random(20240611)
    last_chosen = 0
    strays: list[Path] = []  # temporary files the last kill left
    for _round in range(8):
        with open(tmp_path / "writer.err", "wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", WRITER, str(directory)], stdout=subprocess.PIPE, stderr=err
            )
        try:
            printed = _read_counts(proc, time.monotonic() + 60, at_least=1)
            assert printed[0] > last_chosen  # counts continue after a restart
            assert not [p for p in strays if p.exists()]  # its first save removed them
            time.sleep(rng.uniform(0, 0.15))
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=30) == -signal.SIGKILL
            printed += [int(x) for x in proc.stdout.read().split()]
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
            proc.stdout.close()

        newest, problems = latest(directory)
        assert list(newest) == [0], (tmp_path / "writer.err").read_text()
        chosen, values = newest[0]
        assert chosen.count >= max(printed)  # every completed save survives
        assert chosen.step == chosen.count == int(values["n"])
        assert values["w"].shape == SHAPE and values["w"].dtype == np.float32
        assert (values["w"] == chosen.count).all()

        mine = scan(directory)
        assert {c.pserver_id for c in mine} == {0}
        assert len(mine) <= 4  # keep=3, plus one a kill may have left before pruning
        for c in mine:
            try:
                loaded = c.load()
            except fluidps.CheckpointError:
                assert c.count < chosen.count
                assert any(c.path.name in p for p in problems), problems
                continue
            assert c.count <= chosen.count
            assert int(loaded["n"]) == c.count
            assert (loaded["w"] == c.count).all()
        last_chosen = chosen.count
        strays = list(directory.glob(".pserver-0-*.tmp"))
    assert last_chosen >= 8
