"""Which trainers a pserver waits for, and how far each has got.

Each trainer id is held by one process at a time, known by its incarnation
(the `sender` of its messages). A trainer is

- live: the sync barrier and the SSP bound wait for it;
- paused: it has no data for now (between a pass's last tasks): nobody waits
  for it until it sends again;
- done: it said COMPLETE;
- lost: silent for longer than the trainer timeout (dead, hung or cut off).

In an elastic job (one with a coordinator: trainers are disposable) a lost
trainer is evicted and a new incarnation of its id may join; anything its old
incarnation sends afterwards is refused. Otherwise a lost trainer fails the
job, naming it, and a second incarnation is refused.

Clocks count the steps each trainer has sent, kept here rather than taken from
the trainers, so that a trainer joining or resuming starts level with the
slowest live one instead of dragging every other trainer back to its step 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from fluidps.errors import TransportError

LIVE, PAUSED, DONE, LOST = "live", "paused", "done", "lost"


@dataclass
class Member:
    sender: int = 0  # 0: not heard from yet
    state: str = LIVE
    clock: int = 0
    # The trainer's own step of its last SEND; None after it rejoined or resumed, when
    # its next SEND counts as one step (its clock was set level with the slowest).
    last_step: int | None = 0
    evicted: set[int] = field(default_factory=set)  # incarnations refused from now on


class Membership:
    def __init__(self, trainers: int, elastic: bool, on_event: Callable[[str], None] | None = None):
        self.elastic = elastic
        self.members = {t: Member() for t in range(trainers)}
        self.events: list[str] = []  # joins, evictions and restarts
        self._on_event = on_event  # told each event as it happens (the pserver's log)

    def _note(self, event: str) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)

    def _rejoin(self, trainer: int, sender: int) -> None:
        """`sender` holds the trainer id from now on, level with the slowest live trainer."""
        member = self.members[trainer]
        member.sender, member.state, member.last_step = sender, LIVE, None
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

    def admit(self, trainer: int, sender: int) -> None:
        """Check a message from `trainer`'s incarnation `sender`; a new incarnation joins
        (elastic) or is refused. Raises TransportError for what must be refused."""
        member = self.members[trainer]
        if not sender or sender == member.sender:
            if member.state == LOST:
                raise TransportError(f"trainer {trainer} was declared lost; restart it to rejoin")
            return
        if sender in member.evicted:
            raise TransportError(
                f"trainer {trainer} (incarnation {sender:x}) was evicted after going silent; "
                "a restarted process may rejoin"
            )
        if member.sender == 0:  # the first message of this id, or the first since an eviction
            if member.state == LOST:
                self._note(f"trainer {trainer} rejoins (incarnation {sender:x})")
                self._rejoin(trainer, sender)
            member.sender = sender
            return
        if not self.elastic:
            raise TransportError(
                f"trainer {trainer} restarted (incarnation {member.sender:x} -> {sender:x}), but this job is "
                "not elastic: its earlier steps cannot be told apart from the new ones"
            )
        self._note(f"trainer {trainer} restarted (incarnation {member.sender:x} -> {sender:x}); it rejoins")
        member.evicted.add(member.sender)
        self._rejoin(trainer, sender)

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
            member.evicted.add(member.sender)
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
