"""Empirical privacy auditing: a lower bound on ε, measured with canaries, next to the accounted ε.

- :mod:`.bounds`: the mathematics (Clopper–Pearson bound, Gaussian-DP estimate), pure functions;
- :mod:`.attacks`: the attacker's test statistics per threat model;
- :mod:`.harness`: a config's mechanism run with canary clients through fedhog's own code;
- :mod:`.runner`: :func:`audit`, the orchestration behind ``fedhog audit``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .runner import AuditResult


def audit(config: Any = None, **options: Any) -> "AuditResult":
    """Audit a config's mechanism (see :func:`fedhog.audit.runner.audit`)."""
    from .runner import audit as run_audit  # torch and Flower load when an audit starts

    return run_audit(config, **options)
