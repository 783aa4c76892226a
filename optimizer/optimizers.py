"""SGD, Momentum, Adam, Adagrad and Ftrl: one update op per parameter, Fluid's ops and names;
hashed tables get one sparse_table_update with the same rule."""

from __future__ import annotations

from typing import Any

from fluidps.errors import BuilderError
from fluidps.ir.operator import Operator
from fluidps.ir.variable import Parameter, Variable
from fluidps.optimizer.base import Optimizer


class SGD(Optimizer):
    """param -= lr * grad."""

    def _append_update(self, param: Parameter, grad: Variable) -> Operator:
        return self._update("sgd", param, grad, {}, {})

    def _table_rule(self, param: Parameter) -> dict[str, Any]:
        return {"rule": "sgd"}


class Momentum(Optimizer):
    """velocity = momentum * velocity + grad; param -= lr * velocity (or the Nesterov step)."""

    def __init__(
        self, learning_rate: float | Variable, momentum: float, use_nesterov: bool = False, **kwargs: Any
    ):
        super().__init__(learning_rate, **kwargs)
        self.momentum = float(momentum)
        self.use_nesterov = bool(use_nesterov)

    def _create_accumulators(self, param: Parameter) -> None:
        self._add_accumulator("velocity", param)

    def _append_update(self, param: Parameter, grad: Variable) -> Operator:
        velocity = self._accumulator("velocity", param)
        return self._update(
            "momentum",
            param,
            grad,
            {"Velocity": velocity},
            {"VelocityOut": velocity},
            {"mu": self.momentum, "use_nesterov": self.use_nesterov},
        )

    def _describe(self) -> dict[str, Any]:
        return {**super()._describe(), "momentum": self.momentum, "use_nesterov": self.use_nesterov}


class Adam(Optimizer):
    """Adam with Fluid's update (epsilon scaled by sqrt(1 - beta2^t)). With
    `lazy_mode`, sparse gradients update only their rows' moments."""

    def __init__(
        self,
        learning_rate: float | Variable = 0.001,
        beta1: float = 0.9,
        beta2: float = 0.999,
        epsilon: float = 1e-8,
        lazy_mode: bool = False,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.beta1, self.beta2, self.epsilon = float(beta1), float(beta2), float(epsilon)
        self.lazy_mode = bool(lazy_mode)

    def _create_accumulators(self, param: Parameter) -> None:
        self._add_accumulator("moment1", param)
        self._add_accumulator("moment2", param)
        self._add_accumulator("beta1_pow_acc", param, fill_value=self.beta1, shape=[1])
        self._add_accumulator("beta2_pow_acc", param, fill_value=self.beta2, shape=[1])

    def _append_update(self, param: Parameter, grad: Variable) -> Operator:
        m1, m2 = self._accumulator("moment1", param), self._accumulator("moment2", param)
        b1, b2 = self._accumulator("beta1_pow_acc", param), self._accumulator("beta2_pow_acc", param)
        return self._update(
            "adam",
            param,
            grad,
            {"Moment1": m1, "Moment2": m2, "Beta1Pow": b1, "Beta2Pow": b2},
            {"Moment1Out": m1, "Moment2Out": m2, "Beta1PowOut": b1, "Beta2PowOut": b2},
            {"beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon, "lazy_mode": self.lazy_mode},
        )

    def _table_rule(self, param: Parameter) -> dict[str, Any]:
        # Each row keeps its own moments and beta powers: lazy by construction.
        return {"rule": "adam", "beta1": self.beta1, "beta2": self.beta2, "epsilon": self.epsilon}

    def _describe(self) -> dict[str, Any]:
        return {**super()._describe(), "beta1": self.beta1, "beta2": self.beta2, "lazy_mode": self.lazy_mode}


class Adagrad(Optimizer):
    """moment += grad^2; param -= lr * grad / (sqrt(moment) + epsilon)."""

    def __init__(
        self,
        learning_rate: float | Variable,
        epsilon: float = 1e-6,
        initial_accumulator_value: float = 0.0,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        self.epsilon = float(epsilon)
        self.initial_accumulator_value = float(initial_accumulator_value)

    def _create_accumulators(self, param: Parameter) -> None:
        self._add_accumulator("moment", param, fill_value=self.initial_accumulator_value)

    def _append_update(self, param: Parameter, grad: Variable) -> Operator:
        moment = self._accumulator("moment", param)
        return self._update(
            "adagrad", param, grad, {"Moment": moment}, {"MomentOut": moment}, {"epsilon": self.epsilon}
        )

    def _table_rule(self, param: Parameter) -> dict[str, Any]:
        if self.initial_accumulator_value:
            raise BuilderError(
                f"Adagrad: hashed table {param.name!r} starts each row's moment at 0; "
                f"initial_accumulator_value={self.initial_accumulator_value} is not supported for it"
            )
        return {"rule": "adagrad", "epsilon": self.epsilon}


class Ftrl(Optimizer):
    """FTRL-proximal (learning-rate power -1/2) with L1 and L2 regularization, Paddle's
    ftrl op: the optimizer of sparse CTR models."""

    def __init__(
        self,
        learning_rate: float | Variable,
        l1: float = 0.0,
        l2: float = 0.0,
        lr_power: float = -0.5,
        **kwargs: Any,
    ):
        super().__init__(learning_rate, **kwargs)
        if lr_power != -0.5:
            raise BuilderError(f"Ftrl: only lr_power=-0.5 is supported, got {lr_power}")
        self.l1, self.l2, self.lr_power = float(l1), float(l2), float(lr_power)

    def _create_accumulators(self, param: Parameter) -> None:
        self._add_accumulator("squared", param)
        self._add_accumulator("linear", param)

    def _append_update(self, param: Parameter, grad: Variable) -> Operator:
        squared, linear = self._accumulator("squared", param), self._accumulator("linear", param)
        return self._update(
            "ftrl",
            param,
            grad,
            {"SquaredAccumulator": squared, "LinearAccumulator": linear},
            {"SquaredAccumOut": squared, "LinearAccumOut": linear},
            {"l1": self.l1, "l2": self.l2, "lr_power": self.lr_power},
        )

    def _table_rule(self, param: Parameter) -> dict[str, Any]:
        return {"rule": "ftrl", "l1": self.l1, "l2": self.l2}

    def _describe(self) -> dict[str, Any]:
        return {**super()._describe(), "l1": self.l1, "l2": self.l2}


# Fluid's longer names.
SGDOptimizer = SGD
MomentumOptimizer = Momentum
AdamOptimizer = Adam
AdagradOptimizer = Adagrad
FtrlOptimizer = Ftrl
