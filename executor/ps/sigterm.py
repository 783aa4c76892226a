"""SIGTERM to a pserver that checkpoints: save first, then die of it.

A launcher, a shell or Kubernetes stops a pserver process with SIGTERM. One that
checkpoints catches it (in the process's main thread only: Python runs signal
handlers there), lets its loop end with a last checkpoint, puts the previous handler
back and sends itself SIGTERM again, so that it still dies of the signal, as whoever
sent it expects.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def saved_before_dying(checkpoints: bool, on_sigterm: Callable[[], None]) -> Iterator[None]:
    """Within the block, SIGTERM calls `on_sigterm` (which asks the loop to end) when the
    pserver `checkpoints` and this is the main thread; once the block has ended without
    an error, the process dies of the SIGTERM it got."""
    if not checkpoints or threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = False

    def handler(signum: int, frame: object) -> None:
        nonlocal caught
        caught = True
        on_sigterm()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous in (None, signal.SIG_IGN) else previous)
    if caught:
        os.kill(os.getpid(), signal.SIGTERM)  # now that it is saved
