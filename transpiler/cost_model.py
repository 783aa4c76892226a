"""How long ops and messages take and what a stage keeps: the model placement passes
minimize (fluidps.transpiler.partition).

Three parts, each data that is measured once and stored:

- MachineModel: the machine's one-thread matrix-product rate and memory bandwidth (the
  roofline analytic op times use), a fixed cost per op, and a message's time over the
  real transport, alpha + beta * bytes: what `fluidps calibrate` measures and writes
  to `calibration_path()`;
- OpProfile: op times measured by running a program (fluidps.executor.measure.op_profile),
  keyed by `op_signature` (type, attributes, shapes and dtypes): an op of another
  program with the same signature costs the same;
- CostModel: an op's time (measured when its profile has it, else from the roofline),
  a message's, and the bytes ops keep.

Nothing falls back silently: a model without calibration, or a profile measured on
another machine, says so in one CostModelWarning and uses what is left.
"""

from __future__ import annotations

import json
import math
import os
import platform
import warnings
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from fluidps.errors import Error
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block
from fluidps.ir.types import EMPTY_VAR_NAME, OP_DEVICE_ATTR, OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, to_numpy_dtype
from fluidps.transpiler.op_costs import work

CALIBRATION_ENV = "FLUIDPS_CALIBRATION"
PROFILE_ENV = "FLUIDPS_OP_PROFILE"
_FORMAT = 1
# Attributes that say where or why an op runs, not what it computes.
_PLACEMENT_ATTRS = frozenset({OP_ROLE_ATTR, OP_ROLE_VAR_ATTR, OP_DEVICE_ATTR, "op_namescope", "op_callstack"})


class CostModelWarning(UserWarning):
    """A cost model used less than it was asked to (no calibration, a foreign profile)."""


def machine_id() -> str:
    """What makes op times differ between machines: the processor model and core count."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model} x{os.cpu_count() or 1}"


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "fluidps"


def calibration_path() -> Path:
    """FLUIDPS_CALIBRATION, else ~/.cache/fluidps/calibration.json (XDG_CACHE_HOME respected)."""
    return (
        Path(os.environ[CALIBRATION_ENV])
        if os.environ.get(CALIBRATION_ENV)
        else _cache_dir() / "calibration.json"
    )


def profile_path() -> Path:
    """FLUIDPS_OP_PROFILE, else ~/.cache/fluidps/op_profile.json."""
    return Path(os.environ[PROFILE_ENV]) if os.environ.get(PROFILE_ENV) else _cache_dir() / "op_profile.json"


@dataclass(frozen=True)
class MachineModel:
    """Rates of one machine, one thread: `gemm_flops` (FLOP/s of a float32 matrix
    product), `bandwidth` (bytes/s a copy moves), `op_overhead_s` (what running any op
    costs), `run_overhead_s` (what an executor's run of a program costs besides its
    ops), `stage_overhead_s` (what a pipeline stage process spends on each micro-batch
    besides its ops and messages: its runner, its channel, its serving thread, running
    its two programs). A message of b bytes between two processes arrives alpha_s +
    beta_s * b after it is sent, and costs each end send_cpu_s + stage_byte_s * b of its
    own time (encoding or decoding, copying; stage_byte_s as a stage process pays it,
    beta_s when not measured): the rest of alpha_s is waiting, which a pipeline overlaps
    with other micro-batches' work once it is full. `wait_factor`: how many times slower a stage
    runs when it waits for a busier peer between micro-batches than its profiled ops say
    (its core goes idle, the busy peer empties the caches they share; measured by
    `fluidps calibrate` against this model's own prediction of a waiting stage; 1 when
    not measured, at most 2): the ops of a stage of time t in a step whose slowest stage
    takes T count (1 + (wait_factor - 1) * (1 - t / T)) times their time, so the slowest
    stage keeps its time and none overtakes it. (A stage's own cost a micro-batch and its
    messages' are not slowed: they were measured in jobs whose stages wait too.)"""

    gemm_flops: float
    bandwidth: float
    op_overhead_s: float
    run_overhead_s: float
    stage_overhead_s: float
    alpha_s: float
    beta_s: float
    send_cpu_s: float
    stage_byte_s: float | None = None
    wait_factor: float = 1.0
    machine: str = ""
    calibrated: bool = False

    def __post_init__(self) -> None:
        for name in ("gemm_flops", "bandwidth"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise Error(f"MachineModel.{name} must be a positive number, got {value!r}")
        for name in (
            "op_overhead_s",
            "run_overhead_s",
            "stage_overhead_s",
            "alpha_s",
            "beta_s",
            "send_cpu_s",
        ):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                raise Error(f"MachineModel.{name} must be a number >= 0, got {value!r}")
        factor = self.wait_factor
        if not (isinstance(factor, int | float) and 1 <= factor <= 2):
            raise Error(f"MachineModel.wait_factor must be a number from 1 to 2, got {factor!r}")
        byte = self.stage_byte_s
        if byte is not None and not (isinstance(byte, int | float) and math.isfinite(byte) and byte >= 0):
            raise Error(f"MachineModel.stage_byte_s must be a number >= 0 or None, got {byte!r}")

    def message_seconds(self, nbytes: float) -> float:
        """From sending a message of `nbytes` to its arrival."""
        return self.alpha_s + self.beta_s * nbytes

    def message_cpu_seconds(self, nbytes: float) -> float:
        """What one end of a message of `nbytes` spends on it."""
        per_byte = self.beta_s if self.stage_byte_s is None else self.stage_byte_s
        return self.send_cpu_s + per_byte * nbytes

    def save(self, path: Path | str | None = None) -> Path:
        path = Path(path) if path is not None else calibration_path()
        _write_json(path, {"format": _FORMAT, "kind": "calibration", **asdict(self)})
        return path


# What an uncalibrated model assumes: a modest core, a loopback message of ~100 us.
ANALYTIC = MachineModel(
    gemm_flops=50e9,
    bandwidth=5e9,
    op_overhead_s=3e-6,
    run_overhead_s=50e-6,
    stage_overhead_s=300e-6,
    alpha_s=100e-6,
    beta_s=1e-9,
    send_cpu_s=30e-6,
)


def load_machine(path: Path | str | None = None) -> MachineModel:
    """The calibration stored at `path` (default `calibration_path()`); when there is
    none, or it was measured on another machine, the analytic defaults, with a
    CostModelWarning saying so. A damaged file is an Error naming it."""
    path = Path(path) if path is not None else calibration_path()
    if not path.exists():
        warnings.warn(
            f"no transport calibration at {path}: placement uses analytic message and op times; "
            "run `fluidps calibrate` once on this machine",
            CostModelWarning,
            stacklevel=2,
        )
        return ANALYTIC
    data = _read_json(path, "calibration")
    optional = ("stage_byte_s", "wait_factor", "calibrated")  # (calibrations from before they were measured)
    measured = [f.name for f in fields(MachineModel) if f.name not in optional]
    try:
        model = MachineModel(
            **{k: data[k] for k in measured},
            stage_byte_s=data.get("stage_byte_s"),
            wait_factor=data.get("wait_factor", 1.0),
            calibrated=True,
        )
    except (KeyError, TypeError, Error) as e:
        raise Error(f"{path}: not a fluidps calibration ({e}); run `fluidps calibrate` again") from None
    if model.machine != machine_id():
        warnings.warn(
            f"the calibration at {path} was measured on {model.machine!r}, not this machine "
            f"({machine_id()!r}): placement uses analytic times; run `fluidps calibrate` here",
            CostModelWarning,
            stacklevel=2,
        )
        return ANALYTIC
    return model


def op_signature(block: Block, op: Operator, rows: int) -> str:
    """What an op's time depends on: its type, the attributes that say what it computes,
    and the dtype and shape of each variable it reads and writes (-1 read as `rows`)."""
    attrs = []
    for name in sorted(op.attr_names):
        if name in _PLACEMENT_ATTRS:
            continue
        value = op.attr(name)
        if isinstance(value, bool | int | float | str) or (
            isinstance(value, list) and all(isinstance(v, bool | int | float | str) for v in value)
        ):
            attrs.append(f"{name}={value}")
    slots = []
    for kind, mapping in (("in", op.inputs), ("out", op.outputs)):
        for slot in sorted(mapping):
            described = [_describe(block, n, rows) for n in mapping[slot] if n != EMPTY_VAR_NAME]
            slots.append(f"{kind}:{slot}={','.join(described)}")
    return f"{op.type}|{';'.join(attrs)}|{';'.join(slots)}"


def _describe(block: Block, name: str, rows: int) -> str:
    var = block.find_var(name)
    if var is None or var.dtype is None:
        return "?"
    return f"{to_numpy_dtype(var.dtype).str}{list(resolved_shape(block, name, rows))}"


def resolved_shape(block: Block, name: str, rows: int) -> tuple[int, ...]:
    var = block.find_var(name)
    if var is None or var.shape is None:
        return ()
    return tuple(rows if d < 0 else d for d in var.shape)


def var_bytes(block: Block, name: str, rows: int) -> int:
    var = block.find_var(name)
    if var is None or var.dtype is None:
        return 0
    return (
        math.prod(max(d, 1) for d in resolved_shape(block, name, rows)) * to_numpy_dtype(var.dtype).itemsize
    )


@dataclass
class OpProfile:
    """Measured seconds of ops by signature, on `machine`."""

    machine: str
    seconds: dict[str, float] = field(default_factory=dict)

    def save(self, path: Path | str | None = None) -> Path:
        """Write it, merged into what `path` (default `profile_path()`) holds for the same machine."""
        path = Path(path) if path is not None else profile_path()
        merged = dict(self.seconds)
        if path.exists():
            earlier = OpProfile.load(path)
            if earlier.machine == self.machine:
                merged = {**earlier.seconds, **self.seconds}
        _write_json(
            path, {"format": _FORMAT, "kind": "op_profile", "machine": self.machine, "seconds": merged}
        )
        return path

    @classmethod
    def load(cls, path: Path | str) -> OpProfile:
        data = _read_json(Path(path), "op_profile")
        seconds = data.get("seconds")
        if not isinstance(data.get("machine"), str) or not isinstance(seconds, dict):
            raise Error(f"{path}: not a fluidps op profile; measure one again with `fluidps place --measure`")
        if not all(isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in seconds.values()):
            raise Error(f"{path}: an op profile's times must be seconds >= 0")
        return cls(data["machine"], {str(k): float(v) for k, v in seconds.items()})


def load_profile(path: Path | str | None = None) -> OpProfile | None:
    """The op profile at `path` (default `profile_path()`, None when there is none).
    One measured on another machine is set aside with a CostModelWarning; one asked for
    by `path` that does not exist is an Error."""
    if path is None:
        path = profile_path()
        if not path.exists():
            return None
    elif not Path(path).exists():
        raise Error(f"no op profile at {path}: measure one with `fluidps place --measure` or leave it out")
    profile = OpProfile.load(path)
    if profile.machine != machine_id():
        warnings.warn(
            f"the op profile at {path} was measured on {profile.machine!r}, not this machine: placement "
            "uses analytic op times; measure again here (`fluidps place --measure`)",
            CostModelWarning,
            stacklevel=2,
        )
        return None
    return profile


class CostModel:
    """Seconds of an op (measured, else analytic), of a message, and bytes of a value."""

    def __init__(self, machine: MachineModel = ANALYTIC, profile: OpProfile | None = None):
        self.machine = machine
        self.profile = profile

    @classmethod
    def load(cls, calibration: Path | str | None = None, profile: Path | str | None = None) -> CostModel:
        """This machine's stored calibration and op profile (see load_machine, load_profile)."""
        return cls(load_machine(calibration), load_profile(profile))

    def measured(self, block: Block, op: Operator, rows: int) -> float | None:
        if self.profile is None:
            return None
        return self.profile.seconds.get(op_signature(block, op, rows))

    def op_seconds(self, block: Block, op: Operator, rows: int) -> float:
        """One run of `op` on `rows` rows: measured, else max(FLOPs / rate, bytes / bandwidth)
        plus the per-op cost."""
        seconds = self.measured(block, op, rows)
        if seconds is not None:
            return seconds
        shapes, sizes = {}, {}
        for name in (*op.input_arg_names, *op.output_arg_names):
            if name != EMPTY_VAR_NAME and (var := block.find_var(name)) is not None and var.dtype is not None:
                shapes[name] = resolved_shape(block, name, rows)
                sizes[name] = to_numpy_dtype(var.dtype).itemsize
        flops, moved = work(op, shapes, sizes)
        m = self.machine
        return m.op_overhead_s + max(flops / m.gemm_flops, moved / m.bandwidth)

    def message_seconds(self, nbytes: float) -> float:
        return self.machine.message_seconds(nbytes)

    def message_cpu_seconds(self, nbytes: float) -> float:
        return self.machine.message_cpu_seconds(nbytes)


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(partial, path)  # (a reader never sees half a file)


def _read_json(path: Path, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise Error(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict) or data.get("kind") != kind or data.get("format") != _FORMAT:
        raise Error(f"{path}: not a fluidps {kind.replace('_', ' ')} (format {_FORMAT})")
    return data
