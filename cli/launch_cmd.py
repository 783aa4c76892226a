"""`fluidps launch`: run a parameter-server job's pservers and trainers on this machine."""

from __future__ import annotations

import sys

import click

from fluidps.cli.common import fail
from fluidps.errors import Error
from fluidps.executor.launch.dataset_launcher import DatasetJob, DatasetLauncher
from fluidps.executor.launch.launcher import Launcher
from fluidps.executor.tasks.coordinator import DEFAULT_MAX_FAILURES, DEFAULT_TASK_TIMEOUT
from fluidps.transpiler.config import MODES


class _OneLineErrors(click.Command):
    """Usage errors as the one line every fluidps command prints, not click's usage block."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            fail(e.format_message())


# Everything after SCRIPT belongs to the script, options included: click stops
# looking for its own options at the first positional argument.
@click.command(cls=_OneLineErrors, context_settings={"allow_interspersed_args": False})
@click.option("--pservers", type=click.IntRange(min=1), help="How many pservers.")
@click.option("--trainers", type=click.IntRange(min=1), help="How many trainers.")
@click.option(
    "--stages",
    type=click.IntRange(min=1),
    help="Run a pipeline (a PipelineOptimizer program) instead: one process per stage; with --trainers N and "
    "--pservers S, N replicas of it, each stage's parameters on S pservers.",
)
@click.option("--mode", type=click.Choice(MODES), default="sync", show_default=True, help="FLUIDPS_MODE.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address the pservers listen on.")
@click.option(
    "--start-port",
    type=click.IntRange(1, 65535),
    help="Ports P, P+1, ... for the pservers (default: free ports picked at random).",
)
@click.option(
    "--log-dir",
    type=click.Path(file_okay=False),
    help="Also write each process's output to DIR/pserver.0.log, DIR/trainer.0.log, ...",
)
@click.option(
    "--grace",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="Seconds the pservers get to exit after the trainers finished, before they are stopped.",
)
@click.option(
    "--dataset",
    type=click.Path(file_okay=False),
    help="A dataset directory (fluidps data split) the trainers read through a coordinator; "
    "makes the job fault tolerant.",
)
@click.option(
    "--stream",
    metavar="SOURCE",
    help="A stream the trainers read through a coordinator, in windows (log:DIR or "
    "redis://HOST:PORT/STREAM; fluidps.layers.stream_reader): a fault-tolerant job that runs "
    "until SIGTERM drains it. The --dataset options below apply to it too.",
)
@click.option("--task-timeout", type=click.FloatRange(min=0.1), default=DEFAULT_TASK_TIMEOUT, show_default=True,
              help="With --dataset: seconds before an unrenewed task goes to another trainer.")  # fmt: skip
@click.option("--max-task-failures", type=click.IntRange(min=0), default=DEFAULT_MAX_FAILURES, show_default=True,
              help="With --dataset: failures a task may have before it is discarded.")  # fmt: skip
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="With --dataset: times each process is started again after dying, within --restart-window "
              "(failures caused by a peer restarting do not count).")  # fmt: skip
@click.option("--restart-window", type=click.FloatRange(min=0, min_open=True), default=300.0, show_default=True,
              help="With --dataset: the seconds over which --max-restarts counts.")  # fmt: skip
@click.option("--checkpoint-dir", type=click.Path(file_okay=False),
              help="With --dataset: where pservers checkpoint (default: LOG_DIR/checkpoints or a temporary one).")  # fmt: skip
@click.option("--checkpoint-every-steps", type=click.IntRange(min=0), default=0, show_default=True,
              help="With --dataset: pservers checkpoint every N steps (0: not by steps).")  # fmt: skip
@click.option("--checkpoint-every-seconds", type=click.FloatRange(min=0), default=10.0, show_default=True,
              help="With --dataset: pservers checkpoint every S seconds (0: not by time).")  # fmt: skip
@click.option("--progress/--no-progress", default=None,
              help="With --dataset: show a progress bar (default: when stderr is a terminal).")  # fmt: skip
@click.option("--bind-cores", is_flag=True,
              help="Bind each process to one core of those the launcher may use: the pservers', then the "
              "trainers' in turn, round-robin past the last. No process migrates, and its ZeroMQ I/O threads "
              "share its core and caches: a sync step's messages wait less on a host with a core per process.")  # fmt: skip
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=0, metavar="BASE",
              help="Each process serves its Prometheus metrics on port BASE + its index (the pservers, the "
              "trainers, then the coordinator: the log says which got which), on --host (0: none; the metrics "
              "extra).")  # fmt: skip
@click.argument("script", metavar="SCRIPT.py")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[ARGS]...")
def launch(
    pservers: int | None,
    trainers: int | None,
    stages: int | None,
    mode: str,
    host: str,
    start_port: int | None,
    log_dir: str | None,
    grace: float,
    dataset: str | None,
    stream: str | None,
    task_timeout: float,
    max_task_failures: int,
    max_restarts: int,
    restart_window: float,
    checkpoint_dir: str | None,
    checkpoint_every_steps: int,
    checkpoint_every_seconds: float,
    progress: bool | None,
    bind_cores: bool,
    metrics_port: int,
    script: str,
    script_args: tuple[str, ...],
) -> None:
    """Run SCRIPT.py as a job of N pservers and M trainers on this machine, or as a
    pipeline of P stage processes (--stages P).

    Each process gets Paddle's environment contract (TRAINING_ROLE, PADDLE_TRAINER_ID,
    PADDLE_TRAINERS_NUM, PADDLE_PSERVERS_IP_PORT_LIST, POD_IP, PADDLE_PORT) and
    FLUIDPS_MODE; read it with fluidps.role_from_env(). Output lines are prefixed with
    "[pserver.0] ", "[trainer.1] ", .... The first process to fail stops the job and
    its status is the launcher's; Ctrl-C stops the job with status 130.

    With --dataset, a coordinator hands the trainers the dataset's tasks
    (FLUIDPS_DATASET, FLUIDPS_COORDINATOR; fluidps.layers.dataset_reader reads
    them), pservers checkpoint, and a process that dies is started again: a
    pserver from its newest checkpoint, the coordinator from its snapshot, a trainer
    rejoining while its task goes to another. The job ends when every pass is done.

    With --stream, the coordinator hands out windows of the stream instead
    (FLUIDPS_STREAM), and the job runs until SIGTERM: the trainers finish the
    windows in hand, their readers end (EOFException), the script goes on past its
    loop (an export, a save) and exits; then the launcher exits 0.

    With --stages P, process k ("[stage.k] ") is pipeline stage k (FLUIDPS_STAGE,
    FLUIDPS_STAGE_ENDPOINTS): fluidps.transpile_for_role gives it its stage's programs,
    and it exchanges activations and gradients with the other stages directly. The job
    ends when every stage exited 0. With --trainers N --pservers S too, N replicas of the
    stages ("[stage.k.r] ") train side by side, each stage's parameters on S pservers of
    its own ("[pserver.k.j] "), synchronized as a sync job.
    """
    if stages is not None:
        if dataset is not None or stream is not None:
            fail("--stages runs a pipeline on fed batches: give no --dataset or --stream")
        if (pservers is None) != (trainers is None):
            fail("with --stages, give both --trainers (replicas) and --pservers (per stage), or neither")
        pservers, trainers = pservers or 0, trainers or 1
    elif pservers is None or trainers is None:
        fail("give --pservers and --trainers (a parameter-server job), or --stages (a pipeline)")
    try:
        common = (script, script_args, pservers, trainers, mode, host, start_port, log_dir, grace)
        if dataset is not None and stream is not None:
            fail("a job reads --dataset or --stream, not both")
        if dataset is None and stream is None:
            status = Launcher(
                *common, bind_cores=bind_cores, stages=stages or 0, metrics_port=metrics_port
            ).run()
        else:
            job = DatasetJob(
                dataset,
                stream=stream,
                task_timeout=task_timeout,
                max_task_failures=max_task_failures,
                max_restarts=max_restarts,
                restart_window=restart_window,
                checkpoint_dir=checkpoint_dir,
                checkpoint_every_steps=checkpoint_every_steps,
                checkpoint_every_seconds=checkpoint_every_seconds,
                progress=progress,
            )
            status = DatasetLauncher(job, *common, bind_cores=bind_cores, metrics_port=metrics_port).run()
    except Error as e:
        fail(str(e))
    sys.exit(status)
