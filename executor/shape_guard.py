"""Shapes checked before kernels run: what keeps a program from writing out of bounds.

Kernels are numba code, which does no bounds checks: a relu_grad given Out (4, 4096)
and Out@GRAD (1,) would read and write past its arrays. `verify` checks declarations,
but a declared batch dimension is -1, so x (4, 4096) and its gradient (3, 4096) both
fit [-1, 4096]. So before an op's kernel (or a compiled segment, whose fused loops
index several arrays by one index) runs, its shape inference runs on the shapes and
dtypes of the values it is actually given (through a segment, each op's results feed
the next op's), and a failure is an error naming the op; its kernel never sees them.

Inference runs once per shape signature (each input's kind, shape and dtype): a step with
the shapes of the step before costs a tuple and a comparison, with shapes seen before a
set lookup. A compiled segment compares its inputs' shapes with those last checked
itself, in its first compiled statements, and raises ops.lowering.ShapesChanged for the
guard to check new ones (a new dtype there is numba's: it compiles the segment for it). On a new signature the outputs
inference predicts are also sized: one larger than this machine's memory is refused
before anything is allocated, naming the attributes to check.
"""

from __future__ import annotations

import math
import os
import resource
from collections.abc import Sequence
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np

from fluidps.errors import Error, ExecutionError
from fluidps.ir.infer import VarInfo
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME, AttrType, VarType, dtype_name, to_numpy_dtype, to_vartype
from fluidps.ops import REGISTRY
from fluidps.ops.selected_rows import SelectedRows

# Signatures remembered per op or segment: a program whose shapes keep changing (a
# new batch size every step) pays inference each step, never unbounded memory.
CAPACITY = 64
# A dtype by its number: arrays numba makes carry dtype objects of their own, and comparing
# two dtype objects costs more than the rest of a signature.
_KIND_SHAPE_AND_DTYPE = attrgetter("__class__", "shape", "dtype.num")
_SIZE_ATTRS = (AttrType.INT, AttrType.INTS, AttrType.LONG, AttrType.LONGS)
_NOT_SIZES = frozenset({"op_role", "dtype", "out_dtype", "in_dtype", "seed"})


class Refused(Exception):
    """The guard refuses to run op #`index` of its block, for `reason` (a fluidps Error);
    `made`: what inference said of the values a compiled segment's earlier ops make."""

    def __init__(self, index: int, reason: Error, made: dict[str, VarInfo] | None = None):
        super().__init__(str(reason))
        self.index, self.reason, self.made = index, reason, made or {}


def signature(values: Sequence[Any]) -> tuple:
    """What inference reads of `values`: each one's kind, shape and dtype. A SelectedRows'
    shape is its height and row width: its row count varies with every batch and
    inference never reads it (its rows are checked against its height when it is made)."""
    return tuple(
        (v.__class__, getattr(v, "shape", None), getattr(getattr(v, "dtype", None), "num", None))
        for v in values
    )


def value_info(name: str, value: Any, declared: VarInfo | None) -> VarInfo | None:
    """What inference knows of a variable holding `value` (its declaration where the
    value says nothing: a missing value, a feed list, a reader)."""
    if isinstance(value, np.ndarray):
        kind, lod = VarType.LOD_TENSOR, 0 if declared is None else declared.lod_level
        return VarInfo(name, kind, _vartype(value.dtype, declared), tuple(value.shape), lod)
    if isinstance(value, SelectedRows):
        shape = (value.height, *value.value.shape[1:])
        return VarInfo(name, VarType.SELECTED_ROWS, _vartype(value.value.dtype, declared), shape)
    return declared


def _vartype(dtype: np.dtype, declared: VarInfo | None) -> VarType | None:
    try:
        return to_vartype(dtype)
    except Error:  # an element type fluidps has no name for: the declaration's
        return None if declared is None else declared.dtype


class ShapeGuard:
    """Ops `start` .. `stop - 1` of `block` (one op, or a compiled segment's), checked
    by their shape inference on the values of `names` (the inputs they read from
    outside) once per signature. `limit`: the most bytes one output may take."""

    def __init__(self, block: Block, start: int, stop: int, names: Sequence[str], limit: int):
        self.block, self.start, self.stop, self.limit = block, start, stop, limit
        self.names = list(dict.fromkeys(n for n in names if n != EMPTY_VAR_NAME))
        self._seen: set[tuple] = set()
        self._last: tuple | None = None  # the signature of the last run, checked
        # What a compiled segment compares its inputs with before it runs (ops.lowering.shape_matches):
        # each one's rank, then its dimensions, as last checked here (nothing yet: -1 matches nothing).
        self.shapes = np.full(1, -1, dtype=np.int64)

    def check_env(self, env: dict[str, Any]) -> None:
        """Check the op against the values `env` holds for its inputs; raises Refused."""
        try:  # (arrays and SelectedRows: a SelectedRows' .shape is its height and width)
            key = tuple(map(_KIND_SHAPE_AND_DTYPE, map(env.get, self.names)))
        except AttributeError:  # a missing value, a feed list, a reader, a hashed table
            key = signature([env.get(n) for n in self.names])
        # (== before the set: the last signature is the likeliest)
        if key != self._last:
            if key not in self._seen:
                self._learn(key, env)
            self._last = key

    def check_args(self, args: Sequence[Any], env: dict[str, Any]) -> None:
        """Check a compiled segment against `args`, the values of `names` in order, when
        the segment found their shapes changed (ops.lowering.ShapesChanged); then `shapes`
        holds theirs. (A value that is no array fails numba's dispatch before any compiled
        code runs, and the interpreter's per-op guards see it.)"""
        key = signature(args)
        if key not in self._seen:
            self._learn(key, env)
        dims = [x for a in args for x in (getattr(a, "ndim", 0), *getattr(a, "shape", ()))]
        self.shapes = np.array(dims, dtype=np.int64)

    def _learn(self, key: tuple, env: dict[str, Any]) -> None:
        made: dict[str, VarInfo] = {}  # through a segment: what its earlier ops make

        def lookup(name: str) -> VarInfo | None:
            if name in made:
                return made[name]
            var = self.block.find_var(name)
            return value_info(name, env.get(name), None if var is None else VarInfo.of(var))

        for index in range(self.start, self.stop):
            op = self.block.ops[index]
            try:
                results = REGISTRY.infer(op, lookup)
            except Error as e:
                raise Refused(index, ExecutionError(f"{e}: {_AT_RUN_TIME}"), made) from None
            except Exception as e:  # inference that cannot read these values cannot vouch for them
                said = "out of memory" if isinstance(e, MemoryError) else f"{type(e).__name__}: {e}"
                why = f"its shape inference cannot read the values it was given ({said})"
                raise Refused(index, ExecutionError(why), made) from None
            if (problem := too_large(op, results, self.limit)) is not None:
                raise Refused(index, ExecutionError(problem), made)
            made.update(results)
        if len(self._seen) >= CAPACITY:
            self._seen.clear()
        self._seen.add(key)


_AT_RUN_TIME = "the values it was given at run time do not fit together; check the feeds' shapes"


def check_declared(op: Operator, block: Block, limit: int) -> str | None:
    """Before `op`'s kernel is built (a builder may allocate a constant from the op's
    attributes): why its outputs, as declared and inferred, cannot be made here, or None."""

    def lookup(name: str) -> VarInfo | None:
        var = block.find_var(name)
        return None if var is None else VarInfo.of(var)

    try:
        results = REGISTRY.infer(op, lookup)
    except Exception:  # verify reports it; the kernel and the run-time guard say more
        return None
    return too_large(op, results, limit)


def too_large(op: Operator, results: dict[str, VarInfo], limit: int) -> str | None:
    """Why an output inference made for `op` is too large to allocate, or None."""
    for name, info in results.items():
        if info.type != VarType.LOD_TENSOR or info.shape is None or info.dtype is None:
            continue  # (a SelectedRows' shape is its table's, not what it allocates)
        if any(d < 0 for d in info.shape):
            continue
        try:
            size = math.prod(info.shape) * to_numpy_dtype(info.dtype).itemsize
        except Error:
            continue
        if size > limit:
            return (
                f"its output {name!r} would be {list(info.shape)} {dtype_name(info.dtype)} = {size:,} bytes, more "
                f"than the {limit:,} bytes of memory this machine can give; check {_suspects(op, info.shape)}"
            )
    return None


def _suspects(op: Operator, shape: tuple[int, ...]) -> str:
    """The attributes a size may come from: those holding one of `shape`'s dimensions,
    else every integer attribute, else the inputs."""
    sizes = [
        n for n in op.attr_names if op.attr_type(n) in _SIZE_ATTRS and n not in _NOT_SIZES and "role" not in n
    ]
    dims = set(shape)
    hits = [n for n in sizes if dims & set(v if isinstance(v := op.attr(n), list) else [v])]
    named = hits or sizes
    if not named:
        return "its inputs' shapes"
    attrs = ", ".join(f"{n}={op.attr(n)}" for n in named)
    return f"its attribute{'s' if len(named) > 1 else ''} {attrs}"


def memory_limit(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """The most bytes one allocation can hope for: the least of the memory available
    (MemAvailable), the cgroup's memory.max (v2) or memory.limit_in_bytes (v1) and the
    address-space limit (ulimit -v); physical memory when none can be read."""
    bounds = []
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                bounds.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            bounds.append(int(text))
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        bounds.append(soft)
    if not bounds:
        bounds.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    return min(bounds)
