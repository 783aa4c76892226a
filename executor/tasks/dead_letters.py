"""A dead-letter file: the stream records a reader could not train on, one JSON object a
line (JSON Lines), for a person or a repair job to look at.

Each line names the stream, the consumer group, the window the record was read in, its
offset and why it was refused, with its first RAW_KEPT bytes (base64) where the source
kept them. Each line is appended with one write (O_APPEND) and kept under LINE_MAX bytes
(the raw bytes are left out of a longer one), so that writes of several trainers
sharing a file do not interleave. A window read again (its trainer died) reports its
bad records again: the offsets tell the duplicates. A file that cannot be written is
said, and training goes on: the records are counted either way.
"""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from fluidps.io.stream import BadRecord

RAW_KEPT = 2048  # bytes of a bad record's raw form kept
REASON_CHARS = 500
LINE_MAX = 4096  # PIPE_BUF: an O_APPEND write this size is not interleaved with another's


class DeadLetters:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.written = 0
        self.failed = 0  # bad records that could not be written

    def write(self, source: str, group: str, window: tuple[int, int], bad: Sequence[BadRecord]) -> str | None:
        """Append a line per bad record of `window` ([start, stop) of offsets); what went
        wrong, if the file could not be written."""
        lines = []
        for record in bad:
            line = {
                "time": round(time.time(), 3),
                "stream": source,
                "group": group,
                "window": list(window),
                "offset": record.offset,
                "reason": record.reason[:REASON_CHARS],
            }
            data = (json.dumps(line) + "\n").encode()
            if record.raw:
                raw = {"raw": base64.b64encode(record.raw[:RAW_KEPT]).decode(), "raw_bytes": len(record.raw)}
                with_raw = (json.dumps(line | raw) + "\n").encode()
                data = with_raw if len(with_raw) <= LINE_MAX else data
            lines.append(data)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                for data in lines:
                    if os.write(fd, data) != len(data):
                        raise OSError(f"a short write of a {len(data)}-byte line")
            finally:
                os.close(fd)
        except OSError as e:
            self.failed += len(lines)
            return f"could not append to the dead-letter file {self.path}: {e}"
        self.written += len(lines)
        return None
