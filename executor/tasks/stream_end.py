"""A stream's end offset, read off the coordinator's loop (by the metrics' scrape).

The coordinator's loop must not wait on a source out of reach (Redis retrying for a
minute) for anyone but its trainers, and its own source belongs to its thread. So a
reader of the end offset on another thread opens a source of its own, and takes turns
on it with the other scrapes.
"""

from __future__ import annotations

import threading

from fluidps.io.stream import StreamSource, open_stream


class StreamEnd:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # (scrapes come on threads of their own)
        self._spec: str | None = None
        self._source: StreamSource | None = None

    def read(self, spec: str) -> int:
        """The end offset of stream `spec` now (opened on first use, or when it changes)."""
        with self._lock:
            if self._source is None or self._spec != spec:
                if self._source is not None:
                    self._source.close()
                self._source, self._spec = open_stream(spec), spec
            return self._source.end_offset()
