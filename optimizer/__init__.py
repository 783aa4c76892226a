"""Optimizers, weight decay and gradient clipping (`fluidps.optimizer`).

May import: fluidps.errors, fluidps.ir, fluidps.ops, fluidps.backward, fluidps.initializer,
fluidps.layers.guard, fluidps.transpiler.cost_model, fluidps.transpiler.partition
"""

from fluidps.optimizer.base import Optimizer
from fluidps.optimizer.clip import GradientClipByGlobalNorm
from fluidps.optimizer.optimizers import (
    SGD,
    Adagrad,
    AdagradOptimizer,
    Adam,
    AdamOptimizer,
    Ftrl,
    FtrlOptimizer,
    Momentum,
    MomentumOptimizer,
    SGDOptimizer,
)
from fluidps.optimizer.pipeline import PipelineOptimizer
from fluidps.optimizer.regularizer import L2Decay, L2DecayRegularizer

__all__ = [
    "SGD",
    "Adagrad",
    "AdagradOptimizer",
    "Adam",
    "AdamOptimizer",
    "Ftrl",
    "FtrlOptimizer",
    "GradientClipByGlobalNorm",
    "L2Decay",
    "L2DecayRegularizer",
    "Momentum",
    "MomentumOptimizer",
    "Optimizer",
    "PipelineOptimizer",
    "SGDOptimizer",
]
