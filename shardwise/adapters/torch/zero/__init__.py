"""ZeRO stages 1, 2 and 3 for PyTorch.

:mod:`.optimizer` holds :class:`ZeroOptimizer`; :mod:`.units` the partition units,
:mod:`.grads` the gradient reductions, :mod:`.stage3` the gather/free hooks of stage 3,
:mod:`.fusion` the weight gradients written straight into the flat buffer,
:mod:`.step` the step and parameter publishing, and :mod:`.elastic` the full state
and resharding.
"""

from .optimizer import ZeroOptimizer

__all__ = ["ZeroOptimizer"]
