"""How a launched process tells its launcher that it failed because of a peer.

A trainer whose pserver restarted (or went silent) fails its step through no fault of
its own program; `fluidps launch --dataset` restarts it, but must not spend the
restart budget meant for processes that crash by themselves. A process started with
FLUIDPS_PEER_EXIT_STATUS set (the launcher sets it; `role_from_env` reads it) exits
with that status when an uncaught error was caused by a peer, after Python printed the
traceback as usual.
"""

from __future__ import annotations

import os
import sys
from types import TracebackType

from fluidps.errors import PeerLostError, PeerRestartedError

ENV = "FLUIDPS_PEER_EXIT_STATUS"
PEER_FAILURE_STATUS = 75  # EX_TEMPFAIL: try again


def caused_by_peer(error: BaseException | None) -> bool:
    """Whether a peer restarting or going silent is anywhere in `error`'s chain."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (PeerRestartedError, PeerLostError)):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def install_hook(status: int) -> None:
    """Make this process exit with `status` when an uncaught error was caused by a peer.
    (Process-wide by nature: sys.excepthook; only a launched process asks for it.)"""
    previous = sys.excepthook
    if getattr(previous, "peer_exit_status", None) == status:
        return  # already installed

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        previous(kind, value, tb)
        if caused_by_peer(value):
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)

    hook.peer_exit_status = status  # type: ignore[attr-defined]
    sys.excepthook = hook
