from nanotron.optim.base import BaseOptimizer
from nanotron.optim.inherit_from_other_optimizer import InheritFromOtherOptimizer
from nanotron.optim.named_optimizer import NamedOptimizer
from nanotron.optim.optimizer_from_gradient_accumulator import OptimizerFromGradientAccumulator
from nanotron.optim.zero import ZeroDistributedOptimizer

__all__ = [
    "BaseOptimizer",
    "InheritFromOtherOptimizer",
    "NamedOptimizer",
    "OptimizerFromGradientAccumulator",
    "ZeroDistributedOptimizer",
]
