"""remote: RemoteExecutor, Executor's API with the training running as a job.

Owns RemoteExecutor and JobDesc (remote_executor.py), the values of a job as a
scope (remote_scope.py), a fed batch split across trainers and their fetches combined
(batches.py), what a training program reads by itself through the job's coordinator
and whether it trains (programs.py), the executor servers a job runs on and the connections to
them (cluster.py), a pipeline program's stages as processes (pipeline_job.py), and
the executor server `fluidps serve` runs (executor_server.py): a local Executor
driven over the wire.

May import: fluidps.errors, fluidps.endpoints, fluidps.ir, fluidps.ops, fluidps.transpiler,
fluidps.executor, fluidps.executor.transport, fluidps.executor.pipeline, fluidps.executor.launch.processes,
fluidps.executor.launch.kubernetes, fluidps.executor.launch.kubernetes_client, fluidps.profiling,
fluidps.io.stream
"""
