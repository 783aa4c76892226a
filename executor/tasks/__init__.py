"""tasks: datasets and streams as tasks, handed out and read.

Owns the coordinator's bookkeeping (leases.py: todo, pending, failures and discarded
items under leases; task_queue.py: a dataset's tasks, pass by pass; window_queue.py: a
stream's windows and its committed offset), the coordinator process around it (coordinator.py;
lease_times.py: how long its leases take, and stream_end.py: a stream's end, for the metrics),
which stream windows the pservers' checkpoints hold (checkpoint_watch.py, reading their
manifests), a trainer's connection to it (coordinator_client.py), a stream's windows fed from
its source (stream_windows.py), and the readers that turn tasks into mini-batches
(task_reader.py, stream_reader.py; with no coordinator they read from a queue in
their own process, and load no ZeroMQ).

May import: fluidps.errors, fluidps.ops.reader, fluidps.io.dataset, fluidps.io.atomic, fluidps.io.stream,
fluidps.io.checkpoints, fluidps.executor.transport, fluidps.executor.ps.applied_batches
"""
