"""assign and cast: a copy of a tensor, the second converted to another dtype;
merge_selected_rows and get_tensor_from_selected_rows: SelectedRows made
canonical (each row once) or handed over as their dense value."""

from __future__ import annotations

from typing import Any

import numpy as np

from fluidps.errors import ExecutionError
from fluidps.ir.infer import InferContext, VarInfo
from fluidps.ir.opschema import GradContext, GradOpDesc
from fluidps.ir.types import ELEMENT_TYPES, VarType, to_numpy_dtype
from fluidps.ops.defs import In, Int, Out, backend_hints
from fluidps.ops.kernel import Env, KernelOp, Runner
from fluidps.ops.registry import OpFamily
from fluidps.ops.selected_rows import SelectedRows

family = OpFamily("copy")


def _assign_grad(ctx: GradContext) -> list[GradOpDesc]:
    dx = ctx.input_grad("X")
    return [GradOpDesc("assign", {"X": ctx.output_grad("Out")}, {"Out": dx})] if dx else []


@family.op("assign", inputs=[In("X", opt=True)], outputs=[Out("Out")], grad=_assign_grad)
def _infer_assign(ctx: InferContext) -> None:
    """Out = X (tensors and SelectedRows alike)."""
    ctx.share("Out", ctx.input("X"))


def _cast_grad(ctx: GradContext) -> list[GradOpDesc]:
    dx = ctx.input_grad("X")
    if not dx:
        return []
    attrs = {"in_dtype": ctx.op.attr("out_dtype"), "out_dtype": ctx.op.attr("in_dtype")}
    return [GradOpDesc("cast", {"X": ctx.output_grad("Out")}, {"Out": dx}, attrs)]


@family.op(
    "cast",
    inputs=[In("X")],
    outputs=[Out("Out")],
    attrs=[Int("in_dtype"), Int("out_dtype"), *backend_hints("use_mkldnn", "use_onednn")],
    grad=_cast_grad,
)
def _infer_cast(ctx: InferContext) -> None:
    """Out = X converted to `out_dtype` (a VarType number)."""
    x = ctx.input("X")
    code = ctx.attr("out_dtype")
    if code not in {int(t) for t in ELEMENT_TYPES}:
        names = ", ".join(f"{int(t)} ({t.name})" for t in sorted(ELEMENT_TYPES))
        ctx.fail(f"out_dtype={code} is not an element type; use one of {names}")
    ctx.set_output("Out", x.shape, VarType(code), type=x.type)


def _sparse_input(ctx: InferContext) -> VarInfo:
    x = ctx.input("X")
    if x.type != VarType.SELECTED_ROWS:
        ctx.fail(f"X must be a SelectedRows variable, got {x.type.name}")
    return x


@family.op("merge_selected_rows", inputs=[In("X")], outputs=[Out("Out")])
def _infer_merge_selected_rows(ctx: InferContext) -> None:
    """Out = X with each row once (sorted), the values of repeated rows summed."""
    ctx.share("Out", _sparse_input(ctx))


@family.op("get_tensor_from_selected_rows", inputs=[In("X")], outputs=[Out("Out")])
def _infer_get_tensor(ctx: InferContext) -> None:
    """Out = the value tensor of SelectedRows X: one row per entry of X's rows."""
    x = _sparse_input(ctx)
    ctx.set_output("Out", (-1, *x.shape[1:]), x.dtype)


# -- kernels: copies (numpy); a copy, not a view, so later in-place updates of
# either side (optimizers update parameters in place) never leak to the other.


def _copy(value: Any) -> Any:
    if isinstance(value, SelectedRows):
        return value.copy()
    if isinstance(value, list):  # a tensor array
        return [_copy(v) for v in value]
    return np.array(value, copy=True)


@family.kernel("assign")
def _assign_kernel(op: KernelOp) -> Runner:
    out_name = op.output("Out")
    if not op.has_input("X"):
        # Fluid's assign does nothing when X is absent.
        return lambda env: None
    x_name = op.input("X")

    def run(env: Env) -> None:
        env[out_name] = _copy(env[x_name])

    return run


@family.kernel("cast")
def _cast_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")
    dtype = to_numpy_dtype(VarType(op.attr("out_dtype")))

    def run(env: Env) -> None:
        x = env[x_name]
        if isinstance(x, SelectedRows):
            env[out_name] = SelectedRows(x.rows.copy(), x.value.astype(dtype), x.height)
        else:
            # astype truncates floats toward zero, as Fluid's static_cast does.
            env[out_name] = np.asarray(x).astype(dtype)

    return run


def _selected_rows(op: KernelOp, value: Any) -> SelectedRows:
    if not isinstance(value, SelectedRows):
        raise ExecutionError(f"{op.type}: X must be a SelectedRows, got {type(value).__name__}")
    return value


@family.kernel("merge_selected_rows")
def _merge_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")

    def run(env: Env) -> None:
        env[out_name] = _selected_rows(op, env[x_name]).merged()

    return run


@family.kernel("get_tensor_from_selected_rows")
def _get_tensor_kernel(op: KernelOp) -> Runner:
    x_name, out_name = op.input("X"), op.output("Out")

    def run(env: Env) -> None:
        env[out_name] = _selected_rows(op, env[x_name]).value.copy()

    return run
