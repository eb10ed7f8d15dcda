"""Who shares secrets with whom in a SecAgg+ round, and how many shares reconstruct one.

Both sides compute these from the cohort size and public config: the server
to run the round, each client to check that the round it is asked into is the
one its own config agreed to (:class:`fedhog.secure_aggregation.client.ClientGuard`).
"""

from __future__ import annotations

import math


def share_count(cohort: int, num_shares: int) -> int:
    """k: the whole cohort when ``num_shares`` is 0 or not below it, else an odd ring of ``num_shares | 1``."""
    return cohort if num_shares == 0 or num_shares >= cohort else num_shares | 1


def threshold_count(shares: int, threshold: float) -> int:
    """t = max(2, ⌈threshold·k⌉): the shares that reconstruct a secret."""
    return max(2, math.ceil(threshold * shares))
