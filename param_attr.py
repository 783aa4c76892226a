"""ParamAttr: how a layer should create one of its parameters.

May import: fluidps.errors
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fluidps.errors import BuilderError


@dataclass
class ParamAttr:
    """Name, initializer, learning-rate multiplier, regularizer and trainability
    of a parameter, as in Fluid. A layer's `param_attr` / `bias_attr` accepts
    a ParamAttr, a name, an initializer, None (defaults), or False (no bias)."""

    name: str | None = None
    initializer: Any = None
    learning_rate: float = 1.0
    regularizer: Any = None
    trainable: bool = True
    gradient_clip: Any = None
    do_model_average: bool = False

    @staticmethod
    def to_attr(arg: Any) -> ParamAttr | bool:
        """Normalize what a user passed as param_attr / bias_attr."""
        if arg is None:
            return ParamAttr()
        if arg is False:
            return False
        if isinstance(arg, ParamAttr):
            return arg
        if isinstance(arg, str):
            return ParamAttr(name=arg)
        if callable(arg):
            return ParamAttr(initializer=arg)
        raise BuilderError(
            f"cannot use {arg!r} as a ParamAttr (give a ParamAttr, a name, an initializer or False)"
        )
