"""The environment contract a training script reads to learn its role in a job.

The variables are Paddle's, so a job written for Paddle's launcher or Kubernetes
manifests runs unchanged:

  TRAINING_ROLE                 PSERVER or TRAINER
  PADDLE_TRAINER_ID             this trainer's rank, 0 .. PADDLE_TRAINERS_NUM - 1
  PADDLE_TRAINERS_NUM           how many trainers the job has
  PADDLE_PSERVERS_IP_PORT_LIST  every pserver's endpoint, comma-separated host:port (or a
                                ZeroMQ address: the forms fluidps.endpoints describes)
  POD_IP, PADDLE_PORT           a pserver's own address (its endpoint is POD_IP:PADDLE_PORT)
  FLUIDPS_MODE                  sync (default), async or ssp
  FLUIDPS_DATASET               the dataset the trainers read, in a job with a coordinator
  FLUIDPS_STREAM                or the stream they read (fluidps.io.open_stream's spec)
  FLUIDPS_DEAD_LETTERS          where a stream reader appends the records it cannot train on
                                (JSON Lines), unless it names its own file
  FLUIDPS_COORDINATOR           the coordinator's address, where readers get their tasks
  FLUIDPS_STAGE                 a pipeline stage's process (fluidps launch --stages): its stage,
                                0 .. the number of stages - 1; PADDLE_PSERVERS_IP_PORT_LIST may
                                then be unset (a pipeline of one replica needs no pserver); a
                                pserver's: the stage whose parameters it serves
  FLUIDPS_STAGE_ENDPOINTS       every stage process's endpoint, comma-separated, in stage order

`fluidps launch` sets them for every process it starts. These configure how a
process's runtime talks to the others (`runtime_config_from_env`; an Executor
given no RuntimeConfig reads them when a program first needs its runtime):

  FLUIDPS_PEER_TIMEOUT          seconds of silence after which a peer is dead (a floor: it
                                stretches for a slow peer; fluidps.executor.transport.liveness)
  FLUIDPS_WARMUP_TIMEOUT        a peer's allowance until its first step is done (120)
  FLUIDPS_REJOIN_TIMEOUT        how long a pserver whose trainers were all evicted waits (600)
  FLUIDPS_REQUEST_TIMEOUT       seconds any reply may take
  FLUIDPS_MAX_MESSAGE_BYTES     the largest message accepted
  FLUIDPS_JOB_SECRET_FILE       a 0600 file holding the job's secret (fluidps secret gen): every
                                message proves it, and servers refuse messages that do not
  FLUIDPS_JOB_SECRET            the secret itself, in hex (from a Kubernetes Secret)
  FLUIDPS_KEYS, FLUIDPS_INSECURE  CURVE keys (fluidps keys gen); 1: serve without a secret, and
                                non-loopback addresses in the clear
  FLUIDPS_ELASTIC               1: trainers are disposable (pservers evict and readmit them)
  FLUIDPS_PROFILE               1: record where the process's time goes (fluidps.profiling)
  FLUIDPS_COMPILE, FLUIDPS_CACHE_DIR
                                0: Executors interpret their blocks; 1 (the default): they run
                                them as numba-compiled segments, their code kept in the cache
                                directory (fluidps.executor.compiler)
  FLUIDPS_CHECKPOINT_DIR, FLUIDPS_CHECKPOINT_EVERY_STEPS, FLUIDPS_CHECKPOINT_EVERY_SECONDS,
  FLUIDPS_CHECKPOINT_KEEP, FLUIDPS_CHECKPOINT_BASE_EVERY
                                every pserver's checkpoints, instead of its program's settings
  FLUIDPS_PEER_EXIT_STATUS      exit with this status when a peer's restart or silence failed
                                the process (role_from_env installs it; fluidps.executor.peer_exit)
  FLUIDPS_STACKS_ON_SIGUSR1     1: SIGUSR1 prints every thread's stack (fluidps.executor.stacks)
  FLUIDPS_INCARNATION, FLUIDPS_REPLACES
                                this process's incarnation (hex; default: drawn at random) and,
                                for a restarted trainer, its predecessor's: pservers hand its
                                trainer id over at once (fluidps.executor.ps.membership)
  FLUIDPS_TRAINER_INCARNATIONS  a pserver's: every trainer's incarnation, comma-separated (a
                                message claiming a trainer id with another one is refused)
  FLUIDPS_METRICS_PORT, FLUIDPS_METRICS_HOST
                                serve this process's Prometheus metrics at http://HOST:PORT/metrics
                                (port 0 or unset: not served; host 127.0.0.1 unless given; the
                                metrics extra; `fluidps launch --metrics-port` gives each process a
                                port of its own; fluidps.executor.metrics.job_metrics)

Only this module, the CLI and the launcher read the environment; the objects they
configure are given their configuration.
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fluidps.endpoints import format_endpoint, parse_endpoints
from fluidps.errors import BuilderError, CheckpointError, TransportError
from fluidps.executor import peer_exit, stacks
from fluidps.executor.ps.checkpointer import CheckpointOverrides
from fluidps.executor.runtime import RuntimeConfig
from fluidps.executor.transport.settings import RpcSettings
from fluidps.transpiler.config import MODES

if TYPE_CHECKING:
    from fluidps.executor.metrics.job_metrics import JobMetrics
    from fluidps.executor.transport.proof import JobSecret

ROLES = ("PSERVER", "TRAINER")
DEFAULT_METRICS_HOST = "127.0.0.1"  # metrics are served on loopback unless an address is given

# Every variable of the contract: the launcher clears them all before setting
# the ones a process's role needs, so nothing leaks in from its own environment.
CONTRACT_VARS = (
    "TRAINING_ROLE",
    "PADDLE_TRAINER_ID",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_PSERVERS_IP_PORT_LIST",
    "POD_IP",
    "PADDLE_PORT",
    "FLUIDPS_MODE",
    "FLUIDPS_DATASET",
    "FLUIDPS_STREAM",
    "FLUIDPS_DEAD_LETTERS",
    "FLUIDPS_COORDINATOR",
    "FLUIDPS_STAGE",
    "FLUIDPS_STAGE_ENDPOINTS",
    "FLUIDPS_ELASTIC",
    "FLUIDPS_CHECKPOINT_DIR",
    "FLUIDPS_CHECKPOINT_EVERY_STEPS",
    "FLUIDPS_CHECKPOINT_EVERY_SECONDS",
    "FLUIDPS_CHECKPOINT_KEEP",
    "FLUIDPS_CHECKPOINT_BASE_EVERY",
    "FLUIDPS_INCARNATION",
    "FLUIDPS_REPLACES",
    "FLUIDPS_TRAINER_INCARNATIONS",
    "FLUIDPS_JOB_SECRET_FILE",
    "FLUIDPS_JOB_SECRET",
    "FLUIDPS_METRICS_PORT",  # (one port per process: a launcher's own must not reach its children)
    "FLUIDPS_METRICS_HOST",
)

# int() would also take "+3", "1_000" or "٣"; a rank or port is plain ASCII digits.
_DIGITS = re.compile(r"[0-9]+")


@dataclass(frozen=True)
class RoleInfo:
    """What one process of a job is: its role, its rank and its peers."""

    role: str
    trainer_id: int
    trainers: int
    pserver_endpoints: tuple[str, ...]
    current_endpoint: str | None
    mode: str = "sync"
    dataset: str | None = None  # FLUIDPS_DATASET: what a job with a coordinator reads
    # A pipeline stage's process (FLUIDPS_STAGE): its stage, and every stage's endpoint.
    stage: int | None = None
    stage_endpoints: tuple[str, ...] = ()
    stream: str | None = None  # FLUIDPS_STREAM: what a streaming job reads

    @property
    def is_pserver(self) -> bool:
        return self.role == "PSERVER"

    @property
    def is_stage(self) -> bool:
        """Whether this process runs one stage of a launched pipeline."""
        return self.stage is not None

    @property
    def is_trainer(self) -> bool:
        return self.role == "TRAINER"

    @property
    def pserver_index(self) -> int | None:
        """This pserver's position in `pserver_endpoints`, or None (a trainer, or a pserver
        whose POD_IP is an address the list spells differently, e.g. a DNS name)."""
        if self.current_endpoint is None or self.current_endpoint not in self.pserver_endpoints:
            return None
        return self.pserver_endpoints.index(self.current_endpoint)


def _get(env: Mapping[str, str], name: str, what: str) -> str:
    value = env.get(name, "").strip()
    if not value:
        state = "is empty" if name in env else "is not set"
        raise BuilderError(f"{name} {state}: it should hold {what}")
    return value


def _int(env: Mapping[str, str], name: str, what: str, low: int, high: int | None = None) -> int:
    text = _get(env, name, what)
    value = int(text) if _DIGITS.fullmatch(text) else None
    if value is None or value < low or (high is not None and value > high):
        raise BuilderError(f"{name}={text!r} is invalid: it should hold {what}")
    return value


def role_from_env(environ: Mapping[str, str] | None = None) -> RoleInfo:
    """Read this process's role from the environment (os.environ unless given).

    Raises BuilderError naming the first missing or malformed variable and what it
    should hold. A pserver's trainer_id is PADDLE_TRAINER_ID when set, else 0.
    """
    env = os.environ if environ is None else environ
    if environ is None and env.get(peer_exit.ENV, "").strip():  # a launched process: see peer_exit
        peer_exit.install_hook(_int(env, peer_exit.ENV, "an exit status, 1 to 125", 1, 125))
    if environ is None and env.get(stacks.ENV, "").strip() == "1":
        stacks.dump_on_sigusr1()
    role = _get(env, "TRAINING_ROLE", "PSERVER or TRAINER")
    if role not in ROLES:
        raise BuilderError(f"TRAINING_ROLE={role!r} is invalid: it should hold PSERVER or TRAINER")
    trainers = _int(env, "PADDLE_TRAINERS_NUM", "the number of trainers, an integer >= 1", 1)
    stage, stage_endpoints = _stage(env, role)
    pservers = env.get("PADDLE_PSERVERS_IP_PORT_LIST", "").strip()
    endpoints = (
        ()
        if stage is not None and role == "TRAINER" and not pservers
        else parse_endpoints(
            _get(env, "PADDLE_PSERVERS_IP_PORT_LIST", "comma-separated pserver endpoints host:port"),
            "PADDLE_PSERVERS_IP_PORT_LIST",
        )
    )
    id_what = f"this trainer's rank, an integer from 0 to {trainers - 1} (PADDLE_TRAINERS_NUM - 1)"
    mode = env.get("FLUIDPS_MODE", "").strip() or "sync"
    if mode not in MODES:
        raise BuilderError(f"FLUIDPS_MODE={mode!r} is invalid: it should hold one of {', '.join(MODES)}")

    dataset = env.get("FLUIDPS_DATASET", "").strip() or None
    stream = env.get("FLUIDPS_STREAM", "").strip() or None
    if role == "TRAINER":
        trainer_id = _int(env, "PADDLE_TRAINER_ID", id_what, 0, trainers - 1)
        return RoleInfo(
            role, trainer_id, trainers, endpoints, None, mode, dataset, stage, stage_endpoints, stream
        )

    # Paddle leaves PADDLE_TRAINER_ID unset on pservers; a value that is there must still be sane.
    has_id = env.get("PADDLE_TRAINER_ID", "").strip() != ""
    trainer_id = _int(env, "PADDLE_TRAINER_ID", id_what, 0, trainers - 1) if has_id else 0
    pod_ip = _get(env, "POD_IP", "this pserver's host or IP address")
    port = _int(env, "PADDLE_PORT", "this pserver's TCP port, an integer from 1 to 65535", 1, 65535)
    current = format_endpoint(pod_ip, port)
    return RoleInfo(
        role, trainer_id, trainers, endpoints, current, mode, dataset, stage, stage_endpoints, stream
    )


def _stage(env: Mapping[str, str], role: str) -> tuple[int | None, tuple[str, ...]]:
    """FLUIDPS_STAGE and FLUIDPS_STAGE_ENDPOINTS: (None, ()) when this is no stage's process.
    A pserver with FLUIDPS_STAGE serves that stage's parameters (its endpoints optional)."""
    if not env.get("FLUIDPS_STAGE", "").strip():
        return None, ()
    if role == "PSERVER" and not env.get("FLUIDPS_STAGE_ENDPOINTS", "").strip():
        what = "the pipeline stage whose parameters this pserver serves, an integer >= 0"
        return _int(env, "FLUIDPS_STAGE", what, 0), ()
    endpoints = tuple(
        parse_endpoints(
            _get(env, "FLUIDPS_STAGE_ENDPOINTS", "every stage's endpoint, comma-separated host:port"),
            "FLUIDPS_STAGE_ENDPOINTS",
        )
    )
    what = f"this process's pipeline stage, an integer from 0 to {len(endpoints) - 1}"
    return _int(env, "FLUIDPS_STAGE", what, 0, len(endpoints) - 1), endpoints


# -- what a process's runtime takes from the environment -----------------------------------


def rpc_settings_from_env(environ: Mapping[str, str] | None = None) -> RpcSettings:
    """RpcSettings from FLUIDPS_PEER_TIMEOUT, FLUIDPS_WARMUP_TIMEOUT, FLUIDPS_REJOIN_TIMEOUT,
    FLUIDPS_REQUEST_TIMEOUT, FLUIDPS_MAX_MESSAGE_BYTES, FLUIDPS_JOB_SECRET_FILE or
    FLUIDPS_JOB_SECRET, FLUIDPS_KEYS, FLUIDPS_INSECURE and FLUIDPS_ELASTIC (os.environ
    unless given)."""
    env = os.environ if environ is None else environ
    settings = RpcSettings()
    for var, field in (
        ("FLUIDPS_PEER_TIMEOUT", "peer_timeout"),
        ("FLUIDPS_WARMUP_TIMEOUT", "warmup_timeout"),
        ("FLUIDPS_REJOIN_TIMEOUT", "rejoin_timeout"),
        ("FLUIDPS_REQUEST_TIMEOUT", "request_timeout"),
    ):
        if var in env:
            settings = settings.with_(**{field: _seconds(env, var)})
    if "FLUIDPS_MAX_MESSAGE_BYTES" in env:
        text = env["FLUIDPS_MAX_MESSAGE_BYTES"]
        if not (_DIGITS.fullmatch(text) and 0 < int(text) <= 1 << 40):
            raise TransportError(
                f"FLUIDPS_MAX_MESSAGE_BYTES={text!r} is invalid: it should hold a number of bytes, 1 .. 2**40"
            )
        settings = settings.with_(max_message_bytes=int(text))
    if env.get("FLUIDPS_ELASTIC") == "1":
        settings = settings.with_(elastic=True)
    if env.get("FLUIDPS_KEYS"):
        from fluidps.executor.transport.security import Security  # loads ZeroMQ: only with keys

        settings = settings.with_(security=Security.from_dir(env["FLUIDPS_KEYS"]))
    if env.get("FLUIDPS_INSECURE") == "1":
        settings = settings.with_(insecure=True)
    secret = job_secret_from_env(env)
    if secret is not None:
        settings = settings.with_(secret=secret)
    if env.get(TRAINER_INCARNATIONS_ENV, "").strip():
        incarnations = parse_incarnations(env[TRAINER_INCARNATIONS_ENV], TRAINER_INCARNATIONS_ENV)
        settings = settings.with_(trainer_incarnations=incarnations)
    return settings


def runtime_config_from_env(environ: Mapping[str, str] | None = None) -> RuntimeConfig:
    """A process's RuntimeConfig: its RpcSettings, FLUIDPS_COORDINATOR, the
    FLUIDPS_CHECKPOINT_* overrides and FLUIDPS_METRICS_* (os.environ unless given)."""
    env = os.environ if environ is None else environ
    return RuntimeConfig(
        rpc=rpc_settings_from_env(env),
        coordinator=env.get("FLUIDPS_COORDINATOR", "").strip() or None,
        checkpoints=checkpoint_overrides_from_env(env),
        profile=env.get("FLUIDPS_PROFILE", "").strip() == "1",
        incarnation=_incarnation(env.get(INCARNATION_ENV, ""), INCARNATION_ENV),
        replaces=_incarnation(env.get(REPLACES_ENV, ""), REPLACES_ENV),
        metrics=metrics_from_env(env),
    )


METRICS_PORT_ENV, METRICS_HOST_ENV = "FLUIDPS_METRICS_PORT", "FLUIDPS_METRICS_HOST"


def metrics_from_env(environ: Mapping[str, str] | None = None) -> JobMetrics | None:
    """Where FLUIDPS_METRICS_PORT and FLUIDPS_METRICS_HOST say to serve this process's
    metrics (not started yet), or None: not served."""
    env = os.environ if environ is None else environ
    if not env.get(METRICS_PORT_ENV, "").strip():
        return None
    port = _int(env, METRICS_PORT_ENV, "a TCP port for the metrics, 1 to 65535 (0: none)", 0, 65535)
    if port == 0:
        return None
    from fluidps.executor.metrics.job_metrics import JobMetrics  # (prometheus_client: only when asked for)

    return JobMetrics(port, env.get(METRICS_HOST_ENV, "").strip() or DEFAULT_METRICS_HOST)


SECRET_FILE_ENV, SECRET_ENV = "FLUIDPS_JOB_SECRET_FILE", "FLUIDPS_JOB_SECRET"


def job_secret_from_env(environ: Mapping[str, str] | None = None) -> JobSecret | None:
    """The job's secret from FLUIDPS_JOB_SECRET_FILE or FLUIDPS_JOB_SECRET (not both), or None."""
    from fluidps.executor.transport.proof import JobSecret  # (local training never needs it)

    env = os.environ if environ is None else environ
    path, text = env.get(SECRET_FILE_ENV, "").strip(), env.get(SECRET_ENV, "").strip()
    if path and text:
        raise TransportError(f"set {SECRET_FILE_ENV} or {SECRET_ENV}, not both: they could disagree")
    if path:
        return JobSecret.read(path)
    if text:
        return JobSecret.from_hex(text, SECRET_ENV)
    return None


# Set by a launcher: each process's incarnation and, for a restarted one, its predecessor's;
# on pservers, every trainer's.
INCARNATION_ENV, REPLACES_ENV = "FLUIDPS_INCARNATION", "FLUIDPS_REPLACES"
TRAINER_INCARNATIONS_ENV = "FLUIDPS_TRAINER_INCARNATIONS"
_HEX = re.compile(r"[0-9a-f]{1,16}")


def new_incarnation() -> str:
    """A fresh incarnation, as a launcher writes it into FLUIDPS_INCARNATION."""
    return f"{secrets.randbits(63) | 1:x}"


def parse_incarnations(text: str, name: str) -> tuple[int, ...]:
    """Incarnations written in hex, comma-separated (FLUIDPS_TRAINER_INCARNATIONS)."""
    return tuple(_incarnation(t, name, required=True) for t in text.split(","))


def parse_incarnation(text: str, name: str) -> int:
    """One incarnation written in hex (FLUIDPS_INCARNATION)."""
    return _incarnation(text, name, required=True)


def _incarnation(text: str, name: str, required: bool = False) -> int:
    """An incarnation written in hex (0: none written, unless `required`)."""
    text = text.strip()
    if not text and not required:
        return 0
    if not _HEX.fullmatch(text) or not 0 < int(text, 16) < 1 << 63:
        raise BuilderError(
            f"{name}={text!r} is invalid: it should hold an incarnation, 1 to 16 hex digits below 2**63"
            + (" each, comma-separated" if required else "")
        )
    return int(text, 16)


def compile_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether Executors compile their blocks (fluidps.executor.compiler): yes, unless
    FLUIDPS_COMPILE=0 says to interpret them."""
    env = os.environ if environ is None else environ
    text = env.get("FLUIDPS_COMPILE", "").strip()
    if text not in ("", "0", "1"):
        raise BuilderError(
            f"FLUIDPS_COMPILE={text!r} is invalid: it should hold 1 (compile) or 0 (interpret)"
        )
    return text != "0"


def checkpoint_overrides_from_env(environ: Mapping[str, str] | None = None) -> CheckpointOverrides:
    env = os.environ if environ is None else environ

    def number(name: str, parse: type, low: float) -> int | float | None:
        text = env.get(name, "").strip()
        if not text:
            return None
        try:
            value = parse(text)
        except ValueError:
            value = math.nan
        if not value >= low or not math.isfinite(value):
            raise CheckpointError(f"{name}={text!r} is invalid: it should hold a number >= {low:g}")
        return value

    return CheckpointOverrides(
        directory=env.get("FLUIDPS_CHECKPOINT_DIR", "").strip() or None,
        every_steps=number("FLUIDPS_CHECKPOINT_EVERY_STEPS", int, 0),
        every_seconds=number("FLUIDPS_CHECKPOINT_EVERY_SECONDS", float, 0),
        keep=number("FLUIDPS_CHECKPOINT_KEEP", int, 1),
        base_every=number("FLUIDPS_CHECKPOINT_BASE_EVERY", int, 1),
        # (a streaming job's coordinator learns each pserver's incarnation from it)
        before_serving=bool(env.get("FLUIDPS_STREAM", "").strip()),
    )


def _seconds(env: Mapping[str, str], name: str) -> float:
    try:
        value = float(env[name])
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise TransportError(f"{name}={env[name]!r} is invalid: it should hold a positive number of seconds")
    return value
