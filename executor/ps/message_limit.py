"""The largest message a pserver accepts, derived from what it serves.

ZeroMQ drops a message larger than a socket's limit unread, with its sender's
connection, before allocating for it. A pserver's limit follows its plan rather
than a fixed 16 GiB: a message to it carries at most its gradients (a step's SEND)
or its variables (a SET loading them), so twice the bytes of both bounds every
legitimate one, with a floor for small models. A variable with a dimension of
unknown size (a hashed table's rows, which grow with the ids seen; a sparse
gradient's batch rows) counts as UNBOUNDED_BYTES. FLUIDPS_MAX_MESSAGE_BYTES (or
RpcSettings.max_message_bytes) set by hand wins.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from fluidps.ir.types import to_numpy_dtype

FLOOR = 64 << 20
HEADROOM = 2
UNBOUNDED_BYTES = 1 << 30


def variable_bytes(var: Any) -> int:
    """The most bytes `var` (a VarDesc-like: shape, dtype) takes on the wire."""
    if var is None or var.shape is None or var.dtype is None:
        return UNBOUNDED_BYTES
    shape = tuple(var.shape)
    if any(d < 0 for d in shape):
        return UNBOUNDED_BYTES
    itemsize = np.dtype(to_numpy_dtype(var.dtype)).itemsize
    return math.prod(shape) * itemsize


def message_limit(variables: Mapping[str, Any], names: Iterable[str]) -> int:
    """The message limit of a pserver serving or optimizing `names` of `variables`."""
    return max(FLOOR, HEADROOM * sum(variable_bytes(variables.get(n)) for n in set(names)))
