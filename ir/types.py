"""Enums and naming conventions of the Fluid wire format, as Python values.

The numbers are those of `framework.proto`; tests check the two never drift.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from fluidps.errors import ProgramError


class VarType(enum.IntEnum):
    """`VarType.Type`: both the element types of tensors and the kinds of variable."""

    BOOL = 0
    INT16 = 1
    INT32 = 2
    INT64 = 3
    FP16 = 4
    FP32 = 5
    FP64 = 6
    LOD_TENSOR = 7
    SELECTED_ROWS = 8
    FEED_MINIBATCH = 9
    FETCH_LIST = 10
    STEP_SCOPES = 11
    LOD_RANK_TABLE = 12
    LOD_TENSOR_ARRAY = 13
    PLACE_LIST = 14
    READER = 15
    RAW = 17
    TUPLE = 18
    SIZE_T = 19
    UINT8 = 20
    INT8 = 21
    BF16 = 22
    COMPLEX64 = 23
    COMPLEX128 = 24
    STRING = 25
    STRINGS = 26
    VOCAB = 27
    FEED_LIST = 28
    PSTRING = 29
    SPARSE_COO = 30
    SPARSE_CSR = 31
    FP8_E4M3FN = 32
    FP8_E5M2 = 33
    UINT16 = 36
    UINT32 = 37
    UINT64 = 38


class AttrType(enum.IntEnum):
    """`AttrType`: how an op attribute's value is stored in `OpDesc.Attr`."""

    INT = 0
    FLOAT = 1
    STRING = 2
    INTS = 3
    FLOATS = 4
    STRINGS = 5
    BOOLEAN = 6
    BOOLEANS = 7
    BLOCK = 8
    LONG = 9
    BLOCKS = 10
    LONGS = 11
    FLOAT64S = 12
    VAR = 13
    VARS = 14
    FLOAT64 = 15
    SCALAR = 16
    SCALARS = 17


class OpRole(enum.IntFlag):
    """The `op_role` attribute, as Fluid encodes it. The loss-gradient seed is
    `Backward | Loss` (257); the transpiler finds optimizer ops by `Optimize`."""

    Forward = 0
    Backward = 1
    Optimize = 2
    RPC = 4
    Dist = 8
    LRSched = 16
    Loss = 256


# Variable kinds whose VarDesc carries an element type and dims.
TENSOR_KINDS = frozenset({VarType.LOD_TENSOR, VarType.SELECTED_ROWS, VarType.LOD_TENSOR_ARRAY})

# Fluid's naming conventions.
GRAD_SUFFIX = "@GRAD"
EMPTY_VAR_NAME = "@EMPTY@"  # placeholder argument: "this gradient is not wanted"
# A pipeline stage's gradient summed over a step's micro-batches: x@GRAD@MERGED (Paddle's name)
MERGED_SUFFIX = "@MERGED"
RENAME_SUFFIX = "@RENAME@"  # repeated gradients are renamed x@GRAD@RENAME@0, ... then summed
OP_ROLE_ATTR = "op_role"
OP_ROLE_VAR_ATTR = "op_role_var"
OP_DEVICE_ATTR = "op_device"  # Paddle's: where an op runs ("gpu:0"); here a pipeline stage ("stage:0")
FEED_VAR_NAME = "feed"
# listen_and_serv's distributed_mode (Fluid's SYNC 0 and ASYNC 1; fluidps adds SSP 4).
DISTRIBUTED_MODES = {0: "sync", 1: "async", 4: "ssp"}
FETCH_VAR_NAME = "fetch"


def grad_var_name(name: str) -> str:
    """`w` -> `w@GRAD`."""
    return name + GRAD_SUFFIX


_NUMPY_OF: dict[VarType, np.dtype] = {
    VarType.BOOL: np.dtype(np.bool_),
    VarType.INT8: np.dtype(np.int8),
    VarType.INT16: np.dtype(np.int16),
    VarType.INT32: np.dtype(np.int32),
    VarType.INT64: np.dtype(np.int64),
    VarType.UINT8: np.dtype(np.uint8),
    VarType.UINT16: np.dtype(np.uint16),
    VarType.UINT32: np.dtype(np.uint32),
    VarType.UINT64: np.dtype(np.uint64),
    VarType.FP16: np.dtype(np.float16),
    VarType.FP32: np.dtype(np.float32),
    VarType.FP64: np.dtype(np.float64),
    VarType.COMPLEX64: np.dtype(np.complex64),
    VarType.COMPLEX128: np.dtype(np.complex128),
}
_VARTYPE_OF: dict[np.dtype, VarType] = {v: k for k, v in _NUMPY_OF.items()}
ELEMENT_TYPES = frozenset(_NUMPY_OF) | {VarType.BF16, VarType.FP8_E4M3FN, VarType.FP8_E5M2}
FLOAT_TYPES = frozenset({VarType.FP16, VarType.BF16, VarType.FP32, VarType.FP64})


def to_vartype(dtype: Any) -> VarType:
    """Accept a VarType, a numpy dtype or type, or a name such as "float32" / "int64"."""
    if isinstance(dtype, VarType):
        return dtype
    if isinstance(dtype, str) and dtype.upper() in VarType.__members__:
        member = VarType[dtype.upper()]
        if member in ELEMENT_TYPES:
            return member
    try:
        return _VARTYPE_OF[np.dtype(dtype)]
    except (TypeError, KeyError):
        raise ProgramError(
            f"unsupported dtype {dtype!r}; use one of float32, float64, float16, int64, "
            f"int32, int16, int8, uint8, bool"
        ) from None


def to_numpy_dtype(dtype: Any) -> np.dtype:
    """The numpy dtype of an element VarType (or anything `to_vartype` accepts)."""
    vt = to_vartype(dtype)
    if vt not in _NUMPY_OF:
        raise ProgramError(f"dtype {vt.name} has no numpy equivalent")
    return _NUMPY_OF[vt]


def dtype_name(dtype: VarType | None) -> str:
    """A short readable name: FP32 -> "float32"; None -> "?"."""
    if dtype is None:
        return "?"
    if dtype in _NUMPY_OF:
        return _NUMPY_OF[dtype].name
    return dtype.name.lower()
