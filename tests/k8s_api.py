"""A stand-in for a Kubernetes API server, for tests that reach no cluster: it answers
the few calls fluidps's client makes (create, list, read a pod's log, delete) over HTTP
on 127.0.0.1, keeps what was created, and plays the Job controller's part that the
client watches: each Indexed Job gets its pods, named and labelled as Kubernetes names
and labels them, whose phase and readiness a test decides (`pod_state`).

With a `LocalKubelet`, the pods run for real, here: each pod's container command is
started as a process with the environment the kubelet would give it, and its own
loopback address (127.0.x.y) as its pod IP, so that every pod listens on the same port
as in a cluster; a pod is ready once its port accepts connections (its readiness probe),
and deleting its Job stops it.

It is not Kubernetes: it checks no schema (tests/unit/test_kubernetes.py does, with
Kubernetes' own), and knows only these calls."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
_PATH = re.compile(r"/(?:api/v1|apis/(?P<group>[^/]+)/(?P<version>[^/]+))/namespaces/(?P<ns>[^/]+)/(?P<plural>[^/]+)(?:/(?P<name>[^/]+))?(?:/(?P<sub>log))?")  # fmt: skip
_KINDS = {
    "configmaps": "ConfigMap",
    "secrets": "Secret",
    "services": "Service",
    "jobs": "Job",
    "podgroups": "PodGroup",
}

# (phase, ready, exit status of a terminated container or None, log text)
PodState = tuple[str, bool, int | None, str]


def _matches(labels: dict[str, str], selector: str | None) -> bool:
    if not selector:
        return True
    return all(labels.get(k) == v for k, _, v in (part.partition("=") for part in selector.split(",")))


class LocalKubelet:
    """Runs each pod of a created Job as a local process (see the module's docstring)."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.processes: dict[
            tuple[str, int], tuple[subprocess.Popen, str, int]
        ] = {}  # -> (process, ip, port)
        self._next_ip = 0

    def start(
        self, job: dict[str, Any], configmaps: dict[str, dict[str, Any]], secrets: dict[str, dict[str, Any]]
    ) -> None:
        template = job["spec"]["template"]
        (container,) = template["spec"]["containers"]
        port = container["ports"][0]["containerPort"]
        for index in range(job["spec"]["completions"]):
            self._next_ip += 1
            ip = f"127.0.{10 + self._next_ip // 250}.{1 + self._next_ip % 250}"
            env: dict[str, str] = {}
            for source in container.get("envFrom", []):
                env.update(configmaps[source["configMapRef"]["name"]]["data"])
            for var in container.get("env", []):
                if "value" in var:
                    env[var["name"]] = _expand(var["value"], env)
                    continue
                if "secretKeyRef" in var["valueFrom"]:
                    ref = var["valueFrom"]["secretKeyRef"]
                    env[var["name"]] = base64.b64decode(secrets[ref["name"]]["data"][ref["key"]]).decode()
                    continue
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                env[var["name"]] = (
                    ip if path == "status.podIP" else str(index)
                )  # (else: the index annotation)
            command = [_expand(part, env) for part in container["command"]]
            if command[0] == "fluidps":  # the image's console script: this interpreter's here
                command = [sys.executable, "-m", "fluidps", *command[1:]]
            name = f"{job['metadata']['name']}-{index}"
            with open(self.log_dir / f"{name}.log", "wb") as log:
                process = subprocess.Popen(
                    command,
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            self.processes[(job["metadata"]["name"], index)] = (process, ip, port)

    def state(self, job_name: str, index: int) -> tuple[PodState, str | None]:
        entry = self.processes.get((job_name, index))
        if entry is None:
            return ("Pending", False, None, ""), None
        process, ip, port = entry
        log = (self.log_dir / f"{job_name}-{index}.log").read_text(errors="replace")
        status = process.poll()
        if status is not None:
            return ("Succeeded" if status == 0 else "Failed", False, status, log), ip
        try:
            socket.create_connection((ip, port), timeout=0.2).close()  # the readiness probe
            return ("Running", True, None, log), ip
        except OSError:
            return ("Running", False, None, log), ip

    def stop(self, job_name: str) -> None:
        for (name, index), (process, _, _) in list(self.processes.items()):
            if name == job_name:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
                del self.processes[(name, index)]

    def stop_all(self) -> None:
        for name in {name for name, _ in self.processes}:
            self.stop(name)


def _expand(text: str, env: dict[str, str]) -> str:
    """$(VAR) references to variables defined before, expanded as the kubelet does."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), text)


class FakeApiServer:
    """`pod_state(role, index, polls)` decides each pod's state when it is listed (`polls`:
    how many times the pods were listed before); default: running and ready. With a
    `kubelet`, the pods run (LocalKubelet) and their state is their process's."""

    def __init__(
        self,
        pod_state: Callable[[str, int, int], PodState] | None = None,
        kubelet: LocalKubelet | None = None,
    ):
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, ns, name) -> object
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.pod_state = pod_state or (lambda role, index, polls: ("Running", True, None, ""))
        self.kubelet = kubelet
        self.polls = 0
        self._lock = threading.Lock()
        server = self
        handler = type("Handler", (_Handler,), {"api": server})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        if self.kubelet is not None:
            self.kubelet.stop_all()
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(timeout=10)

    def kubeconfig(self) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                "contexts": [
                    {"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": "default"}}
                ],
                "current-context": "fake",
                "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            }
        )

    # -- what the Job controller would make ------------------------------------------------

    def pods(self, namespace: str) -> list[dict[str, Any]]:
        out = []
        for (plural, ns, name), job in sorted(self.objects.items()):
            if plural != "jobs" or ns != namespace:
                continue
            template = job["spec"]["template"]
            role = template["metadata"]["labels"].get("app.kubernetes.io/component", "")
            for index in range(job["spec"]["completions"]):
                phase, ready, exit_code, _ = self._state(name, role, index)
                container = {
                    "name": "fluidps",
                    "image": template["spec"]["containers"][0]["image"],
                    "imageID": "",
                    "ready": ready,
                    "restartCount": 0,
                    "state": (
                        {"terminated": {"exitCode": exit_code, "reason": "Error"}}
                        if exit_code is not None
                        else {"running": {}}
                    ),
                }
                out.append(
                    {
                        "apiVersion": "v1",
                        "kind": "Pod",
                        "metadata": {
                            "name": f"{name}-{index}-abcde",
                            "namespace": ns,
                            "labels": {**template["metadata"]["labels"], "job-name": name},
                            "annotations": {INDEX_ANNOTATION: str(index)},
                        },
                        "status": {
                            "phase": phase,
                            **({"podIP": ip} if (ip := self._ip(name, index)) else {}),
                            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                            "containerStatuses": [container],
                        },
                    }
                )
        return out

    def _state(self, job_name: str, role: str, index: int) -> PodState:
        if self.kubelet is not None:
            return self.kubelet.state(job_name, index)[0]
        return self.pod_state(role, index, self.polls)

    def _ip(self, job_name: str, index: int) -> str | None:
        return self.kubelet.state(job_name, index)[1] if self.kubelet is not None else None

    def log(self, namespace: str, pod: str) -> str:
        for p in self.pods(namespace):
            if p["metadata"]["name"] == pod:
                index = int(p["metadata"]["annotations"][INDEX_ANNOTATION])
                role = p["metadata"]["labels"]["app.kubernetes.io/component"]
                return self._state(p["metadata"]["labels"]["job-name"], role, index)[3]
        raise KeyError(pod)


class _Handler(BaseHTTPRequestHandler):
    api: FakeApiServer

    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = (body if isinstance(body, str) else json.dumps(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": reason,
                          "message": message, "code": code})  # fmt: skip

    def _route(self) -> tuple[dict[str, str | None], dict[str, list[str]]] | None:
        url = urlparse(self.path)
        self.api.requests.append((self.command, url.path))
        match = _PATH.fullmatch(url.path)
        if match is None:
            self._status(404, "NotFound", f"no route {url.path}")
            return None
        return match.groupdict(), parse_qs(url.query)

    def do_POST(self) -> None:
        routed = self._route()
        if routed is None:
            return
        route, _ = routed
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        key = (route["plural"], route["ns"], body["metadata"]["name"])
        with self.api._lock:
            if key in self.api.objects:
                self._status(409, "AlreadyExists", f"{key[0]} {key[2]!r} already exists")
                return
            if body.get("kind") != _KINDS.get(route["plural"]):
                self._status(400, "BadRequest", f"a {body.get('kind')} sent to {route['plural']}")
                return
            self.api.objects[key] = body
            if route["plural"] == "jobs" and self.api.kubelet is not None:
                configmaps = {n: o for (pl, _, n), o in self.api.objects.items() if pl == "configmaps"}
                secrets = {n: o for (pl, _, n), o in self.api.objects.items() if pl == "secrets"}
                self.api.kubelet.start(body, configmaps, secrets)
        self._send(201, body)

    def do_GET(self) -> None:
        routed = self._route()
        if routed is None:
            return
        route, query = routed
        ns, selector = route["ns"], query.get("labelSelector", [None])[0]
        if route["plural"] == "pods":
            with self.api._lock:
                if route["sub"] == "log":
                    try:
                        text = self.api.log(ns, route["name"])
                    except KeyError:
                        self._status(404, "NotFound", f"pod {route['name']!r} not found")
                        return
                    lines = text.splitlines()
                    tail = int(query.get("tailLines", [len(lines)])[0])
                    self._send(200, "\n".join(lines[-tail:]), "text/plain")
                    return
                pods = [p for p in self.api.pods(ns) if _matches(p["metadata"]["labels"], selector)]
                self.api.polls += 1
            self._send(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": pods})
            return
        items = [
            o
            for (plural, o_ns, _), o in sorted(self.api.objects.items())
            if plural == route["plural"]
            and o_ns == ns
            and _matches(o["metadata"].get("labels", {}), selector)
        ]
        if route["plural"] == "jobs":
            items = [{**j, "status": self._job_status(j)} for j in items]
        self._send(
            200,
            {"apiVersion": "v1", "kind": f"{_KINDS[route['plural']]}List", "metadata": {}, "items": items},
        )

    def _job_status(self, job: dict[str, Any]) -> dict[str, Any]:
        role = job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
        name = job["metadata"]["name"]
        phases = [self.api._state(name, role, i)[0] for i in range(job["spec"]["completions"])]
        return {
            "active": phases.count("Running") + phases.count("Pending"),
            "succeeded": phases.count("Succeeded"),
            "failed": phases.count("Failed"),
        }

    def do_DELETE(self) -> None:
        routed = self._route()
        if routed is None:
            return
        route, _ = routed
        with self.api._lock:
            removed = self.api.objects.pop((route["plural"], route["ns"], route["name"]), None)
            if removed is not None and route["plural"] == "jobs" and self.api.kubelet is not None:
                self.api.kubelet.stop(route["name"])  # (propagation: its pods go with it)
        if removed is None:
            self._status(404, "NotFound", f"{route['plural']} {route['name']!r} not found")
            return
        if route["plural"] == "services":  # Kubernetes answers with the Service deleted
            self._send(200, removed)
            return
        self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})
