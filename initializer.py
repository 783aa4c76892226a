"""Initializers: each appends the op that fills a parameter to the startup program.

`seed=0` means "use the program's random_seed", as in Fluid, so setting
`startup.random_seed` makes a whole model's initialization reproducible.

May import: fluidps.errors, fluidps.ir, fluidps.ops
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fluidps.errors import BuilderError
from fluidps.ir.program import Block
from fluidps.ir.variable import Variable
from fluidps.ops import REGISTRY


def _seed(seed: int, block: Block) -> int:
    return seed or block.program.random_seed


def _fill(block: Block, var: Variable, op_type: str, attrs: dict) -> None:
    attrs = {"shape": list(var.shape), "dtype": int(var.dtype), **attrs}
    REGISTRY.append_op(block, op_type, outputs={"Out": var}, attrs=attrs)


@dataclass(frozen=True)
class Constant:
    """Every element equals `value`."""

    value: float = 0.0
    force_cpu: bool = False

    def __call__(self, var: Variable, block: Block) -> None:
        _fill(block, var, "fill_constant", {"value": float(self.value), "force_cpu": self.force_cpu})


@dataclass(frozen=True)
class Uniform:
    """Uniform on [low, high)."""

    low: float = -1.0
    high: float = 1.0
    seed: int = 0

    def __call__(self, var: Variable, block: Block) -> None:
        if self.low > self.high:
            raise BuilderError(f"Uniform initializer of {var.name!r}: low {self.low} > high {self.high}")
        _fill(
            block, var, "uniform_random", {"min": self.low, "max": self.high, "seed": _seed(self.seed, block)}
        )


@dataclass(frozen=True)
class Normal:
    """Gaussian with mean `loc` and standard deviation `scale`."""

    loc: float = 0.0
    scale: float = 1.0
    seed: int = 0

    def __call__(self, var: Variable, block: Block) -> None:
        attrs = {"mean": self.loc, "std": self.scale, "seed": _seed(self.seed, block)}
        _fill(block, var, "gaussian_random", attrs)


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """(fan_in, fan_out) as Fluid computes them: [in, out] for a matrix,
    channels times kernel area for a conv filter [out_c, in_c, kh, kw]."""
    if not shape:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    if len(shape) == 2:
        return shape[0], shape[1]
    receptive = math.prod(shape[2:])
    return shape[1] * receptive, shape[0] * receptive


@dataclass(frozen=True)
class Xavier:
    """Glorot initialization: uniform with limit sqrt(6 / (fan_in + fan_out)), or
    normal with std sqrt(2 / (fan_in + fan_out)). Fluid's default for weights."""

    uniform: bool = True
    fan_in: int | None = None
    fan_out: int | None = None
    seed: int = 0

    def __call__(self, var: Variable, block: Block) -> None:
        fan_in, fan_out = fans(var.shape)
        fan_in = self.fan_in or fan_in
        fan_out = self.fan_out or fan_out
        if self.uniform:
            limit = math.sqrt(6.0 / (fan_in + fan_out))
            Uniform(-limit, limit, self.seed)(var, block)
        else:
            Normal(0.0, math.sqrt(2.0 / (fan_in + fan_out)), self.seed)(var, block)


# Fluid's longer names.
ConstantInitializer = Constant
UniformInitializer = Uniform
NormalInitializer = Normal
XavierInitializer = Xavier
