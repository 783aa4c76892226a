"""What communication and reader kernels may ask of the runtime an executor gives them.

Kernels of `send`, `recv`, `distributed_lookup_table`, the barriers, `listen_and_serv`, `enqueue` / `dequeue`,
`create_dataset_reader`, `read` and a pipeline's `send_v2` / `recv_v2` take part in a job: they talk
to pservers, serve trainers, read dataset tasks or pass values between pipeline stages. They get that ability as a `KernelRuntime` when the
executor builds them (`KernelOp.runtime`), and may call nothing but what these
protocols list. fluidps's implementation is `fluidps.executor.runtime.Runtime`; ops
never import the executor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import numpy as np

    from fluidps.ir.operator import Operator
    from fluidps.ops.reader import ReaderSpec

# (pserver endpoint, the variable's name there, its value)
Push = tuple[str, str, Any]
# (pserver endpoint, the variable's name there)
Pull = tuple[str, str]
# (pserver endpoint, a distributed table's block there, int64 row indices in that block)
Prefetch = tuple[str, str, "np.ndarray"]


@dataclass(frozen=True)
class Communicate:
    """An async send op's gradients go through the trainer's communicator thread: queued
    (at most `queue_size` per variable), merged `merge` ("sum" or "mean") at most
    `max_merge` at a time, and sent without the step waiting."""

    merge: str
    max_merge: int
    queue_size: int


class TrainerChannel(Protocol):
    """A trainer's exchanges with its pservers."""

    def send(
        self,
        items: Sequence[Push],
        trainer_id: int,
        every: int = 1,
        bucket_bytes: int = 0,
        communicate: Communicate | None = None,
    ) -> None:
        """Push gradients, held per pserver until `bucket_bytes` are or until the step's next
        exchange with it (or handed to the communicator); with every=n, the mean of n
        calls' gradients every n-th call."""

    def get(
        self, items: Sequence[Pull], trainer_id: int, every: int = 1, background: bool = False
    ) -> list[Any]:
        """Pull values after this step; with every=m, only every m-th step. In the
        `background`, the values of the last pull finished (waiting only for the first)."""

    def prefetch(self, items: Sequence[Prefetch], trainer_id: int) -> list[np.ndarray]:
        """The rows asked for, one array per item, in one message per pserver (in sync
        mode once the step before is applied, as a pull); rows asked for ahead
        (prefetch_next) for exactly these items come without a message."""

    def prefetch_next(self, plan: Callable[[Mapping[str, Any]], Sequence[Prefetch] | None]) -> None:
        """Sync mode: when this step's barrier goes to the pservers, ask them for the rows
        `plan(next feed)` names (None: none), answered once this step is applied, for
        the next step's prefetch. Nothing is asked when the next step's feed is not known."""

    def send_barrier(self, endpoints: Sequence[str], trainer_id: int) -> None:
        """This step's gradients are all sent (sync mode); its next pull from each pserver
        is answered once the step is applied there."""

    def in_sync_job(self, endpoints: Sequence[str], trainer_id: int) -> None:
        """The program about to run sends barriers to `endpoints` (said when its kernels
        are built): with no data, this trainer keeps in step with the others, from its
        very first step on."""

    def fetch_barrier(self, endpoints: Sequence[str], trainer_id: int) -> None:
        """This step's parameters are all received."""

    def end_step(self) -> None:
        """The step's program is done: nothing of it may stay held."""


class GradientQueue(Protocol):
    """One gradient's queue on an async or SSP pserver."""

    def put(self, value: Any) -> None: ...

    def pop(self) -> Any: ...


class PserverHost(Protocol):
    """The pserver loops a process serves."""

    def serve(self, op: Operator, env: dict[str, Any]) -> None:
        """Run `op` (a listen_and_serv) until every trainer is done."""

    def queue(self, name: str) -> GradientQueue: ...


class BatchReader(Protocol):
    """A reader of dataset tasks, bound to a READER variable."""

    spec: ReaderSpec

    def next_batch(self) -> dict[str, np.ndarray]:
        """The next mini-batch, field by field; EOFException once every pass is done."""

    def observe(self, fetched: list[Any]) -> None:
        """The step that used the last batch ran and fetched these values (its loss)."""

    def fail_current(self, reason: str) -> None:
        """The step that used the last batch failed: its task goes back."""


class ReaderHost(Protocol):
    """The dataset readers of a process's programs."""

    def open(self, name: str, spec: ReaderSpec) -> BatchReader:
        """A new reader for the READER variable `name`, closing the one it replaces."""


class StageChannel(Protocol):
    """A pipeline stage's exchanges with the other stages (send_v2 / recv_v2): values of
    the micro-batch the stage is running now."""

    def send(self, peer: int, name: str, value: Any) -> None:
        """Hand `value` of variable `name` to stage `peer`."""

    def recv(self, peer: int, name: str) -> Any:
        """The value of `name` stage `peer` sent (waiting for it, within the peer timeout)."""


class KernelRuntime(Protocol):
    """A process's part in a job, as kernels see it."""

    @property
    def stages(self) -> StageChannel: ...

    @property
    def trainer(self) -> TrainerChannel: ...

    @property
    def pserver(self) -> PserverHost: ...

    @property
    def readers(self) -> ReaderHost: ...
