"""metrics: a job process's Prometheus metrics (its coordinator's, its pservers', its
trainer's), served on a port of its own (job_metrics.py). Loaded only where metrics are
asked for: prometheus_client is the `metrics` extra.

May import: fluidps.errors, fluidps.ops.sparse_table, fluidps.executor.tasks.lease_times,
fluidps.executor.tasks.stream_end
"""
