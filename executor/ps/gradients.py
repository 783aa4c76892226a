"""Summing and averaging gradients, dense arrays or SelectedRows: the mean over trainers a
sync pserver fills in for trainers that sent nothing, the mean over `send_interval`
steps an async trainer uploads, and what an async trainer's communicator merges.

A trainer with send_interval n uploads, every n steps, the mean of its last n
gradients; the sum lives in its TrainerClient (GradientSum), keyed by what is sent, so it
does not depend on how often the program is prepared again, and what is left of it
when the trainer stops is still uploaded.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fluidps.ops.selected_rows import SelectedRows


def add(total: Any, value: Any) -> Any:
    """`total` + `value` (None: nothing yet); SelectedRows keep every row, repeats too."""
    if total is None:
        return value.copy() if isinstance(value, (np.ndarray, SelectedRows)) else value
    if isinstance(value, SelectedRows):  # rows of every step, repeats kept (the pserver merges them)
        return SelectedRows(
            np.concatenate([total.rows, value.rows]), np.concatenate([total.value, value.value]), value.height
        )
    return total + value


def divide(total: Any, count: int) -> Any:
    if isinstance(total, SelectedRows):
        return SelectedRows(total.rows, (total.value / count).astype(total.value.dtype), total.height)
    return (total / count).astype(total.dtype)


def copy(value: Any) -> Any:
    """A copy of a gradient that shares no memory with it."""
    return value.copy() if isinstance(value, SelectedRows) else np.array(value, copy=True)


def total(values: list[Any]) -> Any:
    """The sum of several gradients of one variable."""
    out = None
    for value in values:
        out = add(out, value)
    return out


def mean(values: list[Any]) -> Any:
    """The mean of several gradients of one variable."""
    return divide(total(values), len(values))


class GradientSum:
    """The running sum of one send's gradients since its last upload."""

    def __init__(self, trainer_id: int, targets: tuple[tuple[str, str], ...]):
        self.trainer_id = trainer_id
        self.targets = targets  # (endpoint, name) of each gradient
        self.totals: list[Any] = [None] * len(targets)
        self.count = 0

    def add(self, values: list[Any]) -> None:
        self.totals = [add(t, v) for t, v in zip(self.totals, values, strict=True)]
        self.count += 1

    def take_mean(self) -> list[tuple[str, str, Any]]:
        """(endpoint, name, mean gradient) of every target; the sum starts again."""
        means = [divide(t, self.count) for t in self.totals]
        self.totals, self.count = [None] * len(self.targets), 0
        return [(ep, name, value) for (ep, name), value in zip(self.targets, means, strict=True)]
