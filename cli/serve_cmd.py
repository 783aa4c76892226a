"""`fluidps serve`: an executor server for a RemoteExecutor, one pserver, or a job's coordinator;
`fluidps keys gen`; `fluidps secret gen`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from types import FrameType

import click

from fluidps.cli.common import fail, load_program
from fluidps.errors import Error
from fluidps.executor import stacks
from fluidps.executor.env import DEFAULT_METRICS_HOST, runtime_config_from_env
from fluidps.executor.executor import Executor
from fluidps.executor.launch.processes import READY
from fluidps.executor.remote.executor_server import ExecutorServer
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.tasks.coordinator import DEFAULT_MAX_FAILURES, DEFAULT_TASK_TIMEOUT, Coordinator
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.security import Security, generate_keys


def _config(
    keys: str | None, secret_file: str | None, insecure: bool, peer_timeout: float | None
) -> RuntimeConfig:
    """The environment contract's configuration, with the command line's flags over it."""
    config = runtime_config_from_env()
    settings = config.rpc
    if keys:
        settings = settings.with_(security=Security.from_dir(keys))
    if secret_file:
        settings = settings.with_(secret=JobSecret.read(secret_file))
    if insecure:
        settings = settings.with_(insecure=True)
    if peer_timeout is not None:
        settings = settings.with_(peer_timeout=peer_timeout)
    return replace(config, rpc=settings)


@click.command()
@click.option(
    "--endpoint",
    default="tcp://127.0.0.1:0",
    show_default=True,
    help="Where to listen: host:port or a tcp:// / ipc:// address; port 0 picks a free one.",
)
@click.option("--name", default=None, help="How logs and errors name this server.")
@click.option(
    "--role",
    type=click.Choice(["executor", "pserver", "coordinator"]),
    default="executor",
    show_default=True,
    help="executor: serve a RemoteExecutor; pserver: run --program's listen_and_serv loop; "
    "coordinator: hand out dataset tasks to trainers.",
)
@click.option("--program", "program_file", metavar="MAIN.pb", help="--role pserver: its main program.")
@click.option("--startup", "startup_file", metavar="STARTUP.pb", help="--role pserver: its startup program.")
@click.option(
    "--keys", type=click.Path(file_okay=False), help="Key directory (fluidps keys gen) for CURVE encryption."
)
@click.option(
    "--secret-file",
    type=click.Path(dir_okay=False),
    help="The job's secret (fluidps secret gen): messages without its proof are refused. "
    "Default: FLUIDPS_JOB_SECRET_FILE.",
)
@click.option(
    "--insecure",
    is_flag=True,
    help="Serve without the job's secret, and non-loopback addresses without encryption: "
    "anyone who reaches the port is heard.",
)
@click.option(
    "--profile", is_flag=True, help="Record where this process's time goes (reported in its stats)."
)
@click.option(
    "--compile/--no-compile",
    "compile_",
    default=None,
    help="Run programs as numba-compiled segments (fluidps.Executor(compile=True)), or interpreted. "
    "Default: FLUIDPS_COMPILE.",
)
@click.option(
    "--peer-timeout", type=click.FloatRange(min=0.1), help="Seconds of silence that mean a peer is dead."
)
@click.option(
    "--snapshot",
    type=click.Path(dir_okay=False),
    help="--role coordinator: its state file; it resumes from it when it exists.",
)
@click.option(
    "--task-timeout",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_TASK_TIMEOUT,
    show_default=True,
    help="--role coordinator: seconds before an unrenewed task goes to another trainer.",
)
@click.option(
    "--max-task-failures",
    type=click.IntRange(min=0),
    default=DEFAULT_MAX_FAILURES,
    show_default=True,
    help="--role coordinator: failures a task may have before it is discarded.",
)
@click.option(
    "--stream",
    metavar="SOURCE",
    help="--role coordinator: a streaming job's coordinator, of this stream (SIGTERM drains the job).",
)
@click.option(
    "--drain", is_flag=True, help="--role coordinator, with --stream: start draining (its job is draining)."
)
@click.option(
    "--checkpoints",
    type=click.Path(file_okay=False),
    help="--role coordinator, with --stream: where the job's pservers checkpoint; a window's offsets are "
    "committed once their checkpoints hold it, and one a restored pserver lost goes out again.",
)
@click.option(
    "--pservers",
    type=click.IntRange(min=1),
    help="--role coordinator, with --checkpoints: how many pservers the job has.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve this process's Prometheus metrics at http://HOST:PORT/metrics (0: not served). "
    "Default: FLUIDPS_METRICS_PORT. Needs the metrics extra.",
)
@click.option(
    "--metrics-host",
    help=f"The address the metrics are served on. Default: FLUIDPS_METRICS_HOST, else {DEFAULT_METRICS_HOST}.",
)
@click.option(
    "--parent-pid",
    type=int,
    hidden=True,
    help="Stop serving when the process with this pid (the one that started this server) is gone.",
)
def serve(
    endpoint: str,
    name: str | None,
    role: str,
    program_file: str | None,
    startup_file: str | None,
    keys: str | None,
    secret_file: str | None,
    insecure: bool,
    peer_timeout: float | None,
    snapshot: str | None,
    task_timeout: float,
    max_task_failures: int,
    stream: str | None,
    drain: bool,
    checkpoints: str | None,
    pservers: int | None,
    metrics_port: int | None,
    metrics_host: str | None,
    parent_pid: int | None,
    profile: bool,
    compile_: bool | None,
) -> None:
    """Serve programs until told to stop (SIGTERM or a client's SHUTDOWN).

    As an executor server (the default), a RemoteExecutor sends it programs to
    run: a pserver's or a trainer's. With --role pserver it runs one pserver's
    startup and main programs, as written by `fluidps transpile`, until every
    trainer is done. With --role coordinator it hands out the tasks of the
    dataset the trainers read (`fluidps.layers.dataset_reader`), or the windows of
    their stream (`fluidps.layers.stream_reader`: SIGTERM drains it, a second one
    stops it), keeping its state in --snapshot. Each prints one line "NAME ready on ADDRESS" once it
    listens. With --metrics-port, each serves its Prometheus metrics (the coordinator's stream:
    records applied, consumer lag, windows; a pserver's steps and tables; see the streaming guide).
    """
    stacks.dump_on_sigusr1()  # kill -USR1 shows where it waits
    try:
        config = _config(keys, secret_file, insecure, peer_timeout)
        if profile:
            config = replace(config, profile=True)
        config = _with_metrics(config, metrics_port, metrics_host)
        if role == "pserver":
            _serve_pserver(program_file, startup_file, config, compile_)
            return
        if program_file or startup_file:
            fail("--program and --startup go with --role pserver")
        if role == "coordinator":
            if drain and stream is None:
                fail("--drain goes with --stream: a dataset's coordinator has nothing to drain")
            if checkpoints is not None and (stream is None or pservers is None):
                fail("--checkpoints goes with --stream and --pservers N (the pservers that write them)")
            server = Coordinator(
                endpoint,
                config.rpc,
                snapshot,
                task_timeout,
                max_task_failures,
                name or "coordinator",
                stream=stream,
                drain=drain,
                checkpoints=checkpoints,
                pservers=pservers or 0,
            )
        else:
            server = ExecutorServer(endpoint, config, name, compile_)
        if config.metrics is not None:
            if isinstance(server, Coordinator):
                from fluidps.executor.metrics.job_metrics import CoordinatorMetrics

                config.metrics.watch("coordinator", CoordinatorMetrics(server))
            config.metrics.start()
    except Error as e:
        fail(str(e))

    def stop(signum: int, frame: FrameType | None) -> None:
        if isinstance(server, Coordinator):
            server.sigterm()  # (a streaming job's drains first)
        else:
            server.stop()

    signal.signal(signal.SIGTERM, stop)
    if parent_pid is not None:
        _stop_when_orphaned(parent_pid, server.stop)
    if config.metrics is not None:
        click.echo(f"{server.name}: metrics on {config.metrics.url}")
    click.echo(f"{server.name}{READY}{server.address}")
    sys.stdout.flush()
    try:
        server.serve_forever()
    finally:
        if config.metrics is not None:
            config.metrics.close()


def _with_metrics(config: RuntimeConfig, port: int | None, host: str | None) -> RuntimeConfig:
    """The configuration with --metrics-port / --metrics-host over FLUIDPS_METRICS_*."""
    if port is None and host is None:
        return config
    env = config.metrics
    port = port if port is not None else env.port if env is not None else 0
    host = host or (env.host if env is not None else DEFAULT_METRICS_HOST)
    if not port:
        return replace(config, metrics=None)
    from fluidps.executor.metrics.job_metrics import JobMetrics  # (prometheus_client: only when asked for)

    return replace(config, metrics=JobMetrics(port, host))


def _stop_when_orphaned(parent_pid: int, stop: Callable[[], None]) -> None:
    """A server whose client was killed before it could close the job (SIGKILL, a
    SIGTERM without cleanup) must not outlive it: when the parent is gone, stop."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        print(f"the process that started this server ({parent_pid}) is gone: stopping", flush=True)
        stop()

    threading.Thread(target=watch, name="parent watch", daemon=True).start()


def _serve_pserver(
    program_file: str | None, startup_file: str | None, config: RuntimeConfig, compile_: bool | None
) -> None:
    if not program_file or not startup_file:
        fail("--role pserver needs --program MAIN.pb and --startup STARTUP.pb")
    main, startup = load_program(program_file), load_program(startup_file)
    serving = [op for op in main.global_block().ops if op.type == "listen_and_serv"]
    if len(serving) != 1:
        fail(f"{program_file} is not a pserver program (it has no listen_and_serv op)")
    exe = Executor(runtime_config=config, compile=compile_)
    exe.run(startup)
    if config.metrics is not None:
        try:
            config.metrics.start()
        except Error as e:
            fail(str(e))
        click.echo(f"pserver {serving[0].attr('pserver_id')}: metrics on {config.metrics.url}")
    # The loop binds as it starts; trainers connecting earlier wait for it.
    click.echo(f"pserver {serving[0].attr('pserver_id')}{READY}{serving[0].attr('endpoint')}")
    sys.stdout.flush()
    try:
        exe.run(main)
    except Error as e:
        click.echo(f"fluidps: error: {e}", err=True)
        sys.exit(1)
    finally:
        exe.close()


@click.group()
def keys() -> None:
    """CURVE key pairs for encrypted, authenticated connections."""


@keys.command("gen")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace the keys DIRECTORY already holds.")
def keys_gen(directory: str, force: bool) -> None:
    """Make server and client key pairs in DIRECTORY and allow the client.

    Give every process of a job the same directory (--keys DIR, keys_dir= or
    FLUIDPS_KEYS). To admit another client, copy its public client.key into
    DIRECTORY/allowed/ under any name ending in .key.
    """
    try:
        path = generate_keys(directory, overwrite=force)
    except Error as e:
        fail(str(e))
    click.echo(f"keys written to {path} (keep *.key_secret private)")


@click.group()
def secret() -> None:
    """A job's secret, for processes started by hand (fluidps launch and RemoteExecutor make
    their own)."""


@secret.command("gen")
@click.argument("file", type=click.Path(dir_okay=False))
def secret_gen(file: str) -> None:
    """Write a new job secret to FILE, readable by its owner only.

    Give every process of the job the same file (FLUIDPS_JOB_SECRET_FILE=FILE, or
    `fluidps serve --secret-file FILE`, or JobDesc(secret_file=FILE)); each message they
    exchange proves it, and servers refuse any message that does not.
    """
    try:
        JobSecret.generate().write(file)
    except FileExistsError:
        fail(f"{file} already exists; remove it first (processes holding the old secret stop being heard)")
    except OSError as e:
        fail(f"cannot write {file}: {e}")
    click.echo(f"job secret written to {file} (mode 600)")
