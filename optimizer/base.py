"""Optimizer: minimize(loss) = autodiff + clipping + regularization + update ops.

Everything minimize appends after the backward pass carries op_role
Optimize and op_role_var [param, grad]; the learning rate is a persistable
variable (`learning_rate_0`) set by the startup program, and accumulators are
persistable variables with Fluid's names (`fc_0.w_0_moment1_0`) initialized
there too. That is what the distribute transpiler looks for.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from fluidps.backward import append_backward
from fluidps.errors import BuilderError
from fluidps.initializer import Constant
from fluidps.ir.operator import Operator
from fluidps.ir.program import Program
from fluidps.ir.types import OpRole, VarType
from fluidps.ir.variable import Parameter, Variable
from fluidps.layers.guard import current_programs
from fluidps.ops.roles import append_role_op
from fluidps.optimizer.clip import GradientClipByGlobalNorm
from fluidps.optimizer.regularizer import L2Decay, append_regularization


class Optimizer:
    """Base of SGD, Momentum, Adam, Adagrad, Ftrl. `learning_rate` is a float or a
    Variable (a learning-rate schedule from fluidps.layers)."""

    type = ""

    def __init__(
        self,
        learning_rate: float | Variable,
        regularization: L2Decay | None = None,
        grad_clip: GradientClipByGlobalNorm | None = None,
        name: str | None = None,
    ):
        if not isinstance(learning_rate, (float, int, Variable)) or isinstance(learning_rate, bool):
            raise BuilderError(f"{type(self).__name__}: learning_rate must be a float or a Variable")
        self._learning_rate = learning_rate
        self.regularization = regularization
        self.grad_clip = grad_clip
        self.name = name
        self._lr_var: Variable | None = None
        self._accumulators: dict[tuple[str, str], Variable] = {}
        self._main: Program | None = None
        self._startup: Program | None = None

    # -- public API ----------------------------------------------------------------------

    def minimize(
        self,
        loss: Variable,
        startup_program: Program | None = None,
        parameter_list: Sequence[Parameter | str] | None = None,
        no_grad_set: Iterable[Variable | str] | None = None,
    ) -> tuple[list[Operator], list[tuple[Parameter, Variable]]]:
        """Append backward and optimization ops for `loss`; returns (update ops, (param, grad) pairs)."""
        params_grads = append_backward(loss, parameter_list, no_grad_set)
        optimize_ops = self.apply_gradients(params_grads, loss.block.program, startup_program)
        return optimize_ops, params_grads

    def apply_gradients(
        self,
        params_grads: list[tuple[Parameter, Variable]],
        main_program: Program,
        startup_program: Program | None = None,
    ) -> list[Operator]:
        """Clip, regularize, then append one update op per parameter."""
        self._main = main_program
        self._startup = self._resolve_startup(startup_program)
        # Hashed tables (layers.sparse_embedding) keep their optimizer state in their rows,
        # and take no weight decay or clipping: admission and eviction bound them instead.
        tables = [(p, g) for p, g in params_grads if p.type == VarType.SELECTED_ROWS]
        dense = [(p, g) for p, g in params_grads if p.type != VarType.SELECTED_ROWS]
        if self.grad_clip is not None:
            dense = self.grad_clip(dense)
        dense = append_regularization(dense, self.regularization)
        self._create_learning_rate()
        ops = []
        for param, grad in dense:
            self._create_accumulators(param)
            ops.append(self._append_update(param, grad))
        for param, grad in tables:
            attrs = self._table_rule(param)
            ops.append(self._update("sparse_table_update", param, grad, {}, {}, attrs))
        return ops

    @property
    def learning_rate_var(self) -> Variable | None:
        return self._lr_var

    # -- for subclasses ------------------------------------------------------------------

    def _create_accumulators(self, param: Parameter) -> None:
        """Declare the per-parameter state the update op needs."""

    def _append_update(self, param: Parameter, grad: Variable) -> Operator:
        raise NotImplementedError

    def _table_rule(self, param: Parameter) -> dict[str, Any]:
        """The attributes of sparse_table_update that train hashed table `param` as this
        optimizer trains dense parameters."""
        raise BuilderError(
            f"{type(self).__name__} cannot train the hashed table {param.name!r}: hashed tables are trained "
            "by SGD, Adagrad, Adam (lazy) or Ftrl"
        )

    def _add_accumulator(
        self, name: str, param: Parameter, fill_value: float = 0.0, shape: Sequence[int] | None = None
    ) -> Variable:
        """A persistable `<param>_<name>_N` variable, filled by the startup program."""
        key = (name, param.name)
        if key in self._accumulators:
            return self._accumulators[key]
        shape = list(param.shape if shape is None else shape)
        var_name = self._main.unique_name(f"{param.name}_{name}")
        var = self._persistable(var_name, shape, param.dtype, fill_value)
        self._accumulators[key] = var
        return var

    def _accumulator(self, name: str, param: Parameter) -> Variable:
        return self._accumulators[(name, param.name)]

    def _param_lr(self, param: Parameter, grad: Variable) -> Variable:
        """The global learning rate, scaled by the parameter's ParamAttr learning_rate."""
        if param.learning_rate == 1.0:
            return self._lr_var
        block = self._main.global_block()
        lr = block.create_var(
            self._main.unique_name(f"{param.name}.learning_rate"),
            shape=self._lr_var.shape,
            dtype=self._lr_var.dtype,
        )
        append_role_op(
            block,
            "scale",
            {"X": self._lr_var},
            {"Out": lr},
            {"scale": param.learning_rate},
            role=OpRole.Optimize,
            role_var=[param.name, grad.name],
        )
        return lr

    def _update(
        self,
        type: str,
        param: Parameter,
        grad: Variable,
        inputs: dict,
        outputs: dict,
        attrs: dict | None = None,
    ) -> Operator:
        inputs = {"Param": param, "Grad": grad, "LearningRate": self._param_lr(param, grad), **inputs}
        outputs = {"ParamOut": param, **outputs}
        block = self._main.global_block()
        return append_role_op(
            block, type, inputs, outputs, attrs, role=OpRole.Optimize, role_var=[param.name, grad.name]
        )

    # -- helpers -------------------------------------------------------------------------

    def _resolve_startup(self, startup: Program | None) -> Program:
        if startup is not None:
            return startup
        try:
            _, guarded = current_programs(f"{type(self).__name__}.minimize")
        except BuilderError:
            guarded = None
        if guarded is None:
            raise BuilderError(
                f"{type(self).__name__}.minimize creates the learning rate and accumulators in a startup "
                "program: pass startup_program=..., or call it inside program_guard(main, startup)"
            )
        return guarded

    def _persistable(self, name: str, shape: Sequence[int], dtype: VarType, value: float) -> Variable:
        var = self._main.global_block().create_var(
            name, shape=shape, dtype=dtype, persistable=True, stop_gradient=True
        )
        init = self._startup.global_block().create_var(
            name, shape=shape, dtype=dtype, persistable=True, stop_gradient=True
        )
        Constant(value)(init, self._startup.global_block())
        return var

    def _create_learning_rate(self) -> None:
        if isinstance(self._learning_rate, Variable):
            self._lr_var = self._learning_rate
            return
        if self._lr_var is None or self._lr_var.block.program is not self._main:
            name = self._main.unique_name("learning_rate")
            self._lr_var = self._persistable(name, [1], VarType.FP32, float(self._learning_rate))

    def _describe(self) -> dict[str, Any]:
        return {"learning_rate": self._learning_rate}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._describe().items())
        return f"{type(self).__name__}({args})"
