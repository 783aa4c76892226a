"""launch: the processes of a job, on one machine or on a Kubernetes cluster.

Owns `fluidps launch` (launcher.py: N pservers and M trainers of one script, with
Paddle's environment contract; dataset_launcher.py: with a coordinator of a dataset's
tasks or a stream's windows, restarts and a progress bar, progress.py), and the process groups fluidps starts, stopped by
their own ids (processes.py, which also starts the `fluidps serve` processes of a
RemoteExecutor). The environment contract itself is fluidps.executor.env.
A job on Kubernetes: its objects rendered (kubernetes.py: Indexed Jobs, headless
Services, the contract in a ConfigMap, the keys in a Secret) and driven on a cluster
through the official client (kubernetes_client.py, the k8s extra).

May import: fluidps.errors, fluidps.endpoints, fluidps.transpiler.config, fluidps.io.dataset,
fluidps.io.stream, fluidps.executor, fluidps.executor.transport, fluidps.executor.tasks.coordinator
"""
