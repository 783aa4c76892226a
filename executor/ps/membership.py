"""Which trainers a pserver waits for, and how far each has got.

Each trainer id is held by one process at a time, known by its incarnation
(the `sender` of its messages). A trainer is

- live: the sync barrier and the SSP bound wait for it;
- paused: it has no data for now (an async or SSP trainer between a pass's last
  tasks, a reader at its end, an elastic trainer leaving): nobody waits for it
  until it sends again (a sync trainer waiting for a task does not pause: it
  keeps taking part in rounds, see fluidps.executor.ps.strategies);
- done: it said COMPLETE;
- lost: silent for longer than the trainer timeout (dead, hung or cut off).

In an elastic job (one with a coordinator: trainers are disposable) a lost
trainer is evicted and a new incarnation of its id may join; anything its old
incarnation sends afterwards is refused. Otherwise a lost trainer fails the
job, naming it, and a second incarnation is refused.

Without keys nothing on the wire is authenticated, so one stray or corrupted
message must not be able to change who holds a trainer id. Each connection
(ZeroMQ routing id) speaks for the one incarnation whose message it carried
first: a message on it that claims another trainer or incarnation is refused.
A new incarnation takes over a trainer id whose holder is still live only when
it names that holder (`replaces`: the launcher that restarted it knows it);
otherwise it waits (`Claim`) until the holder is evicted for its silence, and is
refused if the holder keeps proving alive: two processes claim one id. A
launcher also tells pservers each trainer's first incarnation (`expected`), so
that no message can claim a trainer id before its trainer speaks.

Clocks count the steps each trainer has sent, kept here rather than taken from
the trainers, so that a trainer joining or resuming starts level with the
slowest live one instead of dragging every other trainer back to its step 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fluidps.errors import TransportError

LIVE, PAUSED, DONE, LOST = "live", "paused", "done", "lost"


class Claim(Exception):
    """A new incarnation claims a trainer id that a live one holds, without naming it:
    its messages wait until the holder is evicted (or are refused after a while)."""

    def __init__(self, trainer: int, holder: int):
        super().__init__(f"trainer {trainer} is held by incarnation {holder:x}")
        self.trainer, self.holder = trainer, holder


@dataclass
class Member:
    sender: int = 0  # 0: none yet (not heard from, or evicted)
    heard: bool = False  # from `sender` (else it is the one a launcher said to expect)
    state: str = LIVE
    clock: int = 0
    # The trainer's own step of its last SEND; None after it rejoined or resumed, when
    # its next SEND counts as one step (its clock was set level with the slowest).
    last_step: int | None = 0
    evicted: set[int] = field(default_factory=set)  # incarnations refused from now on


class Membership:
    def __init__(
        self,
        trainers: int,
        elastic: bool,
        on_event: Callable[[str], None] | None = None,
        expected: Sequence[int] = (),
    ):
        if expected and len(expected) != trainers:
            raise TransportError(
                f"{len(expected)} trainer incarnations were given for {trainers} trainers "
                "(FLUIDPS_TRAINER_INCARNATIONS must list one per trainer)"
            )
        self.elastic = elastic
        self.members = {t: Member(sender=expected[t] if expected else 0) for t in range(trainers)}
        # connection (ZeroMQ routing id) -> the (trainer, incarnation) it speaks for
        self.connections: dict[bytes, tuple[int, int]] = {}
        self.events: list[str] = []  # joins, evictions and restarts
        self._on_event = on_event  # told each event as it happens (the pserver's log)

    def _note(self, event: str) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def _rejoin(self, trainer: int, sender: int) -> None:
        """`sender` holds the trainer id from now on, level with the slowest live trainer."""
        member = self.members[trainer]
        member.sender, member.state, member.last_step, member.heard = sender, LIVE, None, True
        member.clock = self._slowest_clock(exclude=trainer)

    # -- who --------------------------------------------------------------------------------

    @property
    def live(self) -> set[int]:
        return {t for t, m in self.members.items() if m.state == LIVE}

    @property
    def done(self) -> bool:
        """Every trainer said it is done: the only way a pserver's job ends by itself
        (an evicted trainer may still come back)."""
        return all(m.state == DONE for m in self.members.values())

    @property
    def lost(self) -> set[int]:
        return {t for t, m in self.members.items() if m.state == LOST}

    @property
    def active(self) -> set[int]:
        """Trainers that may still send now (live or paused)."""
        return {t for t, m in self.members.items() if m.state in (LIVE, PAUSED)}

    def admit(self, trainer: int, sender: int, connection: bytes = b"", replaces: int = 0) -> None:
        """Check a message from `trainer`'s incarnation `sender` on `connection`. Raises
        TransportError for what must be refused, Claim for a message that must wait."""
        if not sender:
            raise TransportError(f"a message as trainer {trainer} must carry its incarnation (sender)")
        bound = self.connections.get(connection)
        if bound is not None and bound != (trainer, sender):
            raise TransportError(
                f"a connection of trainer {bound[0]} (incarnation {bound[1]:x}) sent a message as trainer "
                f"{trainer} (incarnation {sender:x}): a connection speaks for one incarnation (a corrupted "
                "or forged header)"
            )
        member = self.members[trainer]
        if sender == member.sender:
            if member.state == LOST:
                raise TransportError(f"trainer {trainer} was declared lost; restart it to rejoin")
        elif sender in member.evicted:
            raise TransportError(
                f"trainer {trainer} (incarnation {sender:x}) was evicted after going silent or replaced; "
                "a restarted process may rejoin"
            )
        elif member.sender == 0:  # the first message of this id, or the first since an eviction
            if member.state == LOST:
                self._note(f"trainer {trainer} rejoins (incarnation {sender:x})")
                self._rejoin(trainer, sender)
            member.sender = sender
        elif self.elastic and replaces == member.sender:  # a restart its launcher vouched for
            self._note(
                f"trainer {trainer} restarted (incarnation {member.sender:x} -> {sender:x}); it rejoins"
            )
            self._retire(trainer)
            self._rejoin(trainer, sender)
        elif not member.heard:
            raise TransportError(
                f"trainer {trainer} of this job is incarnation {member.sender:x} (as the launcher or client "
                f"that started the job said), not {sender:x}: refused"
            )
        elif not self.elastic:
            raise TransportError(
                f"trainer {trainer} restarted (incarnation {member.sender:x} -> {sender:x}), but this job is "
                "not elastic: its earlier steps cannot be told apart from the new ones"
            )
        else:
            raise Claim(trainer, member.sender)
        self.connections[connection] = (trainer, sender)
        member.heard = True

    def _retire(self, trainer: int) -> None:
        """The trainer's incarnation is refused from now on, and its connections forgotten."""
        member = self.members[trainer]
        member.evicted.add(member.sender)
        self.connections = {c: ts for c, ts in self.connections.items() if ts != (trainer, member.sender)}

    def pause(self, trainer: int) -> None:
        if self.members[trainer].state == LIVE:
            self.members[trainer].state = PAUSED

    def resume(self, trainer: int) -> None:
        member = self.members[trainer]
        if member.state == PAUSED:
            member.state = LIVE
            member.clock = max(member.clock, self._slowest_clock(exclude=trainer))
            member.last_step = None

    def complete(self, trainer: int) -> None:
        self.members[trainer].state = DONE

    def lose(self, trainer: int, why: str) -> None:
        """Evict (elastic) or mark lost a trainer that went silent."""
        member = self.members[trainer]
        member.state = LOST
        if self.elastic and member.sender:
            self._retire(trainer)
            member.sender = 0  # a new incarnation may join
        self._note(f"trainer {trainer} {'evicted' if self.elastic else 'lost'}: {why}")

    # -- clocks ------------------------------------------------------------------------------

    def tick(self, trainer: int, step: int) -> bool:
        """Count a SEND of the trainer's step `step`; True when its clock moved."""
        member = self.members[trainer]
        if member.last_step is None:
            member.last_step = step - 1
        if step <= member.last_step:
            return False
        member.clock += step - member.last_step
        member.last_step = step
        return True

    def clock(self, trainer: int) -> int:
        return self.members[trainer].clock

    def slowest(self) -> int | None:
        clocks = [self.members[t].clock for t in self.live]
        return min(clocks) if clocks else None

    def _slowest_clock(self, exclude: int) -> int:
        clocks = [m.clock for t, m in self.members.items() if m.state == LIVE and t != exclude]
        return min(clocks) if clocks else self.members[exclude].clock
