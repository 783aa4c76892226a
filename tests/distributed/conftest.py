"""The distributed tier's load: tests marked `under_load` (and, with `pytest --under-load`,
every test here) run while two CPU-bound processes compete for this machine's cores, as
a real cluster's noisy neighbours and GC pauses do. Each stops by itself after
HOG_SECONDS and is stopped by its pid when the test ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import stop_group

HOGS = 2
HOG_SECONDS = 900  # longer than any test here may take: a bound, not a duration
HOG = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


@pytest.fixture(autouse=True)
def load(request):
    """Two CPU hogs for the test's duration, when it runs under load."""
    if not (request.node.get_closest_marker("under_load") or request.config.getoption("--under-load")):
        yield []
        return
    hogs = [
        subprocess.Popen([sys.executable, "-c", HOG.format(seconds=HOG_SECONDS)], process_group=0)
        for _ in range(HOGS)
    ]
    try:
        yield hogs
    finally:
        for hog in hogs:
            stop_group(hog)
