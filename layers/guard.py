"""`program_guard`: which programs the builder appends to, held in a context variable.

There is no global default program. Layers called outside a guard fail with
an error saying how to open one.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

from fluidps.errors import BuilderError
from fluidps.ir.devices import parse_device
from fluidps.ir.program import Program

_PROGRAMS: contextvars.ContextVar[tuple[Program, Program | None] | None] = contextvars.ContextVar(
    "fluidps_programs", default=None
)


@contextmanager
def program_guard(main_program: Program, startup_program: Program | None = None) -> Iterator[None]:
    """Build into `main_program`; parameter initializers go to `startup_program`.

    Guards nest; leaving one restores the programs of the enclosing guard.
    """
    if not isinstance(main_program, Program):
        raise BuilderError(f"program_guard needs a Program, got {type(main_program).__name__}")
    if startup_program is not None and not isinstance(startup_program, Program):
        raise BuilderError(f"startup_program must be a Program, got {type(startup_program).__name__}")
    token = _PROGRAMS.set((main_program, startup_program))
    try:
        yield
    finally:
        _PROGRAMS.reset(token)


def current_programs(layer: str) -> tuple[Program, Program | None]:
    """(main, startup) of the innermost program_guard; `layer` names the caller in errors."""
    programs = _PROGRAMS.get()
    if programs is None:
        raise BuilderError(
            f"{layer} needs a program to build into: wrap the model code in "
            "`with fluidps.program_guard(main_program, startup_program):`"
        )
    return programs


# -- device_guard ---------------------------------------------------------------------------

_DEVICE: contextvars.ContextVar[str | None] = contextvars.ContextVar("fluidps_device", default=None)


@contextmanager
def device_guard(device: str | None = None) -> Iterator[None]:
    """Put the ops layers build inside it on `device`: "stage:k" is pipeline stage k
    (fluidps.optimizer.PipelineOptimizer); Paddle's "gpu:k" (and its other devices'
    "xpu:k", ...) mean stage k too, and "cpu" or None no stage. It sets Paddle's own
    `op_device` attribute, so Paddle's pipeline programs read here and ours in Paddle.
    Guards nest; leaving one restores the enclosing guard's device."""
    parse_device(device or "", "device_guard")  # (checked now, where the mistake is)
    token = _DEVICE.set(device or None)
    try:
        yield
    finally:
        _DEVICE.reset(token)


def current_device() -> str | None:
    """The device of the innermost device_guard (None outside any)."""
    return _DEVICE.get()
