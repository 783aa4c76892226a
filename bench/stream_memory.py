"""bench.streaming's "memory" row: a pserver process over an endless, drifting id stream
(described in bench/streaming.py's docstring)."""

from __future__ import annotations

import time

import numpy as np

import fluidps
from bench.stream_workload import DIM, FIELDS, MIB
from fluidps import layers, optimizer

# -- "memory" -----------------------------------------------------------------------------------


def drifting_ids(step: int, batch: int, drift: int, seed: int = 11) -> np.ndarray:
    """One step's ids, [batch, FIELDS, 1]: per field, Zipf ranks counted back from a head
    that moves `drift` values a step (a value is hot when it appears, then cools off and
    is not seen again), mixed into 62-bit ids."""
    rng = np.random.default_rng((seed, step))
    ranks = np.minimum(rng.zipf(1.2, size=(batch, FIELDS)), 1 << 20) - 1
    values = (step * drift - ranks).astype(np.uint64) * np.uint64(FIELDS) + np.arange(FIELDS, dtype=np.uint64)
    x = values * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return (x >> np.uint64(2)).astype(np.int64).reshape(batch, FIELDS, 1)


def hashed_ctr_program(ttl_steps: int, shrink_every: int):
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        ids = layers.data("ids", [FIELDS, 1], dtype="int64")
        click = layers.data("click", [1], dtype="int64")
        emb = layers.sparse_embedding(
            ids, [-1, DIM], min_count=2, ttl_steps=ttl_steps, shrink_every=shrink_every
        )
        h = layers.fc(layers.reshape(emb, [-1, FIELDS * DIM]), 16, act="relu")
        prob = layers.softmax(layers.fc(h, 2))
        loss = layers.mean(layers.cross_entropy(prob, click))
        optimizer.Adam(0.01, lazy_mode=True).minimize(loss)
    return main, startup, loss


def memory_row(
    events: int, batch: int, ttl_steps: int, shrink_every: int, drift: int, samples: int = 20
) -> dict:
    from fluidps.executor.ps.gradients import ROWS_LIMIT

    main, startup, loss = hashed_ctr_program(ttl_steps, shrink_every)
    steps = max(1, events // batch)
    warm_steps = max(steps // 5, 2 * (ttl_steps + shrink_every))
    every = max(1, steps // samples)
    rng = np.random.default_rng(12)
    timeline: list[dict] = []

    def feeds(first: int, last: int):
        for step in range(first, last):
            ids = drifting_ids(step, batch, drift)
            click = (rng.random((batch, 1)) < 0.2).astype(np.int64)
            yield {"ids": ids, "click": click}

    began = time.perf_counter()
    with fluidps.RemoteExecutor(fluidps.JobDesc(pservers=1, trainers=1)) as exe:
        exe.run(startup)
        setup_s = time.perf_counter() - began
        done, training_s = 0, 0.0
        while done < steps:
            upto = min(steps, done + every)
            start = time.perf_counter()
            for _ in exe.run_batches(main, feeds(done, upto), [loss]):
                pass
            training_s += time.perf_counter() - start
            done = upto
            (stats,) = exe.pserver_stats().values()
            (table,) = stats["hashed_tables"].values()
            # The row ids the pserver keeps of each sparse gradient for its stats (up to
            # ROWS_LIMIT each: fluidps.executor.ps.gradients.RowLog), 8 bytes an id.
            row_log = sum(min(n, ROWS_LIMIT) for n in stats["received_row_counts"].values()) * 8
            timeline.append(
                {
                    "events": done * batch,
                    "rows": table["rows"],
                    "created": table["created"],
                    "evicted": table["evicted"],
                    "pending_ids": table["pending_ids"],
                    "table_mib": round(table["bytes"] / MIB, 2),
                    "row_log_mib": round(row_log / MIB, 2),
                    "rss_mib": round(stats["rss_bytes"] / MIB, 1),
                }
            )
    after = [t for t in timeline if t["events"] >= warm_steps * batch] or timeline[-1:]
    warm, end = after[0], timeline[-1]
    peak = max(after, key=lambda t: t["rss_mib"])
    less_log = max(t["rss_mib"] - t["row_log_mib"] for t in after)
    return {
        "bench": "streaming",
        "row": "memory",
        "pserver": "a fluidps serve process (RemoteExecutor: 1 trainer x 1 pserver, sync)",
        "events": steps * batch,
        "batch": batch,
        "table": {"dim": DIM, "min_count": 2, "ttl_steps": ttl_steps, "shrink_every": shrink_every},
        "drift_per_step": drift,
        "warmup_events": warm_steps * batch,
        "rss_warm_mib": warm["rss_mib"],
        "rss_end_mib": end["rss_mib"],
        "rss_max_mib": peak["rss_mib"],
        "rss_growth_after_warmup": round((peak["rss_mib"] - warm["rss_mib"]) / warm["rss_mib"], 4),
        "row_log_growth_mib": round(end["row_log_mib"] - warm["row_log_mib"], 2),
        "rss_growth_less_row_log": round(
            (less_log - (warm["rss_mib"] - warm["row_log_mib"])) / warm["rss_mib"], 4
        ),
        "rows_warm": warm["rows"],
        "rows_end": end["rows"],
        "rows_max_after_warmup": max(t["rows"] for t in after),
        "rows_bound": (ttl_steps + shrink_every) * batch * FIELDS,
        "created": end["created"],
        "evicted": end["evicted"],
        "setup_s": round(setup_s, 2),
        "events_per_s": round(steps * batch / training_s),
        "timeline": timeline,
    }


# -- driver -------------------------------------------------------------------------------------
