"""Exceptions of the derivative engine (exported from :mod:`fedhog.derivatives`).

Both derive from ``ValueError``: the model (or the ``method`` asked for it) is a
value the engine cannot differentiate correctly, and says so rather than
returning a wrong number.
"""

from __future__ import annotations


class Unsupported(ValueError):
    """The requested ``method`` cannot differentiate an operation of the model or loss.

    Raised by ``method="taylor"`` when an operation has no Taylor-mode rule (at
    tracing or at run time), and by ``method="torch.func"`` or ``"autograd"``
    when PyTorch has no derivative of the needed order for an operation.
    ``method="auto"`` catches it and tries the next formulation; it is raised
    to the caller only when no formulation is left.
    """


class UntrustedOperation(Unsupported):
    """The model calls an operation whose higher-order derivatives PyTorch gets wrong.

    Operations with a trusted reformulation (layer, instance and batch-statistics
    normalisation) are routed to it instead; see :mod:`fedhog.derivatives.trusted`.
    """
