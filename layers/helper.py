"""LayerHelper: what every layer does: name itself, create parameters and
temporaries, append checked ops, add a bias and an activation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fluidps.errors import BuilderError
from fluidps.initializer import Constant, Xavier
from fluidps.ir.operator import Operator
from fluidps.ir.program import Block
from fluidps.ir.types import OP_DEVICE_ATTR, VarType, to_vartype
from fluidps.ir.variable import Parameter, Variable
from fluidps.layers.guard import current_device, current_programs
from fluidps.ops import REGISTRY
from fluidps.param_attr import ParamAttr

ACTIVATIONS = ("relu", "sigmoid", "tanh", "exp", "log", "sqrt", "square", "softmax")


class LayerHelper:
    """Builds one layer: `fc` -> names `fc_0`, `fc_0.w_0`, `fc_0.tmp_0`, ..."""

    def __init__(self, layer_type: str, name: str | None = None):
        self.layer_type = layer_type
        self.main, self.startup = current_programs(f"fluidps.layers.{layer_type}")
        self.name = name or self.main.unique_name(layer_type)

    @property
    def block(self) -> Block:
        return self.main.current_block()

    def check_variable(self, value: Any, arg: str) -> Variable:
        """`value` must be a Variable of the program being built."""
        if not isinstance(value, Variable):
            raise BuilderError(f"{self.layer_type}: {arg} must be a Variable, got {type(value).__name__}")
        if value.block.program is not self.main:
            raise BuilderError(f"{self.layer_type}: {arg} ({value.name}) belongs to another program")
        if value.shape is None:
            raise BuilderError(f"{self.layer_type}: {arg} ({value.name}) has no shape")
        return value

    def create_parameter(
        self,
        attr: ParamAttr,
        shape: Sequence[int],
        dtype: Any,
        *,
        is_bias: bool = False,
        default_initializer: Any = None,
    ) -> Parameter:
        """A parameter in the main program's global block, initialized by an op
        appended to the startup program."""
        if self.startup is None:
            raise BuilderError(
                f"{self.layer_type} creates parameters: pass a startup program to program_guard(main, startup)"
            )
        shape = [int(d) for d in shape]
        if any(d <= 0 for d in shape):
            raise BuilderError(f"{self.layer_type}: parameter shape {shape} must be fully known and positive")
        name = attr.name or self.main.unique_name(f"{self.name}.{'b' if is_bias else 'w'}")
        init = attr.initializer or default_initializer or (Constant(0.0) if is_bias else Xavier())
        fields = dict(
            trainable=attr.trainable,
            regularizer=attr.regularizer,
            learning_rate=attr.learning_rate,
            gradient_clip=attr.gradient_clip,
        )
        startup_block = self.startup.global_block()
        if name not in startup_block.vars:
            startup_block.create_parameter(name, shape, dtype, initializer=init, **fields)
        main_block = self.main.global_block()
        if name in main_block.vars:
            return self._shared_parameter(main_block.vars[name], shape)
        param = main_block.create_parameter(name, shape, dtype, **fields)
        param.initializer = init
        return param

    def _shared_parameter(self, var: Variable, shape: list[int]) -> Parameter:
        # A ParamAttr naming an existing parameter shares it (Fluid's weight sharing).
        if not isinstance(var, Parameter) or list(var.shape) != shape:
            raise BuilderError(
                f"{self.layer_type}: {var.name!r} already exists as {var!r}; cannot reuse it as a {shape} parameter"
            )
        return var

    def create_tmp(self, dtype: Any, *, stop_gradient: bool = False) -> Variable:
        """A temporary output (`<layer>.tmp_N`); its shape comes from inference."""
        name = self.main.unique_name(f"{self.name}.tmp")
        return self.block.create_var(name, dtype=to_vartype(dtype), stop_gradient=stop_gradient)

    def append_op(
        self,
        type: str,
        inputs: Mapping[str, Any] | None = None,
        outputs: Mapping[str, Any] | None = None,
        attrs: Mapping[str, Any] | None = None,
    ) -> Operator:
        device = current_device()
        if device is not None and not (attrs and OP_DEVICE_ATTR in attrs):
            attrs = {**(attrs or {}), OP_DEVICE_ATTR: device}
        return REGISTRY.append_op(self.block, type, inputs, outputs, attrs)

    def unary(self, op_type: str, x: Variable, attrs: Mapping[str, Any] | None = None) -> Variable:
        """Append `op_type(X=x) -> Out` and return Out."""
        out = self.create_tmp(x.dtype)
        self.append_op(op_type, {"X": x}, {"Out": out}, attrs)
        return out

    def append_bias(
        self, x: Variable, bias_attr: Any, dim_start: int = 1, dim_end: int | None = None
    ) -> Variable:
        """x + b, with b shaped x.shape[dim_start:dim_end] and broadcast from `dim_start`."""
        attr = ParamAttr.to_attr(bias_attr)
        if attr is False:
            return x
        bias_shape = list(x.shape[dim_start:dim_end])
        b = self.create_parameter(attr, bias_shape, x.dtype, is_bias=True)
        out = self.create_tmp(x.dtype)
        self.append_op("elementwise_add", {"X": x, "Y": b}, {"Out": out}, {"axis": dim_start})
        return out

    def append_activation(self, x: Variable, act: str | None) -> Variable:
        if act is None:
            return x
        if act not in ACTIVATIONS:
            raise BuilderError(
                f"{self.layer_type}: unknown activation {act!r}; use one of {', '.join(ACTIVATIONS)}"
            )
        return self.unary(act, x)


def float_dtype(helper: LayerHelper, x: Variable, arg: str = "input") -> VarType:
    """Layers with parameters need a float input."""
    if x.dtype not in (VarType.FP32, VarType.FP64, VarType.FP16):
        raise BuilderError(f"{helper.layer_type}: {arg} ({x.name}) must be float, got {x.dtype.name}")
    return x.dtype
