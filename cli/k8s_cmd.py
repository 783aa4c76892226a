"""`fluidps k8s`: a job as Kubernetes manifests (render), and the job on a cluster
(submit, status, logs, delete: the `kubernetes` client, `pip install fluidps[k8s]`)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from fluidps.cli.common import fail
from fluidps.errors import Error
from fluidps.executor.launch.kubernetes import PULL_POLICIES, KubernetesCluster, Resources, to_yaml
from fluidps.transpiler.config import MODES


@click.group()
def k8s() -> None:
    """Run a job on Kubernetes: render its manifests, submit them, watch and delete it."""


def _pairs(values: tuple[str, ...], option: str) -> dict[str, str]:
    out = {}
    for text in values:
        key, sep, value = text.partition("=")
        if not sep or not key:
            fail(f"{option} {text!r}: write KEY=VALUE")
        out[key] = value
    return out


def _claim(name: str | None) -> dict | None:
    return {"persistentVolumeClaim": {"claimName": name}} if name else None


# Everything after the options is the command every pserver and trainer pod runs.
@k8s.command(context_settings={"allow_interspersed_args": False})
@click.option("--name", required=True, help="The job's name: its objects are NAME-env, NAME-pserver, ...")
@click.option("--pservers", type=int, required=True, help="How many pservers.")
@click.option("--trainers", type=int, required=True, help="How many trainers.")
@click.option("--image", required=True, help="The container image (see the repository's Dockerfile).")
@click.option("--namespace", default="default", show_default=True)
@click.option("--mode", type=click.Choice(MODES), default="sync", show_default=True, help="FLUIDPS_MODE.")
@click.option("--keys", type=click.Path(file_okay=False), help="Key directory (fluidps keys gen): a Secret.")
@click.option("--insecure", is_flag=True, help="No keys: the pods talk in the clear (a network you trust).")
@click.option("--cpu", help="Each pod's CPU request, e.g. 2 or 500m.")
@click.option("--memory", help="Each pod's memory request, e.g. 4Gi.")
@click.option("--cpu-limit", help="Each pod's CPU limit.")
@click.option("--memory-limit", help="Each pod's memory limit.")
@click.option("--gang", is_flag=True, help="Schedule all pods together or none (a PodGroup).")
@click.option(
    "--gang-scheduler",
    type=click.Choice(["volcano", "scheduler-plugins"]),
    default="volcano",
    show_default=True,
)
@click.option("--pull-policy", type=click.Choice(PULL_POLICIES), default="IfNotPresent", show_default=True)
@click.option("--port", type=int, default=6174, show_default=True, help="The port pservers listen on.")
@click.option("--restarts", type=int, default=3, show_default=True, help="Retries of each failed pod.")
@click.option(
    "--user", type=int, default=10001, show_default=True, help="The pods' uid and gid (never root)."
)
@click.option("--checkpoint-claim", help="A PersistentVolumeClaim for the pservers' checkpoints.")
@click.option("--data-claim", help="A PersistentVolumeClaim the trainers read their data from.")
@click.option("--dataset", help="The dataset the trainers read through a coordinator (a path in their pods).")
@click.option("--node-selector", multiple=True, metavar="KEY=VALUE", help="Repeatable.")
@click.option(
    "--peer-timeout", type=float, help="FLUIDPS_PEER_TIMEOUT: seconds of silence that mean a peer is dead."
)
@click.option(
    "-o", "--output", type=click.Path(dir_okay=False), help="Write the YAML here (default: stdout)."
)
@click.argument("command", nargs=-1, required=True)
def render(
    name: str,
    pservers: int,
    trainers: int,
    image: str,
    namespace: str,
    mode: str,
    keys: str | None,
    insecure: bool,
    cpu: str | None,
    memory: str | None,
    cpu_limit: str | None,
    memory_limit: str | None,
    gang: bool,
    gang_scheduler: str,
    pull_policy: str,
    port: int,
    restarts: int,
    user: int,
    checkpoint_claim: str | None,
    data_claim: str | None,
    dataset: str | None,
    node_selector: tuple[str, ...],
    peer_timeout: float | None,
    output: str | None,
    command: tuple[str, ...],
) -> None:
    """Write a job's Kubernetes manifests: every pserver and trainer pod runs COMMAND
    (e.g. python /app/train.py) with Paddle's environment contract, as under
    `fluidps launch`. `kubectl apply -f` (or `fluidps k8s submit`) takes the output."""
    from fluidps.executor.remote.job import JobDesc

    for option, count in (("--pservers", pservers), ("--trainers", trainers)):
        if count < 1:
            fail(f"{option} {count}: a job needs at least one pserver and one trainer")
    try:
        job = JobDesc(
            pservers=pservers,
            trainers=trainers,
            mode=mode,
            keys_dir=keys,
            insecure=insecure,
            name=name,
            resources=Resources(cpu, memory, cpu_limit, memory_limit),
            gang=gang,
            **({"peer_timeout": peer_timeout} if peer_timeout is not None else {}),
        )
        cluster = KubernetesCluster(
            image=image,
            namespace=namespace,
            command=command,
            image_pull_policy=pull_policy,
            node_selector=_pairs(node_selector, "--node-selector"),
            checkpoint_volume=_claim(checkpoint_claim),
            data_volume=_claim(data_claim),
            port=port,
            restarts=restarts,
            gang_scheduler=gang_scheduler,
            user=user,
        )
        text = to_yaml(job.to_kubernetes(cluster, dataset=dataset))
    except Error as e:
        fail(str(e))
    if output:
        Path(output).write_text(text)
        click.echo(f"wrote {output}: kubectl apply -f {output} (or fluidps k8s submit {output})", err=True)
    else:
        sys.stdout.write(text)


def _client():  # the kubernetes client loads only for the commands that reach a cluster
    from fluidps.executor.launch.kubernetes_client import KubernetesClient

    return KubernetesClient()


@k8s.command()
@click.argument("manifests", type=click.Path(exists=True, dir_okay=False))
@click.option(
    "--timeout",
    type=click.FloatRange(min=0),
    default=600.0,
    show_default=True,
    help="Seconds to wait for the pservers to be ready.",
)
@click.option("--no-wait", is_flag=True, help="Return once the objects are created.")
def submit(manifests: str, timeout: float, no_wait: bool) -> None:
    """Create the objects of MANIFESTS (fluidps k8s render's output) and wait until the
    job's pservers are ready; a pod that fails meanwhile is reported with its last lines."""
    import yaml

    try:
        objects = [o for o in yaml.safe_load_all(Path(manifests).read_text()) if o]
    except yaml.YAMLError as e:
        fail(f"{manifests} is not YAML: {e}")
    try:
        client = _client()
        client.submit(objects, None if no_wait else timeout)
    except Error as e:
        fail(str(e))
    name = objects[0]["metadata"]["labels"]["app.kubernetes.io/instance"]
    click.echo(f"job {name} {'created' if no_wait else 'running: its pservers are ready'}")


@k8s.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default", show_default=True)
def status(name: str, namespace: str) -> None:
    """Each role's counters and each pod's phase, readiness and restarts (JSON)."""
    import json

    try:
        click.echo(json.dumps(_client().status(name, namespace), indent=2))
    except Error as e:
        fail(str(e))


@k8s.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default", show_default=True)
@click.option("--role", type=click.Choice(["pserver", "trainer", "coordinator"]), help="Only these pods.")
@click.option("--tail", type=click.IntRange(min=1), help="The last lines of each pod.")
def logs(name: str, namespace: str, role: str | None, tail: int | None) -> None:
    """Every pod's log, each line prefixed with "[POD] "."""
    try:
        found = _client().logs(name, namespace, role, tail)
    except Error as e:
        fail(str(e))
    for pod, text in sorted(found.items()):
        for line in text.splitlines():
            click.echo(f"[{pod}] {line}")


@k8s.command()
@click.argument("name")
@click.option("-n", "--namespace", default="default", show_default=True)
def delete(name: str, namespace: str) -> None:
    """Delete the job's objects (its pods with its Jobs)."""
    try:
        for gone in _client().delete(name, namespace):
            click.echo(f"deleted {gone}")
    except Error as e:
        fail(str(e))
