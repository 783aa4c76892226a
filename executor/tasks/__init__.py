"""tasks: datasets as tasks, handed out and read.

Owns the coordinator's bookkeeping (task_queue.py: todo, pending, done and
discarded, pass by pass), the coordinator process around it (coordinator.py),
a trainer's connection to it (coordinator_client.py), and the readers that turn
tasks into mini-batches (task_reader.py; with no coordinator they read from a
queue in their own process, and load no ZeroMQ).

May import: fluidps.errors, fluidps.ops.reader, fluidps.io.dataset, fluidps.io.atomic,
fluidps.executor.transport
"""
