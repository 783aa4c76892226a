"""A stand-in for a Kubernetes API server, for tests that reach no cluster: it answers
the few calls fluidps's client makes (create, list, read a pod's log, delete) over HTTP
on 127.0.0.1, keeps what was created, and plays the Job controller's part that the
client watches: each Indexed Job gets its pods, named and labelled as Kubernetes names
and labels them, whose phase and readiness a test decides (`pod_state`).

It is not Kubernetes: it checks no schema (tests/unit/test_kubernetes.py does, with
Kubernetes' own), runs nothing, and knows only these calls."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class FakeApiServer:
    """`pod_state(role, index, polls)` decides each pod's state when it is listed (`polls`:
    how many times the pods were listed before); default: running and ready."""

    def __init__(self, pod_state: Callable[[str, int, int], PodState] | None = None):
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, ns, name) -> object
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.pod_state = pod_state or (lambda role, index, polls: ("Running", True, None, ""))
        self.polls = 0
        self._lock = threading.Lock()
        server = self
        handler = type("Handler", (_Handler,), {"api": server})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
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
                phase, ready, exit_code, _ = self.pod_state(role, index, self.polls)
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
                            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                            "containerStatuses": [container],
                        },
                    }
                )
        return out

    def log(self, namespace: str, pod: str) -> str:
        for p in self.pods(namespace):
            if p["metadata"]["name"] == pod:
                role = p["metadata"]["labels"]["app.kubernetes.io/component"]
                return self.pod_state(role, int(p["metadata"]["annotations"][INDEX_ANNOTATION]), self.polls)[
                    3
                ]
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
        phases = [self.api.pod_state(role, i, self.api.polls)[0] for i in range(job["spec"]["completions"])]
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
        if removed is None:
            self._status(404, "NotFound", f"{route['plural']} {route['name']!r} not found")
            return
        if route["plural"] == "services":  # Kubernetes answers with the Service deleted
            self._send(200, removed)
            return
        self._send(200, {"kind": "Status", "apiVersion": "v1", "status": "Success", "metadata": {}})
