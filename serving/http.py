"""`fluidps serve-model`: a Predictor behind HTTP (starlette, served by uvicorn).

    POST /predict   {"inputs": {"x": [[...], ...]}}  ->  {"version": 7, "outputs": {"pred": [[...]]}}
    GET  /healthz   {"status": "ok", "version": 7, "last_error": null}
    GET  /metrics   Prometheus text: requests, their latency, the version served

A task looks for a new version every `poll_s` seconds and swaps it in whole
(Predictor.refresh): a request is answered by one version, never by half of a delta;
a damaged version is refused, the old one goes on serving, and /healthz says why.
Requests that are not JSON, or whose inputs do not fit the model, get 400 with the
reason; predictions run on a worker thread, so the event loop keeps answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from fluidps.errors import Error, FeedError
from fluidps.serving.predictor import Predictor

MAX_BODY_BYTES = 64 << 20  # a request larger than this is refused before it is parsed


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (prometheus_client)."""

    def __init__(self) -> None:
        import prometheus_client as prom

        self.prom = prom
        self.registry = prom.CollectorRegistry()
        self.requests = prom.Counter(
            "fluidps_predict_requests",
            "Prediction requests, by outcome.",
            ["outcome"],
            registry=self.registry,
        )
        self.latency = prom.Histogram(
            "fluidps_predict_latency_seconds",
            "Seconds to answer a prediction request.",
            registry=self.registry,
        )
        self.version = prom.Gauge(
            "fluidps_model_version", "The export version served.", registry=self.registry
        )
        self.swaps = prom.Counter("fluidps_model_swaps", "New versions swapped in.", registry=self.registry)
        self.refused = prom.Counter(
            "fluidps_model_versions_refused", "Versions refused as damaged.", registry=self.registry
        )

    def render(self) -> bytes:
        return self.prom.generate_latest(self.registry)


def create_app(predictor: Predictor, poll_s: float = 1.0) -> Starlette:
    """The ASGI app serving `predictor`, watching its directory every `poll_s` seconds."""
    metrics = Metrics()
    metrics.version.set(predictor.version)

    async def predict(request: Request) -> Response:
        started = time.perf_counter()
        try:
            inputs = _inputs(await _body(request))
            version, outputs = await run_in_threadpool(predictor.predict_version, inputs)
        except (ValueError, FeedError) as e:  # (the request's fault)
            metrics.requests.labels("refused").inc()
            return JSONResponse({"error": str(e)}, status_code=400)
        except Error as e:  # (the model's or the server's)
            metrics.requests.labels("failed").inc()
            return JSONResponse({"error": f"the model failed on this request: {e}"}, status_code=500)
        bad = [k for k, v in outputs.items() if not np.all(np.isfinite(v))]
        if bad:
            metrics.requests.labels("failed").inc()
            error = f"version {version}'s outputs {bad} hold NaN or infinity, which JSON cannot carry"
            return JSONResponse({"error": error}, status_code=500)
        metrics.requests.labels("answered").inc()
        metrics.latency.observe(time.perf_counter() - started)
        outputs_json = {k: np.asarray(v).tolist() for k, v in outputs.items()}
        return JSONResponse({"version": version, "outputs": outputs_json})

    async def healthz(request: Request) -> Response:
        return JSONResponse(
            {"status": "ok", "version": predictor.version, "last_error": predictor.last_error}
        )

    async def metrics_text(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    async def watch() -> None:
        while True:
            await asyncio.sleep(poll_s)
            before, refused = predictor.version, predictor.refused
            try:
                swapped = await run_in_threadpool(predictor.refresh)
            except Exception as e:  # (the watch must outlive any one look: /healthz says why)
                predictor.last_error = f"looking for a new version failed: {type(e).__name__}: {e}"
                print(predictor.last_error, flush=True)
                continue
            if swapped:
                metrics.swaps.inc()
                metrics.version.set(predictor.version)
                print(f"serving version {predictor.version} (was {before})", flush=True)
            elif predictor.refused != refused:
                metrics.refused.inc()
                refusal = f"version {predictor.refused} was refused, still serving {before}"
                print(f"{refusal}: {predictor.last_error}", flush=True)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.create_task(watch())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


async def _body(request: Request) -> bytes:
    """The request's body, refused past MAX_BODY_BYTES before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise ValueError(f"the request is {int(declared):,} bytes, more than {MAX_BODY_BYTES:,}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ValueError(f"the request is more than {MAX_BODY_BYTES:,} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _inputs(body: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(body)
    except ValueError as e:
        raise ValueError(f"the request body is not JSON: {e}") from None
    inputs = parsed.get("inputs") if isinstance(parsed, dict) else None
    if not isinstance(inputs, dict) or not inputs:
        raise ValueError('the request body must be {"inputs": {name: array as nested lists, ...}}')
    return inputs
