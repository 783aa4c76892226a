"""serving: a model exported for serving (fluidps.io.exports), answering predictions.

Owns `Predictor` (predictor.py: the inference program and the newest version of its
variables, base and deltas, swapped in whole as new versions appear; in process) and
the HTTP server around it (http.py: `fluidps serve-model`, on starlette and uvicorn,
the `serve` extra; Prometheus metrics with the `metrics` extra).

May import: fluidps.errors, fluidps.io, fluidps.ir, fluidps.executor
"""

from fluidps.serving.predictor import Predictor

__all__ = ["Predictor"]
