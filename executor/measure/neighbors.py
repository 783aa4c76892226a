"""Busy neighbors: processes that run a program's steps in a loop while something else is
timed, as a pipeline's other stages run while a stage works.

Stages that share a host share its caches and memory bandwidth. A stage of small ops
next to one streaming wide products runs much slower than it does alone (measured on
the development host: a stage of six narrow layers, 30 ms a step alone, 48-55 ms next to
a process running the wide layers), while the wide products barely notice. An op
profile meant for such stages is taken next to neighbors (fluidps.executor.measure.op_profile),
so that the times it keeps are the times a stage sees.

    with busy_neighbors(main, startup, feed, micro_batches=8, count=1):
        ...  # timed next to one process running main's steps

A neighbor runs the program as a one-stage pipeline of `micro_batches` micro-batches of
`feed`, compiled, on a scope of its own; it says it is ready once its compiled segments
have settled (compiling is not the load a stage sees), and runs until it is stopped.
Each is stopped by its own process id when the block ends, however it ends, and ends by
itself when this process is gone.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fluidps.errors import Error
from fluidps.executor.executor import Executor
from fluidps.executor.launch.processes import stop_groups
from fluidps.executor.scope import Scope
from fluidps.ir.devices import PipelineConfig
from fluidps.ir.program import Program

READY = "ready"


def one_stage(program: Program, micro_batches: int) -> Program:
    """`program` as a one-stage pipeline of `micro_batches` micro-batches (a copy)."""
    staged = program.clone()
    staged.pipeline = PipelineConfig(micro_batches, "1F1B", 1)
    return staged


def whole_batch(feed: Mapping[str, Any], micro_batches: int) -> dict[str, np.ndarray]:
    """`micro_batches` copies of one micro-batch's `feed`, stacked: a step's batch."""
    return {name: np.concatenate([np.asarray(value)] * micro_batches) for name, value in feed.items()}


def warm(exe: Executor, staged: Program, batch: Mapping[str, Any], scope: Scope) -> None:
    """Run `staged` until its blocks are compiled and the compiled code has run: a few
    interpreted runs come first, and numba specializes at a first call."""
    compiled, settled = -1, 0
    for _ in range(50):
        exe.run(staged, feed=batch, scope=scope)
        now = exe.compiled_ops()
        settled, compiled = (settled + 1 if now == compiled else 0), now
        if settled >= 4:
            return


@contextlib.contextmanager
def busy_neighbors(
    program: Program,
    startup: Program,
    feed: Mapping[str, Any],
    micro_batches: int = 1,
    count: int = 1,
    ready_timeout_s: float = 600.0,
) -> Iterator[list[int]]:
    """`count` processes running `program`'s steps (see the module's doc) for the length of
    the block, which gets their process ids; threaded as this process's environment says."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise Error(f"busy_neighbors: count must be an int >= 0, got {count!r}")
    if count == 0:
        yield []
        return
    with tempfile.TemporaryDirectory(prefix="fluidps-neighbor-") as work:
        files = [Path(work) / name for name in ("main.pb", "startup.pb", "feed.npz")]
        files[0].write_bytes(program.serialize_to_string())
        files[1].write_bytes(startup.serialize_to_string())
        np.savez(files[2], **{name: np.asarray(value) for name, value in feed.items()})
        command = [
            sys.executable,
            "-m",
            "fluidps.executor.measure.neighbors",
            *map(str, files),
            str(micro_batches),
        ]
        started: list[tuple[subprocess.Popen[str], Path]] = []
        try:
            for i in range(count):
                log = Path(work) / f"neighbor{i}.err"  # (a file: a pipe nobody reads could fill and block it)
                with log.open("w") as err:  # (stdin: a pipe whose end tells it this process is gone)
                    process = subprocess.Popen(
                        command,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        process_group=0,  # (stopped as a group, as every process fluidps starts)
                    )
                started.append((process, log))
            deadline = time.monotonic() + ready_timeout_s
            for process, log in started:
                _wait_ready(process, log, deadline)
            yield [process.pid for process, _ in started]
        finally:
            _stop([process for process, _ in started])


def _wait_ready(process: subprocess.Popen[str], log: Path, deadline: float) -> None:
    assert process.stdout is not None
    readable, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0.0))
    if not readable:
        raise Error(
            f"a busy neighbor (pid {process.pid}) was not ready in time: its program had not run its "
            "warm-up steps; profile with no neighbors (neighbors=0), or on a less loaded machine"
        )
    line = process.stdout.readline()
    if line.strip() == READY:
        return
    if line:
        raise Error(
            f"a busy neighbor (pid {process.pid}) said {line.strip()[:200]!r} where it says {READY!r}"
        )
    with contextlib.suppress(subprocess.TimeoutExpired):  # (its output ended: it is ending)
        process.wait(timeout=30)
    raise Error(f"a busy neighbor (pid {process.pid}) failed to start: {log.read_text().strip()[-800:]}")


def _stop(processes: list[subprocess.Popen[str]]) -> None:
    """Stop every one by its own id (SIGTERM, then SIGKILL: stop_groups), its pipes closed."""
    for process in processes:
        for stream in (process.stdin, process.stdout):
            if stream is not None:
                stream.close()
    stop_groups(processes, term_timeout=10)


def _exit_with_parent() -> None:
    """End this process when its parent's end of stdin closes: a parent that dies without
    stopping it (killed, or timed out by its own parent) leaves no neighbor spinning."""
    sys.stdin.read()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """`python -m fluidps.executor.measure.neighbors MAIN.pb STARTUP.pb FEED.npz MICRO_BATCHES`: a
    busy neighbor; prints `ready` once warm, then runs steps until stopped."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 4:
        raise SystemExit(main.__doc__)
    program = Program.parse_from_string(Path(args[0]).read_bytes())
    startup = Program.parse_from_string(Path(args[1]).read_bytes())
    with np.load(args[2]) as data:  # (object arrays refused: numpy loads no pickles by default)
        feed = {name: data[name] for name in data.files}
    staged = one_stage(program, int(args[3]))
    batch = whole_batch(feed, int(args[3]))
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    exe, scope = Executor(), Scope()
    exe.run(startup, scope=scope)
    warm(exe, staged, batch, scope)
    print(READY, flush=True)
    while True:
        exe.run(staged, feed=batch, scope=scope)


if __name__ == "__main__":
    main()
