"""Sweeps: a grid of full federated runs on the vectorized engine, resumable, with tidy results.

A sweep file is TOML::

    output = "results/sweeps/privacy-utility"     # folder of the sweep (relative: to the working directory)
    engine = "vectorized"                         # optional: or "inprocess" (one Flower message per client)
    paired = [["gaussian", "hog-γ0.5"]]           # optional: pairs [A, B] of variants to compare (B − A)

    [base]                                        # run-config keys shared by every cell
    dataset = "mnist1d"

    [grid]                                        # run-config keys, each a list: every combination is run
    target-epsilon = [1.0, 3.0, 8.0]
    seed = [0, 1, 2]

    [[variants]]                                  # optional: named cells that override keys
    name = "gaussian"
    mechanism = "gaussian"

    [tune]                                        # optional: choose keys per variant and condition first
    seeds = [100]                                 # on these data seeds (not the grid's),
    widen = 2                                     # optional: values a key may be extended by past its edge
    [tune.grid]                                   # by the server's validation accuracy (never the test set)
    clipping-norm = [0.3, 1.0]

    [audit]                                       # optional: audit each variant's mechanism per condition
    canaries = 100000                             # (fedhog audit's runs, canaries, confidence, canary-norm)

A cell is one combination of the grid values with one variant (the grid alone
when there are no variants). A variant may set a condition key of the grid
(``target-epsilon = -1.0`` for a no-DP ceiling): it then runs once per value of
the other grid keys, and the paired tests and the plots compare it with every
condition (a reference line); its id (``hog-gamma0.5__target-epsilon=1.0__seed=0``)
comes from the variant's name and the grid values, and its run goes to
``output/runs/<cell-id>/``. Without variants a cell's variant is its mechanism.

**Tuning.** With ``[tune]`` the sweep first runs every setting of the tuned
keys for every (variant, condition) on the tuning seeds (``output/tuning/``),
chooses per (variant, condition) the one with the best mean
``validation_accuracy`` over the last rounds (:func:`.runner.apply_tuning`),
and runs the cells with it. A numeric key whose chosen value is the smallest
or largest tried is widened one step past it (geometric for positive values:
0.1, 0.3 → 0.9), the new value tried with every value of the other keys, until
the choice is inside or ``[tune] widen`` values (default 2) were added;
``tuning.md`` says which choices still sit on an edge, and why.

**Auditing.** With ``[audit]`` the sweep, after its cells, runs ``fedhog
audit`` on every variant's mechanism (those with a DP guarantee, or the
``variants`` listed) per condition, with fresh noise (never the pairing
seed), into ``output/audit/<variant>__<condition>/`` (:mod:`.audit`); an
audit whose config and options are unchanged is not rerun. ``summary.md``
then has a "Privacy audit" section: the ε lower bounds next to the accounted
ε, the μ-GDP estimate, a verdict and the score distributions.

**Pairing.** Cells with the same ``seed`` share the data, the partition, the
model initialisation and the clients' shuffling and directions. Unless the
sweep sets ``privacy-seed``, each cell gets the fixed privacy seed
:func:`privacy_seed_for` its ``seed``, so paired cells also draw the same
cohorts every round and the same Gaussian noise draws (``hog`` takes its ξ from
a stream of its own, so mixing does not shift the noise). A fixed privacy seed
makes the noise predictable: it is for experiments, never for a deployment.

**Resuming.** A cell whose ``metrics.json`` says ``"finished"`` is not rerun
(its stored config must match the sweep's, or the sweep stops with an error
naming the keys that differ); any other cell (crashed, killed, interrupted,
missing) is run again from scratch.

**Outputs** (in ``output``): ``results.csv`` (one row per cell and round,
round 0 being the initial model), ``summary.md`` (final accuracy mean ± std over
seeds per variant and condition, and the paired comparisons), and the plots
``accuracy_vs_round.png`` and ``accuracy_vs_epsilon.png``.

**Parts**, imports pointing down: :mod:`.runner` (cells, resuming, ``results.csv``;
torch and Flower) → :mod:`.report` (``summary.md``) and :mod:`.plots` (matplotlib)
→ :mod:`.audit` (the ``[audit]`` runs, stored; the auditor imported only to run one)
→ :mod:`.stats` (paired statistics; numpy, scipy) and :mod:`.spec` (the sweep file
and its cells). The names below are imported from their part on first use, so
``import fedhog.sweep.spec`` loads no runner.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Cell": "spec", "Sweep": "spec", "SweepError": "spec", "cell_id_of": "spec", "expand_cells": "spec",
    "load_sweep": "spec", "privacy_seed_for": "spec",
    "PairedComparison": "stats", "paired_comparisons": "stats",
    "summary_markdown": "report",
    "SweepOutcome": "runner", "apply_tuning": "runner", "run_sweep": "runner", "sweep_command": "runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    """A name of :data:`__all__`, from the part that defines it."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
