"""The mathematics of privacy auditing: test statistics and bounds on ε from canary scores (numpy and scipy only).

The runs that produce the scores are :mod:`fedhog.auditing`'s.
"""
