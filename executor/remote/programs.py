"""What a RemoteExecutor knows of the programs it deploys: what a training program reads
by itself (a dataset's tasks or a stream's windows, through the job's coordinator, held to
what JobDesc.stream says), whether it trains, which persistables it reads and writes, and
a trainer's startup without its readers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluidps.errors import BuilderError
from fluidps.ir.program import Program
from fluidps.ir.types import OpRole
from fluidps.transpiler.analysis import role, role_params

if TYPE_CHECKING:
    from fluidps.executor.remote.job import JobDesc

_READERS = ("create_dataset_reader", "create_stream_reader")


@dataclass(frozen=True)
class ProgramReads:
    """The data a training program reads through the job's coordinator (it is not fed)."""

    stream: str | None = None  # the stream whose windows it reads; None: a dataset's tasks
    follow: bool = False  # the stream is read without end (until RemoteExecutor.stop_streams)


def program_reads(job: JobDesc, main: Program, startup: Program) -> ProgramReads | None:
    """What `main` reads (None: the client feeds it), from the reader its `startup` creates.
    Raises BuilderError when it does not read what `job.stream` names: another stream, a
    dataset, or nothing (its data fed); or reads more than one coordinator can serve."""
    read = {n for op in main.global_block().ops if op.type == "read" for n in op.input("Reader")}
    made = [op for op in startup.global_block().ops if op.type in _READERS and set(op.output("Out")) & read]
    streams = sorted({op.attr("source") for op in made if op.type == "create_stream_reader"})
    datasets = sorted({op.attr("dataset") for op in made if op.type == "create_dataset_reader"})
    if job.stream is not None:
        binding = f"bind its data variables with layers.stream_reader({job.stream!r}, ...)"
        if datasets:
            raise BuilderError(
                f"JobDesc(stream={job.stream!r}) trains from a stream, but the training program reads "
                f"dataset {datasets[0]!r}: {binding}, or leave stream out of the JobDesc"
            )
        if not streams:
            raise BuilderError(
                f"JobDesc(stream={job.stream!r}) trains from a stream, but the training program reads "
                f"none (its batches would be fed): {binding}"
            )
        if streams != [job.stream]:
            raise BuilderError(
                f"JobDesc(stream={job.stream!r}), but the training program reads stream "
                f"{', '.join(s for s in streams if s != job.stream)}: a job's coordinator hands out "
                "the windows of its one stream"
            )
    if (streams and datasets) or len(streams) > 1:
        raise BuilderError(
            f"the training program reads {', '.join(streams + datasets)}: a job's coordinator hands out "
            "the tasks of one dataset or the windows of one stream"
        )
    if not read:
        return None
    if not streams:
        return ProgramReads()
    follow = any(op.attr("follow") for op in made if op.type == "create_stream_reader")
    return ProgramReads(stream=streams[0], follow=follow)


def without_readers(startup: Program) -> Program:
    """A trainer's startup program that only pulls the parameters (no reader made anew)."""
    out = startup.clone()
    block = out.global_block()
    block.ops = [op for op in block.ops if op.type not in _READERS]
    return out


def trains(program: Program) -> bool:
    """Whether a program updates parameters (has optimizer ops naming their parameter)."""
    return any(role(op) & OpRole.Optimize and role_params(op) for op in program.global_block().ops)


def persistables(program: Program) -> tuple[set[str], set[str]]:
    """Persistable variables a program reads before writing them, and those it writes."""
    reads, writes = set(), set()
    for block in program.blocks:
        for op in block.ops:
            for name in op.input_arg_names:
                var = block.find_var(name)
                if var is not None and var.persistable and name not in writes:
                    reads.add(name)
            for name in op.output_arg_names:
                var = block.find_var(name)
                if var is not None and var.persistable:
                    writes.add(name)
    return reads - {"feed", "fetch"}, writes - {"feed", "fetch"}
