"""Higher-order derivative engine: gradients, HVPs, third-order vectors, the Hessian trace's gradient and directional
derivatives.

Imports torch only.  See :mod:`fedhog.derivatives.engine` for the entry points;
``direction`` arguments and ``res.vector`` results are dicts keyed like
``dict(model.named_parameters())``.
"""

from .api import HigherOrderResult, eval_mode
from .engine import (
    directional_derivatives,
    gradient,
    hessian,
    hessian_trace_gradient,
    hessian_vector_product,
    third_order_vector,
)
from .errors import Unsupported, UntrustedOperation
from .greeks import black_scholes_call, call_greeks
from .losses import cross_entropy, mse
from .step_size import STEP_REASONS, StepSize, cubic_step, third_order_step_size
from .trusted import TrustedDerivatives

__all__ = [
    "STEP_REASONS",
    "HigherOrderResult",
    "StepSize",
    "TrustedDerivatives",
    "Unsupported",
    "UntrustedOperation",
    "black_scholes_call",
    "call_greeks",
    "cross_entropy",
    "cubic_step",
    "directional_derivatives",
    "eval_mode",
    "gradient",
    "hessian",
    "hessian_trace_gradient",
    "hessian_vector_product",
    "mse",
    "third_order_step_size",
    "third_order_vector",
]
