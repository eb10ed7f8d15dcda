"""Empirical privacy auditing: a lower bound on ε, measured with canaries, next to the accounted ε.

- :mod:`fedhog.privacy.audit`: the mathematics (test statistics, Clopper–Pearson bound, Gaussian-DP estimate);
- :mod:`.harness`: a config's mechanism run with canary clients through fedhog's own code;
- :mod:`.runner`: :func:`~fedhog.auditing.runner.audit`, the orchestration behind ``fedhog audit`` and
  ``fedhog.audit()``.
"""
