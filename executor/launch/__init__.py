"""launch: the processes of a job on one machine.

Owns `fluidps launch` (launcher.py: N pservers and M trainers of one script, with
Paddle's environment contract; dataset_launcher.py: with a coordinator, restarts
and a progress bar, progress.py), and the process groups fluidps starts, stopped by
their own ids (processes.py, which also starts the `fluidps serve` processes of a
RemoteExecutor). The environment contract itself is fluidps.executor.env.

May import: fluidps.errors, fluidps.endpoints, fluidps.transpiler.config, fluidps.io.dataset,
fluidps.executor, fluidps.executor.transport, fluidps.executor.tasks.coordinator
"""
