"""Predictor: predictions from an export directory, on its newest version.

    predictor = fluidps.serving.Predictor("exports")
    outputs = predictor.predict({"x": batch})     # {target name: array}
    predictor.refresh()                           # the newest version, if there is one

A version is the base and the deltas up to it (fluidps.io.exports). `refresh` loads the
versions after the one served onto a copy of its variables, checks every file against
its manifest, and only then swaps the new state in, as one reference: a prediction
runs on one version from start to end, never on half of a delta. A damaged version is
refused (the error is kept in `last_error`) and the old one goes on serving.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from fluidps.errors import FeedError, SerializationError
from fluidps.executor.executor import Executor
from fluidps.executor.scope import Scope
from fluidps.io.exports import latest_version, load_export, load_program
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block, Program
from fluidps.ir.types import to_numpy_dtype


@dataclass(frozen=True)
class Served:
    """One version, whole: its number, its variables and a scope holding them."""

    version: int
    values: Mapping[str, np.ndarray]
    scope: Scope


class Predictor:
    def __init__(self, directory: str | os.PathLike, version: int | None = None):
        self.directory = directory
        self.program: Program = load_program(directory)
        block = self.program.global_block()
        self.feed_names = [
            op.output("Out")[0] for op in sorted(_ops(block, "feed"), key=lambda op: op.attr("col"))
        ]
        self.fetch_names = [
            op.input("X")[0] for op in sorted(_ops(block, "fetch"), key=lambda op: op.attr("col"))
        ]
        self._executor = Executor()
        self._run_lock = threading.Lock()  # (one executor: predictions take turns)
        self._refresh_lock = threading.Lock()
        self.last_error: str | None = None
        self.refused: int | None = None  # the newest version refused (not tried again)
        self._served = self._load(version)

    @property
    def version(self) -> int:
        return self._served.version

    def predict(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        """The targets for `feed` (name -> array, the batch first), on the version served now."""
        return self.predict_version(feed)[1]

    def predict_version(self, feed: Mapping[str, Any]) -> tuple[int, dict[str, np.ndarray]]:
        """(the version that answered, its targets for `feed`): one version from start to end,
        whatever `refresh` swaps in meanwhile."""
        served = self._served
        arrays = self._checked(feed)
        with self._run_lock:
            results = self._executor.run(
                self.program, feed=arrays, fetch_list=self.fetch_names, scope=served.scope
            )
        return served.version, dict(zip(self.fetch_names, results, strict=True))

    def _checked(self, feed: Mapping[str, Any]) -> dict[str, np.ndarray]:
        missing = [n for n in self.feed_names if n not in feed]
        unknown = [n for n in feed if n not in self.feed_names]
        if missing or unknown:
            raise FeedError(
                f"the model takes {', '.join(self.feed_names)}; missing {missing}, unknown {unknown}"
            )
        block = self.program.global_block()
        arrays = {}
        for name in self.feed_names:
            dtype = np.dtype(to_numpy_dtype(block.var(name).dtype))
            try:
                given = np.asarray(feed[name])
            except (TypeError, ValueError) as e:  # (ragged nested lists)
                raise FeedError(f"input {name!r} is not an array of numbers: {e}") from None
            if given.dtype.kind not in "biuf":
                raise FeedError(
                    f"input {name!r} holds {given.dtype} values (null, text or ragged rows): numbers only"
                )
            if given.dtype.kind == "f" and dtype.kind in "biu" and not np.all(np.mod(given, 1) == 0):
                raise FeedError(f"input {name!r} is {dtype}: it holds fractions, which would be cut off")
            arrays[name] = given.astype(dtype)
        return arrays

    def refresh(self) -> bool:
        """Serve the newest version, if newer than the one served; whether it changed. A
        version that fails its checks is refused: the old one goes on serving, and
        `last_error` says why."""
        with self._refresh_lock:
            try:
                newest = latest_version(self.directory)
                if newest is None or newest <= self._served.version or newest == self.refused:
                    return False
                self._served = self._load(newest, self._served)
            except SerializationError as e:
                self.last_error, self.refused = str(e), newest
                return False
            self.last_error = None
            return True

    def _load(self, version: int | None, start: Served | None = None) -> Served:
        known = (start.version, start.values) if start is not None else None
        loaded, values = load_export(self.directory, version, known)
        scope = Scope()
        for name, value in values.items():
            scope[name] = value
        return Served(loaded, values, scope)


def _ops(block: Block, op_type: str) -> list[Operator]:
    return [op for op in block.ops if op.type == op_type]
