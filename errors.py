"""The error hierarchy. Every error fluidps raises on purpose is a `fluidps.Error`.

Each error also derives from the builtin a Python user would expect (a bad
program is a ValueError, misuse of the builder a RuntimeError), so code that
does not know fluidps can still catch them the usual way. EOFException and
NoDataYet are not mistakes but signals to training loops (no more data, no data
now), and derive from Error alone.

May import: nothing
"""

from __future__ import annotations


class Error(Exception):
    """Root of every error fluidps raises on purpose."""


class ProgramParseError(Error, ValueError):
    """Bytes that are not a valid ProgramDesc (truncated, wrong types, missing fields)."""


class ProgramError(Error, ValueError):
    """A program is used in a way its structure does not allow (unknown block, variable...)."""


class VerifyError(ProgramError):
    """`verify(program)` found problems; `.problems` lists every one of them."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        shown = "\n  ".join(self.problems[:20])
        more = len(self.problems) - 20
        tail = f"\n  ... and {more} more" if more > 0 else ""
        noun = "problem" if len(self.problems) == 1 else "problems"
        super().__init__(f"program has {len(self.problems)} {noun}:\n  {shown}{tail}")


class UnknownOpError(ProgramError):
    """An op type fluidps has no definition for."""


class UnsupportedError(ProgramError):
    """A program asks for something fluidps does not implement (an attribute value, a slot)."""


class ShapeError(ProgramError):
    """Shape or dtype inference found inputs an op cannot accept."""


class BuilderError(Error, RuntimeError):
    """The builder API was used outside its contract (no program_guard, bad argument)."""


class ExecutionError(Error, RuntimeError):
    """An op failed while running; the message names the block, op, and its variables."""


class FeedError(Error, ValueError):
    """A fed value does not match the variable it feeds (unknown name, dtype, shape)."""


class SerializationError(Error, ValueError):
    """Saved tensors or models that cannot be written or read back (truncated or corrupt
    files, unsupported dtypes, values that do not match the program's variables)."""


class WireError(Error, ValueError):
    """A received message is malformed: bad header, dtype, shape or byte count."""


class UnprovenMessageError(WireError):
    """A received message does not carry the job's proof (a tag of its header made with the
    job's secret): it comes from a process outside the job, or one given another secret."""


class TransportError(Error, RuntimeError):
    """A peer could not be reached, stopped answering, or answered with an error."""


class PeerLostError(TransportError):
    """A peer has not answered for longer than the peer timeout: it is down or unreachable."""


class PeerRestartedError(TransportError):
    """A peer restarted: the state it held for this client is gone (not a program error)."""


class RemoteError(TransportError):
    """The peer received the request and reported an error."""


class DatasetError(Error, ValueError):
    """A dataset that cannot be read: a missing or invalid manifest, a shard that does not
    match its fields or its checksum, records outside a shard."""


class StreamError(Error, ValueError):
    """A stream that cannot be read or appended to: records that do not match its fields,
    offsets retired or not yet written, a damaged segment or manifest."""


class CheckpointError(Error, ValueError):
    """A checkpoint that cannot be written or restored: corrupt (checksum mismatch),
    incomplete, or not matching the variables it should restore."""


class EOFException(Error):
    """A reader has no more data: every pass over its dataset is done. As in Fluid,
    training loops end by catching it."""


class NoDataYet(Error):
    """A reader driven step by step has no batch for this trainer now: the job's other
    trainers are finishing the pass. The step is skipped; the next one asks again."""
