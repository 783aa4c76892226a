"""JobDesc: what job a RemoteExecutor runs (its servers, transpiler settings, security,
prefetching, compiling, and its Kubernetes rendering)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from fluidps.endpoints import parse_endpoints
from fluidps.errors import BuilderError, StreamError
from fluidps.executor.launch.kubernetes import KubernetesCluster, KubernetesJob, Resources, render
from fluidps.executor.transport.proof import JobSecret
from fluidps.executor.transport.security import Security
from fluidps.executor.transport.settings import RpcSettings
from fluidps.io.stream import canonical_spec, open_stream
from fluidps.transpiler.config import DistributeTranspilerConfig


@dataclass(frozen=True)
class JobDesc:
    """What job a RemoteExecutor runs.

    By default it starts `pservers` + `trainers` executor servers on this
    machine (`fluidps serve` processes listening on `host`). To use servers
    already running elsewhere, give their addresses in `pserver_servers` and
    `trainer_servers`, and the endpoints the pserver loops should listen on in
    `pserver_endpoints`. `mode` overrides `config.mode`. `profile`: the servers it
    starts record where their time goes (`fluidps serve --profile`), and so does this
    client; RemoteExecutor.profile() collects it. `prefetch_batches`: how many steps
    RemoteExecutor.run_batches keeps in flight (1: a step is sent once the one before
    it is answered); `batches_per_run`: how many of them go to a trainer in one RUN
    message (at most half of prefetch_batches). `compile`: the servers it starts run
    their programs as numba-compiled segments (fluidps.Executor(compile=True); a
    pserver's optimize blocks too), or interpreted; None: as FLUIDPS_COMPILE says in
    their environment (inherited from this process; compiled unless it says 0). Servers
    someone else runs decide for themselves (`fluidps serve --compile`).

    `cluster`: a fluidps.KubernetesCluster whose pods run the job's servers: the
    RemoteExecutor creates them (kubernetes_servers(), named after `name`, with
    `resources` and `gang`), waits until they are ready, talks to them at their pods'
    addresses, and deletes them when it closes. It must run where those addresses are
    reachable: in a pod of that cluster. `to_kubernetes()` renders the job the Fluid way
    instead (a script in every pod, no client), for `fluidps k8s submit`.

    `stream`: the job trains from this stream (`log:DIR` or `redis://HOST:PORT/STREAM`,
    as `fluidps launch --stream`): its training program reads it with
    layers.stream_reader (the same source; deploying checks it), a coordinator on this
    machine hands each window to one trainer, and RemoteExecutor.stop_streams() drains
    it. A program whose stream reader names a stream is served the same way without it;
    with it, a program that reads another stream, a dataset or fed batches is refused.
    """

    pservers: int = 1
    trainers: int = 1
    mode: str | None = None
    config: DistributeTranspilerConfig = field(default_factory=DistributeTranspilerConfig)
    host: str = "127.0.0.1"
    pserver_servers: Sequence[str] = ()
    trainer_servers: Sequence[str] = ()
    pserver_endpoints: Sequence[str] = ()
    keys_dir: str | None = None
    # The job's secret (fluidps.executor.transport.proof): a file `fluidps secret gen` wrote,
    # which servers someone else runs read too (`fluidps serve --secret-file`). None: a new
    # secret for the servers this client starts.
    secret_file: str | None = None
    insecure: bool = False
    peer_timeout: float = 10.0
    start_timeout: float = 120.0
    log_dir: str | None = None
    profile: bool = False  # every process records where its time goes: exe.profile()
    # Steps run_batches keeps in flight, in RUN messages of up to batches_per_run batches: a
    # trainer ending a message's steps already holds the next message, so it goes on at once
    # and knows each step's next batch (its table rows come with the step's values); the
    # client, and the serving loop of each trainer, pay for one message every few steps.
    prefetch_batches: int = 8
    batches_per_run: int = 4
    compile: bool | None = None  # the servers' executors compile their blocks
    name: str = "fluidps"  # on a cluster, its objects are named after it (to_kubernetes)
    resources: Resources = field(default_factory=Resources)  # each pod's cpu / memory (to_kubernetes)
    gang: bool = False  # on a cluster, all pods are scheduled together or none (to_kubernetes)
    cluster: KubernetesCluster | None = None  # the servers run as pods of this cluster
    stream: str | None = None  # the stream the job trains from (kept in canonical form)

    def __post_init__(self) -> None:
        for field_name in ("pservers", "trainers"):
            count = getattr(self, field_name)
            if not isinstance(count, int) or count < 1:
                raise BuilderError(
                    f"{field_name}={count!r}: a job needs at least one pserver and one trainer"
                )
        if self.prefetch_batches < 1:
            raise BuilderError(
                f"prefetch_batches must be >= 1 (1: no batch is sent ahead), got {self.prefetch_batches}"
            )
        if self.batches_per_run < 1:
            raise BuilderError(
                f"batches_per_run must be >= 1 (1: a RUN message a step), got {self.batches_per_run}"
            )
        for field_name, count, given in (
            ("pserver_servers", self.pservers, self.pserver_servers),
            ("trainer_servers", self.trainers, self.trainer_servers),
        ):
            if given and len(given) != count:
                raise BuilderError(f"{field_name} lists {len(given)} servers for a job of {count}")
        if self.pserver_endpoints and len(self.pserver_endpoints) != self.pservers:
            raise BuilderError(
                f"pserver_endpoints lists {len(self.pserver_endpoints)} for {self.pservers} pservers"
            )
        if self.pserver_servers and not self.pserver_endpoints:
            raise BuilderError(
                "with pserver_servers, give pserver_endpoints: where their pserver loops listen"
            )
        if self.pserver_endpoints:
            parse_endpoints(list(self.pserver_endpoints), "pserver_endpoints")
        if self.cluster is not None and (
            self.pserver_servers or self.trainer_servers or self.pserver_endpoints
        ):
            raise BuilderError("with cluster, the job's servers are its pods: give no servers or endpoints")
        if self.stream is not None:
            self._check_stream()
        self.transpiler_config()  # a bad mode fails here, not at the first step

    def _check_stream(self) -> None:
        if not isinstance(self.stream, str):
            raise BuilderError(f"stream={self.stream!r}: give log:DIR or redis://HOST:PORT/STREAM, as text")
        if self.cluster is not None:
            raise BuilderError(
                "stream= with cluster=: a RemoteExecutor on Kubernetes reads no stream yet (a streaming job's "
                "coordinator runs on this machine, not as a pod)"
            )
        spec = canonical_spec(self.stream)  # (every process opens the same log, wherever it runs)
        try:
            open_stream(spec).close()
        except StreamError as e:
            raise BuilderError(f"stream={self.stream!r}: {e}") from None
        object.__setattr__(self, "stream", spec)

    def kubernetes_servers(self, secret: JobSecret | None = None) -> list[dict[str, Any]]:
        """The objects of this job's executor servers as pods of `cluster` (a RemoteExecutor
        creates them): `fluidps serve` in every pserver and trainer pod, which read the job's
        `secret` (a new one if not given) from a Secret."""
        if self.cluster is None:
            raise BuilderError("this job names no cluster: JobDesc(cluster=fluidps.KubernetesCluster(...))")
        return render(self._kubernetes_job(self.cluster, None, serve=True, secret=secret))

    def _kubernetes_job(
        self, cluster: KubernetesCluster, dataset: str | None, serve: bool, secret: JobSecret | None = None
    ) -> KubernetesJob:
        if secret is None:
            secret = JobSecret.read(self.secret_file) if self.secret_file else JobSecret.generate()
        return KubernetesJob(
            secret=secret,
            name=self.name,
            pservers=self.pservers,
            trainers=self.trainers,
            cluster=cluster,
            mode=self.transpiler_config().mode,
            keys_dir=self.keys_dir,
            insecure=self.insecure,
            peer_timeout=self.peer_timeout,
            resources=self.resources,
            gang=self.gang,
            dataset=dataset,
            serve=serve,
            compile=self.compile,
        )

    def to_kubernetes(
        self, cluster: KubernetesCluster | None = None, dataset: str | None = None, **cluster_fields: Any
    ) -> list[dict[str, Any]]:
        """This job as Kubernetes objects (plain dicts: fluidps.executor.launch.kubernetes),
        its pods running `cluster.command` the Fluid way. Give a KubernetesCluster or its
        fields (image=..., namespace=..., command=...). `dataset`: the path, inside the
        trainers' pods, of the dataset they read through a coordinator. Raises a
        BuilderError naming a field that breaks a rule, before rendering anything."""
        if self.stream is not None:
            raise BuilderError(
                "a job with stream= is not rendered for Kubernetes yet (fluidps launch --stream runs a "
                "streaming job's processes on one machine)"
            )
        if cluster is None:
            if "image" not in cluster_fields:
                raise BuilderError("to_kubernetes needs a KubernetesCluster or image=...")
            cluster_fields["command"] = tuple(cluster_fields.get("command", ()))
            cluster = KubernetesCluster(**cluster_fields)
        elif cluster_fields:
            raise BuilderError(
                f"give a KubernetesCluster or its fields, not both ({', '.join(cluster_fields)})"
            )
        return render(self._kubernetes_job(cluster, dataset, serve=False))

    def transpiler_config(self) -> DistributeTranspilerConfig:
        return self.config if self.mode is None else replace(self.config, mode=self.mode)

    def rpc_settings(self) -> RpcSettings:
        security = Security.from_dir(self.keys_dir) if self.keys_dir else None
        secret = JobSecret.read(self.secret_file) if self.secret_file else None
        return RpcSettings(
            peer_timeout=self.peer_timeout, security=security, secret=secret, insecure=self.insecure
        )
