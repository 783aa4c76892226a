"""ps: parameter-server training, the trainer's side and the pserver's.

Owns a trainer's client of its pservers (trainer_client.py: sends, pulls,
barriers, the async intervals; keepalive.py), the pserver loop listen_and_serv
runs (parameter_server.py: its op read once by serve_spec.py, its sub-blocks run by
optimize_blocks.py) with one strategy per mode (strategies.py: sync, async, SSP,
each given a StrategyContext, never the server), which trainers a pserver waits for
(membership.py; claims.py: a restarted trainer's claim on its id; trainer_watch.py:
when it stops waiting), what requests may read and write (pulls.py, set_check.py),
pserver checkpoints (checkpointer.py; sigterm.py), and the host of a process's loops
and gradient queues (host.py).
The runtime (fluidps.executor.runtime) hands these to the kernels; pserver blocks
are built through a callback, so nothing here imports the executor.

May import: fluidps.errors, fluidps.ir, fluidps.ops, fluidps.io.checkpoints, fluidps.executor.transport,
fluidps.executor.resources, fluidps.profiling
"""
