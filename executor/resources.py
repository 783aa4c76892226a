"""What this process holds: its resident memory, for the stats pservers and trainers report."""

from __future__ import annotations

import os


def resident_bytes() -> int:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
