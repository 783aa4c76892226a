"""Shared test helpers: Paddle fixture paths and programs that exercise every layer.

`tests/` is on sys.path (pytest `pythonpath`), so tests `import helpers`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import fluidps
from fluidps import layers

# Tests stop the servers they start (each in its own session) the way fluidps does:
# SIGTERM to the group, SIGKILL if still there after a bound, everything reaped.
from fluidps.executor.launch.processes import stop_group  # noqa: F401 (re-exported for the tests)

FIXTURES = Path(__file__).parent / "fixtures"
PADDLE = FIXTURES / "paddle"


def python_output(code: str, *args: str, env: Mapping[str, str] | None = None, timeout: float = 600) -> str:
    """What `code` prints, run by a fresh interpreter with `args` as its sys.argv[1:] (from
    outside the checkout, so that its folders do not shadow modules); the test fails with
    its stderr when it exits with an error."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=Path(__file__).resolve().parents[1].parent,
        env=None if env is None else dict(env),
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def paddle_fixture(name: str) -> Path:
    return PADDLE / name


def paddle_summary(name: str) -> dict:
    return json.loads((PADDLE / name / "summary.json").read_text())


def build_mlp(
    hidden: int = 32, classes: int = 10, seed: int = 0
) -> tuple[fluidps.Program, fluidps.Program, fluidps.Variable]:
    """The quick start's model: 64 inputs, two relu layers, softmax cross entropy.
    `seed`: the startup program's random_seed (0: initial values drawn at random)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed  # before the initializers: each takes its seed from it
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [64])
        y = layers.data("y", [1], dtype="int64")
        h = layers.fc(x, hidden, act="relu")
        h = layers.fc(h, hidden, act="relu")
        logits = layers.fc(h, classes)
        loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))
    return main, startup, loss


def build_every_layer() -> tuple[fluidps.Program, fluidps.Program]:
    """One program calling every layer of fluidps.layers at least once."""
    main, startup = fluidps.Program(), fluidps.Program()
    with fluidps.program_guard(main, startup):
        img = layers.data("img", [1, 8, 8])
        label = layers.data("label", [1], dtype="int64")
        ids = layers.data("ids", [4], dtype="int64")
        ids1 = layers.data("ids1", [1], dtype="int64")
        c = layers.conv2d(img, 4, 3, padding=1, act="relu")
        p = layers.pool2d(c, 2, "max", 2)
        p = layers.pool2d(p, 2, "avg", 2, exclusive=False)
        f = layers.flatten(p)
        e = layers.embedding_v2(ids, [50, 3], is_sparse=True)
        e1 = layers.embedding(ids1, [50, 3], padding_idx=0)
        r = layers.reshape(e, [-1, 12])
        t = layers.transpose(e, [0, 2, 1])
        h = layers.concat([f, r, e1, layers.flatten(t)], axis=1)
        a, b = layers.split(h, [21, -1], dim=1)
        h = layers.sums([layers.concat([b, a], axis=1), h])
        h = layers.fc(h, 16, act="tanh")
        h = layers.dropout(h, 0.1)
        h = layers.elementwise_add(h, layers.fc(h, 16, act="sigmoid"))
        h = layers.elementwise_sub(h, layers.scale(h, 0.5, bias=1.0))
        h = layers.elementwise_mul(h, layers.exp(h))
        h = layers.elementwise_div(h, layers.sqrt(layers.square(h)))
        h = layers.elementwise_max(h, layers.log(layers.relu(h)))
        h = layers.elementwise_min(h, layers.tanh(h))
        h = layers.matmul(h, layers.create_parameter([16, 8], "float32"), transpose_x=False, alpha=0.5)
        logits = layers.fc(h, 5)
        prob = layers.softmax(logits)
        ce = layers.cross_entropy(prob, label)
        sce = layers.softmax_with_cross_entropy(logits, label)
        loss = layers.mean(layers.elementwise_add(ce, sce))
        layers.reduce_sum(prob, dim=1)
        layers.reduce_mean(prob, dim=[0, 1], keep_dim=True)
        layers.accuracy(prob, label, k=2)
        layers.cast(loss, "float64")
        layers.assign(loss)
        counter = layers.create_global_var([1], 0.0, "int64", persistable=True, name="step")
        layers.increment(counter)
        layers.fill_constant([2, 3], "float32", 1.5)
        layers.uniform_random([2], min=0.0, max=2.0)
        layers.gaussian_random([2], std=0.1)
        layers.matmul(
            layers.create_parameter([4, 5], "float32", name="extra_w"), layers.transpose(prob, [1, 0])
        )
        layers.sigmoid(logits)
    return main, startup


def staged_mlp(pipeline: dict | None, stages: int = 2, optimizer=None, seed: int = 1):
    """16 inputs, four relu layers of 32 spread over `stages` pipeline stages, a classifier of 5
    on the last; minimized with PipelineOptimizer(optimizer, **pipeline), or plainly (and with
    no stages) when `pipeline` is None. Returns (main, startup, loss, logits)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = seed
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [16])
        y = layers.data("y", [1], dtype="int64")
        h = x
        for i in range(4):
            with _on(pipeline, i * stages // 4):
                h = layers.fc(h, 32, act="relu")
        with _on(pipeline, stages - 1):
            logits = layers.fc(h, 5)
            loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))
        _minimize(loss, optimizer or fluidps.optimizer.SGD(0.1), pipeline)
    return main, startup, loss, logits


def shared_weight_mlp(optimizer, pipeline: dict | None):
    """One weight matrix read on both stages (updated once, with both gradients), 16 inputs,
    5 classes; minimized with PipelineOptimizer(optimizer, **pipeline), or plainly (and with
    no stages) when `pipeline` is None. Returns (main, startup, loss, logits)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 3
    with fluidps.program_guard(main, startup):
        x = layers.data("x", [16])
        y = layers.data("y", [1], dtype="int64")
        shared = fluidps.ParamAttr(name="shared_w")
        with _on(pipeline, 0):
            h = layers.fc(x, 16, act="tanh", param_attr=shared)
        with _on(pipeline, 1):
            h = layers.fc(h, 16, act="tanh", param_attr=shared)
            logits = layers.fc(h, 5)
            loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))
        _minimize(loss, optimizer, pipeline)
    return main, startup, loss, logits


def read(path: Path) -> str:
    """A process's output file as it is now ("" before it exists)."""
    return path.read_text(errors="replace") if path.exists() else ""


def wait_until(condition, timeout: float, what: str) -> None:
    """Poll `condition` until it holds; fail the test after `timeout` seconds, saying `what`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting until {what}"
        time.sleep(0.05)


def staged_conv_net(optimizer, pipeline: dict | None):
    """A conv + max-pool stage, then an fc classifier stage, on 1x8x8 images, 5 classes;
    minimized with PipelineOptimizer(optimizer, **pipeline), or plainly (and with no stages)
    when `pipeline` is None. Returns (main, startup, loss, logits)."""
    main, startup = fluidps.Program(), fluidps.Program()
    startup.random_seed = 2
    with fluidps.program_guard(main, startup):
        img = layers.data("img", [1, 8, 8])
        y = layers.data("y", [1], dtype="int64")
        with _on(pipeline, 0):
            c = layers.conv2d(img, 4, 3, padding=1, act="relu")
            c = layers.pool2d(c, 2, pool_type="max", pool_stride=2)
        with _on(pipeline, 1):
            logits = layers.fc(c, 5)
            loss = layers.mean(layers.softmax_with_cross_entropy(logits, y))
        _minimize(loss, optimizer, pipeline)
    return main, startup, loss, logits


def _on(pipeline: dict | None, stage: int):
    """device_guard of pipeline stage `stage`, or of no stage for the plain program."""
    return fluidps.device_guard(f"stage:{stage}" if pipeline is not None else None)


def _minimize(loss, optimizer, pipeline: dict | None) -> None:
    if pipeline is None:
        optimizer.minimize(loss)
    else:
        fluidps.optimizer.PipelineOptimizer(optimizer, **pipeline).minimize(loss)
