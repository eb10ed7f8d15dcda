"""The L2 sensitivity of C·X under b-separated participation, from C's columns.

A client that participates in rounds π (with ‖x_s‖ ≤ 1 each) moves C·X by Σ_{s∈π} C[:, s] x_sᵀ, whose squared
Frobenius norm is Σ_{s,u∈π} (CᵀC)[s, u] ⟨x_s, x_u⟩. When every two columns at least b apart are orthogonal
(true of any b-banded C: their rows do not overlap) and π is b-separated, the cross terms vanish whatever the
x_s, and the sensitivity² is the largest Σ_{s∈π} ‖C[:, s]‖² over b-separated π of at most k rounds — a dynamic
programme over the columns, computed here from C and checked, never assumed: a C whose columns at separation
≥ b are not orthogonal is refused.

Amplified BandMF (:mod:`.accounting`) composes each participation by itself, so what it divides σ by is the
single-participation sensitivity, :func:`max_column_norm`.
"""

from __future__ import annotations

import math

import numpy as np

_ORTHOGONALITY_TOLERANCE = 1e-12  # relative to the largest squared column norm


def max_column_norm(strategy_matrix: np.ndarray) -> float:
    """max_s ‖C[:, s]‖: the sensitivity of one participation."""
    return float(np.sqrt(np.max(np.sum(np.asarray(strategy_matrix, dtype=np.float64) ** 2, axis=0))))


def separated_sensitivity(strategy_matrix: np.ndarray, separation: int, max_participations: int | None = None) -> float:
    """The sensitivity of C·X for a client whose participations are at least ``separation`` rounds apart.

    Parameters
    ----------
    strategy_matrix : ndarray
        C, T×T.
    separation : int
        b ≥ 1: two participations of one client are at least b rounds apart.
    max_participations : int or None
        k: at most this many participations (None: as many as b-separation allows, ⌈T/b⌉).

    Returns
    -------
    float
        max over b-separated π, |π| ≤ k, and ‖x_s‖ ≤ 1 of ‖Σ_{s∈π} C[:, s] x_sᵀ‖_F.

    Raises
    ------
    ValueError
        If two columns at least ``separation`` apart are not orthogonal (then this formula is not the
        sensitivity), or an argument is out of range.
    """
    matrix = np.asarray(strategy_matrix, dtype=np.float64)
    if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1] or matrix.shape[0] == 0:
        raise ValueError(f"strategy_matrix of shape {matrix.shape} must be square and non-empty")
    rounds = matrix.shape[0]
    if isinstance(separation, bool) or not isinstance(separation, int) or separation < 1:
        raise ValueError(f"separation={separation!r} must be a positive integer")
    most = math.ceil(rounds / separation)
    if max_participations is None:
        max_participations = most
    if isinstance(max_participations, bool) or not isinstance(max_participations, int) or max_participations < 1:
        raise ValueError(f"max_participations={max_participations!r} must be a positive integer or None")
    gram = matrix.T @ matrix
    squares = np.diag(gram).copy()
    far = np.abs(np.subtract.outer(np.arange(rounds), np.arange(rounds))) >= separation
    if np.any(np.abs(gram[far]) > _ORTHOGONALITY_TOLERANCE * max(float(squares.max()), 1e-300)):
        raise ValueError(f"columns of C at least separation={separation} apart are not orthogonal: the "
                         "participations' cross terms do not vanish, and this sensitivity would not bound them")
    participations = min(max_participations, most)
    # best[j][s]: the largest Σ‖C[:, u]‖² over separated π ⊆ {0..s−1} with |π| ≤ j
    best = np.zeros((participations + 1, rounds + 1))
    for j in range(1, participations + 1):
        for s in range(1, rounds + 1):
            take = squares[s - 1] + best[j - 1][max(0, s - separation)]
            best[j][s] = max(best[j][s - 1], take)
    return float(np.sqrt(best[participations][rounds]))
