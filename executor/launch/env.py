"""The environment contract a training script reads to learn its role in a job.

The variables are Paddle's, so a job written for Paddle's launcher or Kubernetes
manifests runs unchanged:

  TRAINING_ROLE                 PSERVER or TRAINER
  PADDLE_TRAINER_ID             this trainer's rank, 0 .. PADDLE_TRAINERS_NUM - 1
  PADDLE_TRAINERS_NUM           how many trainers the job has
  PADDLE_PSERVERS_IP_PORT_LIST  every pserver's endpoint, comma-separated host:port
  POD_IP, PADDLE_PORT           a pserver's own address (its endpoint is POD_IP:PADDLE_PORT)
  FLUIDPS_MODE                  sync (default), async or ssp
  FLUIDPS_DATASET               the dataset the trainers read, in a job with a coordinator
  FLUIDPS_COORDINATOR           the coordinator's address, where readers get their tasks

`fluidps launch` sets them for every process it starts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from fluidps.errors import BuilderError
from fluidps.transpiler.config import MODES

ROLES = ("PSERVER", "TRAINER")

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
    "FLUIDPS_COORDINATOR",
    "FLUIDPS_ELASTIC",
    "FLUIDPS_CHECKPOINT_DIR",
    "FLUIDPS_CHECKPOINT_EVERY_STEPS",
    "FLUIDPS_CHECKPOINT_EVERY_SECONDS",
    "FLUIDPS_CHECKPOINT_KEEP",
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

    @property
    def is_pserver(self) -> bool:
        return self.role == "PSERVER"

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


def format_endpoint(host: str, port: int) -> str:
    """host:port, with an IPv6 literal bracketed so the port stays unambiguous."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


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


def _port(text: str) -> int | None:
    if not _DIGITS.fullmatch(text):
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def parse_endpoints(text: str, name: str = "PADDLE_PSERVERS_IP_PORT_LIST") -> tuple[str, ...]:
    """Comma-separated host:port endpoints, each checked, none repeated."""
    what = "comma-separated pserver endpoints host:port, e.g. 127.0.0.1:6170,127.0.0.1:6171"
    endpoints = []
    for item in text.split(","):
        ep = item.strip()
        host, sep, port = ep.rpartition(":")
        if not sep or not host or _port(port) is None or host in ("[", "[]"):
            raise BuilderError(f"{name} has a bad endpoint {ep!r}: it should hold {what}")
        if ep in endpoints:
            raise BuilderError(f"{name} lists {ep} twice: each pserver needs its own endpoint")
        endpoints.append(ep)
    return tuple(endpoints)


def role_from_env(environ: Mapping[str, str] | None = None) -> RoleInfo:
    """Read this process's role from the environment (os.environ unless given).

    Raises BuilderError naming the first missing or malformed variable and what it
    should hold. A pserver's trainer_id is PADDLE_TRAINER_ID when set, else 0.
    """
    env = os.environ if environ is None else environ
    role = _get(env, "TRAINING_ROLE", "PSERVER or TRAINER")
    if role not in ROLES:
        raise BuilderError(f"TRAINING_ROLE={role!r} is invalid: it should hold PSERVER or TRAINER")
    trainers = _int(env, "PADDLE_TRAINERS_NUM", "the number of trainers, an integer >= 1", 1)
    endpoints = parse_endpoints(
        _get(env, "PADDLE_PSERVERS_IP_PORT_LIST", "comma-separated pserver endpoints host:port")
    )
    id_what = f"this trainer's rank, an integer from 0 to {trainers - 1} (PADDLE_TRAINERS_NUM - 1)"
    mode = env.get("FLUIDPS_MODE", "").strip() or "sync"
    if mode not in MODES:
        raise BuilderError(f"FLUIDPS_MODE={mode!r} is invalid: it should hold one of {', '.join(MODES)}")

    dataset = env.get("FLUIDPS_DATASET", "").strip() or None
    if role == "TRAINER":
        trainer_id = _int(env, "PADDLE_TRAINER_ID", id_what, 0, trainers - 1)
        return RoleInfo(role, trainer_id, trainers, endpoints, None, mode, dataset)

    # Paddle leaves PADDLE_TRAINER_ID unset on pservers; a value that is there must still be sane.
    has_id = env.get("PADDLE_TRAINER_ID", "").strip() != ""
    trainer_id = _int(env, "PADDLE_TRAINER_ID", id_what, 0, trainers - 1) if has_id else 0
    pod_ip = _get(env, "POD_IP", "this pserver's host or IP address")
    port = _int(env, "PADDLE_PORT", "this pserver's TCP port, an integer from 1 to 65535", 1, 65535)
    return RoleInfo(role, trainer_id, trainers, endpoints, format_endpoint(pod_ip, port), mode, dataset)
