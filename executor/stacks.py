"""Where a process waits, when asked: every thread's stack on SIGUSR1 (`kill -USR1 PID`),
written to stderr, which the launcher prefixes and logs. The way to see into a job that
hangs; `fluidps serve` processes always answer it, launched scripts when the launcher
set FLUIDPS_STACKS_ON_SIGUSR1 (it does), through role_from_env.
"""

from __future__ import annotations

import faulthandler
import signal
import sys

ENV = "FLUIDPS_STACKS_ON_SIGUSR1"


def dump_on_sigusr1() -> None:
    """From now on SIGUSR1 prints every thread's stack instead of ending the process."""
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
