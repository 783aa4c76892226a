"""A job process's Prometheus metrics: its coordinator's, its pservers', its trainer's.

`JobMetrics` is one process's registry of its own (prometheus_client's, never the
global one) served at http://HOST:PORT/metrics by prometheus_client's HTTP server, on
threads of its own. Each role adds a source of what it reports:

- a coordinator (`CoordinatorMetrics`): its stream's records applied, committed and end
  offsets, the consumer lag between them, its windows by state, how long windows take
  (lease to done), the leases that failed, the trainers it hears from; or, reading a
  dataset, its tasks by state and the samples trained on;
- a process's pserver loops (`PserverMetrics`): steps, gradients applied, a stream's
  gradients dropped as applied before, trainers alive, checkpoints written, requests
  refused, and each hashed table's rows, creations, evictions and bytes;
- a trainer (`TrainerMetrics`): its steps.

A coordinator's and a pserver's state belongs to its loop's thread, which changes it
without locks; a scrape comes on the HTTP server's thread. So the loop takes its own
numbers, every PUBLISH_S seconds (the loops call `tick` between requests), and a scrape
reads only the numbers last published, which nothing changes afterwards. (A trainer's
step count is one integer attribute: read as it is.) The metric families are made from
those numbers at scrape time. The stream's end offset is read by the scrape itself, from
a source of its own (fluidps.executor.tasks.stream_end): a source out of reach then
holds up a scrape, never the coordinator's loop. METRICS lists every metric with its
help; the streaming guide's table is the same list.

prometheus_client is the `metrics` extra: without it, asking for metrics is an error
that says how to install it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from fluidps.errors import BuilderError, Error
from fluidps.executor.tasks.lease_times import LeaseTimesSnapshot
from fluidps.executor.tasks.stream_end import StreamEnd
from fluidps.ops.sparse_table import SparseTable

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

    from fluidps.executor.ps.parameter_server import ParameterServer
    from fluidps.executor.ps.trainer_client import TrainerClient
    from fluidps.executor.tasks.coordinator import Coordinator

PUBLISH_S = 0.5  # how often a loop publishes its numbers: a scrape sees them this late at most
GAUGE, COUNTER = "gauge", "counter"

# Every metric: name -> (kind, help). A counter's name ends in _total, as it is exposed.
METRICS: dict[str, tuple[str, str]] = {
    # a coordinator
    "fluidps_coordinator_trainers_alive": (
        GAUGE,
        "Trainer processes heard from within their lease allowance.",
    ),
    "fluidps_coordinator_lease_failures_total": (
        COUNTER,
        "Leases on a window or task that failed: reported failed, timed out, or their trainer restarted.",
    ),
    # a streaming job's coordinator, once a reader asked for a window
    "fluidps_stream_info": (
        GAUGE,
        "The stream read (its spec), by which consumer group, following it or not.",
    ),
    "fluidps_stream_records_trained_total": (
        COUNTER,
        "Records trained on, of windows done (a window handed out again counts again); rate() gives events per second.",
    ),
    "fluidps_stream_committed_offset": (
        GAUGE,
        "The group's committed offset: every record before it is applied.",
    ),
    "fluidps_stream_end_offset": (GAUGE, "The offset the stream's next record will have."),
    "fluidps_stream_consumer_lag": (
        GAUGE,
        "End offset minus committed offset: records not yet applied (in records for a log: stream, whose "
        "offsets are dense; Redis offsets are entry ids, ms << 20 | seq).",
    ),
    "fluidps_stream_windows": (
        GAUGE,
        "Windows cut and not yet below the committed offset, by state: todo, pending (leased), done_waiting "
        "(done, waiting for an earlier window), awaiting_checkpoints (done, not yet in every pserver's "
        "checkpoint), discarded_waiting.",
    ),
    "fluidps_stream_windows_discarded_total": (
        COUNTER,
        "Windows discarded after too many failures: their records are not trained on.",
    ),
    "fluidps_stream_windows_replayed_total": (
        COUNTER,
        "Windows handed out again because a pserver came back from a checkpoint without them.",
    ),
    "fluidps_stream_window_seconds": (
        "histogram",
        "Seconds from a window's lease to its trainer's report that its gradients are applied.",
    ),
    "fluidps_stream_draining": (GAUGE, "1 while the job drains (SIGTERM): no new windows are cut."),
    # a dataset job's coordinator, once a reader asked for a task
    "fluidps_dataset_pass": (GAUGE, "The pass over the dataset being read, from 0."),
    "fluidps_dataset_tasks": (GAUGE, "Tasks of the current pass, by state: todo, pending (leased), done."),
    "fluidps_dataset_samples_total": (COUNTER, "Samples of the tasks done, every pass."),
    # a pserver loop, by pserver id
    "fluidps_pserver_steps_total": (
        COUNTER,
        "Steps the pserver counted (sync: rounds with gradients; async and SSP: the furthest trainer's clock).",
    ),
    "fluidps_pserver_gradients_applied_total": (
        COUNTER,
        "Gradients whose optimize block ran (sync: once a step each, merged across trainers).",
    ),
    "fluidps_pserver_stream_gradients_dropped_total": (
        COUNTER,
        "Gradients of a stream batch applied before (its window went to another trainer), dropped.",
    ),
    "fluidps_pserver_trainers_alive": (GAUGE, "Trainers the pserver counts as live."),
    "fluidps_pserver_waiting_requests": (GAUGE, "Requests waiting for a step (GETs, unapplied async SENDs)."),
    "fluidps_pserver_checkpoints_written_total": (COUNTER, "Checkpoints this pserver wrote."),
    "fluidps_pserver_requests_rejected_total": (COUNTER, "Messages refused (unproven, malformed, stale)."),
    # a hashed table, by pserver id and table
    "fluidps_table_rows": (GAUGE, "Rows the hashed table holds."),
    "fluidps_table_rows_created_total": (COUNTER, "Rows admitted into the table."),
    "fluidps_table_rows_evicted_total": (COUNTER, "Rows evicted (TTL, decayed score)."),
    "fluidps_table_updates_dropped_total": (COUNTER, "Updates of ids not admitted (yet), dropped."),
    "fluidps_table_bytes": (GAUGE, "Bytes of the table's rows and their state."),
    # a trainer
    "fluidps_trainer_steps_total": (COUNTER, "Steps this trainer ran against its pservers."),
}

# A pserver's numbers (pserver_numbers' keys) and a hashed table's (SparseTable.stats' keys), by metric.
PSERVER_NUMBERS = {
    "steps": "fluidps_pserver_steps_total",
    "gradients_applied": "fluidps_pserver_gradients_applied_total",
    "stream_gradients_dropped": "fluidps_pserver_stream_gradients_dropped_total",
    "trainers_alive": "fluidps_pserver_trainers_alive",
    "waiting_requests": "fluidps_pserver_waiting_requests",
    "checkpoints": "fluidps_pserver_checkpoints_written_total",
    "rejected": "fluidps_pserver_requests_rejected_total",
}
TABLE_NUMBERS = {
    "rows": "fluidps_table_rows",
    "created": "fluidps_table_rows_created_total",
    "evicted": "fluidps_table_rows_evicted_total",
    "dropped_updates": "fluidps_table_updates_dropped_total",
    "bytes": "fluidps_table_bytes",
}
STREAM_NUMBERS = {
    "records": "fluidps_stream_records_trained_total",
    "committed": "fluidps_stream_committed_offset",
    "discarded": "fluidps_stream_windows_discarded_total",
    "replayed": "fluidps_stream_windows_replayed_total",
    "draining": "fluidps_stream_draining",
}


def _prometheus() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
        import prometheus_client.utils
    except ImportError:
        raise BuilderError(
            "metrics (--metrics-port, FLUIDPS_METRICS_PORT) need prometheus_client: pip install 'fluidps[metrics]'"
        ) from None
    return prometheus_client


class JobMetrics:
    """One process's metrics, served at http://`host`:`port`/metrics once `start`ed (port
    0: a free one, see `port` after). A source is added by role (`watch`); a role's new
    source replaces its old one (an executor server's next job)."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.prom = _prometheus()
        self.host, self.port = host, port
        self._sources: dict[str, Any] = {}
        self._lock = threading.Lock()  # sources are added by the process's threads, read by scrapes
        self._server: Any = None
        self.registry = self.prom.CollectorRegistry()
        self.prom.ProcessCollector(registry=self.registry)  # CPU seconds, memory, open files
        self.registry.register(self)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def watch(self, role: str, source: Any) -> Any:
        """Report `source`'s metrics (an object with `collect()`) as `role`'s; returns it."""
        with self._lock:
            self._sources[role] = source
        return source

    def start(self) -> None:
        """Serve the metrics (once: later calls do nothing; the runtimes of a process's
        Executors may call it from their threads at once)."""
        with self._lock:
            if self._server is not None:
                return
            try:
                self._server, _ = self.prom.start_http_server(self.port, self.host, registry=self.registry)
            except OSError as e:
                raise BuilderError(
                    f"cannot serve metrics on {self.host}:{self.port}: {e} (is another process, or another "
                    "Executor of this one, serving its metrics there? each needs a port of its own)"
                ) from None
            self.port = self._server.server_port

    def close(self) -> None:
        """Stop serving (the HTTP server's threads end)."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def collect(self) -> Iterator[Metric]:
        """What a scrape reads (prometheus_client calls it; it is the registry's collector)."""
        with self._lock:
            sources = list(self._sources.values())
        for source in sources:
            yield from source.collect()


class _SaidOnce:
    """Prints a metrics problem once, and again only when it changes (a scrape may fail
    every few seconds for as long as a source is away)."""

    def __init__(self) -> None:
        self._last: str | None = None

    def __call__(self, problem: str) -> None:
        if problem != self._last:
            print(f"metrics: {problem}", flush=True)
        self._last = problem


class _Published:
    """Numbers a loop takes of itself on its own thread, at most every `every` seconds."""

    def __init__(self, take: Callable[[], dict[str, Any]], every: float, clock: Callable[[], float]):
        self._take, self._every, self._clock = take, every, clock
        self._due = 0.0
        self._said = _SaidOnce()
        self.latest: dict[str, Any] | None = None  # replaced whole, never changed: a scrape reads it

    def tick(self) -> None:
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self._every
        try:
            self.latest = self._take()
        except Exception as e:  # (the metrics never stop the loop they watch: the last numbers stand)
            self._said(f"the numbers of now could not be taken: {type(e).__name__}: {e}")


class CoordinatorMetrics:
    """A coordinator's metrics. Its loop calls `tick` (Coordinator.ticks); the stream's
    end offset is read as the scrape comes, from a source of the scrape's own (StreamEnd)."""

    def __init__(
        self, coordinator: Coordinator, every: float = PUBLISH_S, clock: Callable[[], float] = time.monotonic
    ):
        self._numbers = _Published(lambda: coordinator_numbers(coordinator, clock()), every, clock)
        coordinator.ticks.append(self._numbers.tick)
        self._end = StreamEnd()
        self._said = _SaidOnce()

    def collect(self) -> Iterator[Metric]:
        numbers = self._numbers.latest
        if numbers is None:
            return
        yield _family("fluidps_coordinator_trainers_alive", [], [((), numbers["trainers_alive"])])
        leases: LeaseTimesSnapshot = numbers["leases"]
        yield _family("fluidps_coordinator_lease_failures_total", [], [((), leases.failed)])
        if "stream" in numbers:
            stream = numbers["stream"]
            try:
                end: int | None = self._end.read(stream["info"]["source"])
            except Error as e:  # (a source out of reach: the scrape goes on without its end)
                self._said(f"the end of {stream['info']['source']} could not be read: {e}")
                end = None
            yield from _stream_families(stream, end, leases)
        if "dataset" in numbers:
            dataset = numbers["dataset"]
            yield _family("fluidps_dataset_pass", [], [((), dataset["pass"])])
            states = [((state,), dataset[state]) for state in ("todo", "pending", "done")]
            yield _family("fluidps_dataset_tasks", ["state"], states)
            yield _family("fluidps_dataset_samples_total", [], [((), dataset["total_samples"])])


def coordinator_numbers(coordinator: Coordinator, now: float) -> dict[str, Any]:
    """What the coordinator's metrics show, taken on its loop's thread: its books only, no
    I/O (the stream's end is the scrape's to read)."""
    numbers: dict[str, Any] = {
        "trainers_alive": coordinator.trainers_heard(now),
        "leases": coordinator.lease_times.snapshot(),
    }
    if coordinator.windows is not None:
        s = coordinator.windows.queue.status()
        states = {
            "todo": s["todo"],
            "pending": s["pending"],
            "done_waiting": s["done_ahead"],
            "awaiting_checkpoints": s.get("awaiting_checkpoints", 0),
        }
        states["discarded_waiting"] = s["windows"] - sum(states.values())  # (the rest of the windows cut)
        follow = str(coordinator.windows.follow).lower()
        numbers["stream"] = {
            "info": {"source": s["source"], "group": s["group"], "follow": follow},
            "records": s["trained"],
            "committed": s["committed"],
            "windows": states,
            "discarded": s["discarded_windows"] + states["discarded_waiting"],
            "replayed": s.get("replayed", 0),
            "draining": int(s["stopping"]),
        }
    elif coordinator.queue is not None:
        status = coordinator.queue.status()
        numbers["dataset"] = {k: status[k] for k in ("pass", "todo", "pending", "done", "total_samples")}
    return numbers


def _stream_families(stream: dict[str, Any], end: int | None, leases: LeaseTimesSnapshot) -> Iterator[Metric]:
    prom = _prometheus()
    yield prom.core.InfoMetricFamily(
        "fluidps_stream", METRICS["fluidps_stream_info"][1], value=stream["info"]
    )
    for key, name in STREAM_NUMBERS.items():
        yield _family(name, [], [((), stream[key])])
    if end is not None:
        yield _family("fluidps_stream_end_offset", [], [((), end)])
        yield _family("fluidps_stream_consumer_lag", [], [((), max(end - stream["committed"], 0))])
    yield _family("fluidps_stream_windows", ["state"], [((s,), n) for s, n in stream["windows"].items()])
    buckets = [(prom.utils.floatToGoString(bound), n) for bound, n in leases.buckets]
    name = "fluidps_stream_window_seconds"
    yield prom.core.HistogramMetricFamily(name, METRICS[name][1], buckets=buckets, sum_value=leases.sum)


class PserverMetrics:
    """The metrics of a process's pserver loops, by pserver id. Each loop calls `tick`
    with itself (PserverHost.ticks)."""

    def __init__(self, every: float = PUBLISH_S, clock: Callable[[], float] = time.monotonic):
        self._every, self._clock = every, clock
        self._loops: dict[int, _Published] = {}  # pserver id -> its loop's numbers
        self._lock = threading.Lock()  # loops are added on their threads, read by scrapes

    def tick(self, ps: ParameterServer) -> None:
        with self._lock:
            published = self._loops.get(ps.spec.pserver_id)
            if published is None:  # (a loop's first tick)
                published = _Published(lambda: pserver_numbers(ps), self._every, self._clock)
                self._loops[ps.spec.pserver_id] = published
        published.tick()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            loops = sorted((str(pid), p.latest) for pid, p in self._loops.items() if p.latest is not None)
        for key, name in PSERVER_NUMBERS.items():
            yield _family(name, ["pserver"], [((pid,), numbers[key]) for pid, numbers in loops])
        tables = [
            ((pid, table), stats) for pid, numbers in loops for table, stats in numbers["tables"].items()
        ]
        for key, name in TABLE_NUMBERS.items():
            yield _family(name, ["pserver", "table"], [(labels, stats[key]) for labels, stats in tables])


def pserver_numbers(ps: ParameterServer) -> dict[str, Any]:
    """What a pserver's metrics show, taken on its loop's thread: cheap counters only
    (not pserver_stats' snapshot, which copies its logs)."""
    server = ps.server
    return {
        "steps": ps.strategy.steps,
        "gradients_applied": ps.strategy.gradients_applied,
        "stream_gradients_dropped": ps.applied_batches.dropped,
        "trainers_alive": len(ps.members.live),
        "waiting_requests": len(ps.deferred) + len(ps.unapplied),
        "checkpoints": len(ps.checkpoints.saved),
        "rejected": server.rejected if server is not None else 0,
        "tables": {n: v.stats() for n in sorted(ps.served) if isinstance(v := ps.env.get(n), SparseTable)},
    }


class TrainerMetrics:
    """A trainer's metrics: its step count, read as the scrape comes (one integer)."""

    def __init__(self, client: TrainerClient):
        self._client = client

    def collect(self) -> Iterator[Metric]:
        client = self._client
        yield _family("fluidps_trainer_steps_total", ["trainer"], [((str(client.trainer_id),), client.step)])


def _family(name: str, labels: list[str], values: list[tuple[tuple[str, ...], float]]) -> Metric:
    """The gauge or counter `name` (METRICS says which) with one sample per labels' values."""
    prom = _prometheus()
    kind, text = METRICS[name]
    family = (prom.core.CounterMetricFamily if kind == COUNTER else prom.core.GaugeMetricFamily)(
        name, text, labels=labels
    )
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family
