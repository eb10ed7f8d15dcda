"""What a round's diagnostics say (:mod:`fedhog.diagnostics`): alarms for the progress line, notes for the record.

Pure functions of a round's ``layers`` figures, so the progress display reads
them without loading torch. Why saturation is the alarm and the noise's walk
only a note: :mod:`fedhog.diagnostics`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

#: The one wording of the fixed privacy-seed warning: the CLI's banner says it before the run, the strategy's
#: start-up log for runs started otherwise (``flwr run``, :func:`fedhog.run`).
PRIVACY_SEED_WARNING = ("privacy-seed is fixed: cohorts, ξ and noise are reproducible, so anyone who holds the "
                        "config can remove the noise, and a seed is found from two released models by trying seeds "
                        "in order (seed 7 in under a second). The ε printed is VOID against them; it only compares "
                        "mechanisms. For experiments only; deployments use privacy-seed = -1.")
NOISE_WALK_WARNING = 0.7  # ρ ≥ 0.7·‖W_T − W_0‖: about half the movement's energy or more is noise
SATURATION_WARNING = 0.25  # a quarter of a layer's units saturated on the evaluation examples
GROWTH_WARNING = 2.0  # weights grown to twice their initial norm


def alarms(layers: Mapping[str, float]) -> list[str]:
    """One sentence per layer whose units saturated: the failure mode the DP noise causes, worth interrupting a
    user for (the progress line, the log)."""
    return [f"{key.removeprefix('saturated/')} saturated: {fraction:.0%} of its units past the flat part of the "
            "activation" for key, fraction in layers.items()
            if key.startswith("saturated/") and fraction >= SATURATION_WARNING]


def noise_notes(layers: Mapping[str, float]) -> list[str]:
    """One sentence per layer whose weights the noise moved more than the signal did: normal under DP (healthy
    runs too, module docstring), so recorded, not shown."""
    found = []
    for key, walk in layers.items():
        if not key.startswith("walk/"):
            continue
        name = key.removeprefix("walk/")
        growth = layers.get(f"growth/{name}", math.nan)
        if walk >= NOISE_WALK_WARNING and growth >= GROWTH_WARNING:
            found.append(f"noise dominates {name}: weights ×{growth:.1f} since initialisation, the noise's expected "
                         f"random walk {walk:.2f}× their movement")
    return found


def warnings_for(layers: Mapping[str, float]) -> list[str]:
    """Every sentence for ``metrics.json``: the :func:`alarms`, then the :func:`noise_notes`."""
    return alarms(layers) + noise_notes(layers)
