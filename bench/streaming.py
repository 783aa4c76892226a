"""Streams: what the segment log costs against reading the same records from a dataset.

    python -m bench.streaming [--records 1000000] [--batch 4096] [--quick]

One row so far ("log"), measured in one run: CTR-like records (two int64 ids, 13 float32
features, an int64 label) appended to a fluidps.io.StreamLog in batches (fsync each, and
not), then read back in batches with every record's CRC checked, next to the same records
read from a Parquet dataset (fluidps.io.Dataset, with pyarrow) and from .npz shards in
tasks of the same size: records a second each way.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from fluidps.io import Dataset, StreamLog


def records(count: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "ids": rng.integers(0, 1 << 40, (count, 2), dtype=np.int64),
        "dense": rng.random((count, 13), dtype=np.float32),
        "label": rng.integers(0, 2, count, dtype=np.int64),
    }


def per_second(count: int, seconds: float) -> int:
    return round(count / seconds) if seconds > 0 else 0


def log_row(folder: Path, data: dict[str, np.ndarray], batch: int) -> dict:
    count = len(data["label"])
    row: dict = {"bench": "streaming", "row": "log", "records": count, "batch": batch}
    for sync in (True, False):
        log = StreamLog(folder / f"log-{sync}", sync=sync)
        start = time.perf_counter()
        for first in range(0, count, batch):
            log.append({name: a[first : first + batch] for name, a in data.items()})
        row[f"append_{'fsync' if sync else 'no_fsync'}_per_s"] = per_second(
            count, time.perf_counter() - start
        )
    start, offset, seen = time.perf_counter(), 0, 0
    while offset < count:
        got = log.read(offset, batch)
        assert not got.bad
        seen, offset = seen + len(got), got.next_offset
    row["read_per_s"] = per_second(seen, time.perf_counter() - start)
    row["bytes_per_record"] = round(log.total_bytes() / count, 1)
    for fmt in ("parquet", "npz"):
        dataset = Dataset.write(folder / fmt, data, records_per_shard=max(batch * 16, 1), format=fmt)
        start, seen = time.perf_counter(), 0
        for task in dataset.tasks(batch):
            seen += len(dataset.read_task(task)["label"])
        row[f"{fmt}_read_per_s"] = per_second(seen, time.perf_counter() - start)
    row["log_read_over_parquet"] = round(row["read_per_s"] / row["parquet_read_per_s"], 3)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--quick", action="store_true", help="20,000 records (a smoke run)")
    args = parser.parse_args(argv)
    count = 20_000 if args.quick else args.records
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(log_row(Path(folder), records(count), args.batch)))


if __name__ == "__main__":
    main()
