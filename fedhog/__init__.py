"""fedhog: federated learning with higher-order differential-privacy mixing.

``fedhog.run(config, **overrides)`` runs one training from Python (:func:`fedhog.api.run`);
``fedhog.audit(config, **options)`` audits its mechanism (:func:`fedhog.auditing.runner.audit`);
``fedhog.central_split(config)`` returns the exact train and test sets of its run, for a central baseline
(:func:`fedhog.api.central_split`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("fedhog")  # the installed package's metadata (pyproject.toml's version)
except PackageNotFoundError:  # imported from a checkout that was never installed
    __version__ = "unknown"

if TYPE_CHECKING:
    from .api import RunResult
    from .auditing.runner import AuditResult
    from .data import ArrayData


def run(config: Any = None, *, engine: str = "vectorized", overwrite: bool = False, verbose: bool = False,
        **overrides: Any) -> RunResult:
    """Run one federated training and return its results folder and metrics (see :func:`fedhog.api.run`)."""
    from .api import run as run_api  # torch and Flower load when a run starts, not on `import fedhog`

    return run_api(config, engine=engine, overwrite=overwrite, verbose=verbose, **overrides)


def central_split(config: Any = None, **overrides: Any) -> tuple[ArrayData, ArrayData]:
    """The train (every client's training examples, pooled) and test sets of a config's run, for a central
    baseline (see :func:`fedhog.api.central_split`)."""
    from .api import central_split as split

    return split(config, **overrides)


def audit(config: Any = None, **options: Any) -> AuditResult:
    """An empirical lower bound on the ε of a config's mechanism, next to the accounted ε
    (see :func:`fedhog.auditing.runner.audit`)."""
    from .auditing.runner import audit as run_audit  # torch and Flower load when an audit starts

    return run_audit(config, **options)
