"""Predicted accumulated noise of banded correlated noise (BandMF) relative to independent noise (DP-FedAvg).

For each federation (N clients, expected cohort K, T rounds, δ), each ε and each number of bands b, σ_b is
calibrated by PLD to (ε, δ) for amplified BandMF (b groups, Poisson at p = K·b/N within the active group,
⌈T/b⌉ compositions; :mod:`fedhog.privacy.correlated.accounting`), and the table prints the RMS over rounds of
the std of the prefix sums of the noise, divided by independent noise's (b = 1) — below 1, correlated noise is
predicted to pay — for BSR's coefficients and the optimised ones, then each round's own noise ratio (BSR), then
what :func:`~fedhog.privacy.correlated.planner.choose_bands` picks. Only public parameters go in.

Usage::

    python simulations/correlated_noise_table.py                       # the three federations of issue 42
    python simulations/correlated_noise_table.py --population 100000 --cohort 1000 --rounds 1000 \\
        --delta 1e-5 --epsilons 1 3 8 --bands 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from fedhog.privacy.correlated.planner import NoisePrediction, choose_bands, plan_bands

#: (name, N, K, T, δ, ε's) of the issue's table
ISSUE_FEDERATIONS = (
    ("the convergence federation", 1000, 100, 100, 1e-5, (1.0, 3.0, 8.0)),
    ("cross-device, 10 participations", 100_000, 1000, 1000, 1e-5, (1.0, 3.0, 8.0)),
    ("few participations", 1_000_000, 1000, 2000, 1e-6, (1.0, 3.0)),
)
DEFAULT_BANDS = (1, 2, 4, 8, 16, 32, 64)


def table(population: int, cohort: int, rounds: int, delta: float, epsilons: Sequence[float],
          bands: Sequence[int]) -> str:
    """The Markdown table of one federation."""
    plans: dict[tuple[float, str], tuple[NoisePrediction, ...]] = {
        (epsilon, kind): plan_bands(population, cohort, rounds, epsilon, delta, bands, kind)
        for epsilon in epsilons for kind in ("bsr", "optimised")}
    feasible = [p.bands for p in plans[(epsilons[0], "bsr")]]
    head = ["b"] + [f"ε = {e:g}: BSR / optimised (round noise)" for e in epsilons]
    lines = [f"N = {population}, K = {cohort}, T = {rounds}, δ = {delta:g}, participations a client "
             f"qT = {cohort * rounds / population:g}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row, b in enumerate(feasible):
        cells = [str(b)]
        for epsilon in epsilons:
            bsr, opt = plans[(epsilon, "bsr")][row], plans[(epsilon, "optimised")][row]
            cells.append(f"{bsr.ratio:.3f} / {opt.ratio:.3f} ({bsr.round_ratio:.2f}×), "
                         f"σ_b = {bsr.noise_multiplier:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    chosen = []
    for epsilon in epsilons:
        for kind in ("bsr", "optimised"):
            pick = choose_bands(plans[(epsilon, kind)])
            chosen.append(f"ε = {epsilon:g} {kind}: b = {pick.bands} ({pick.ratio:.3f})")
    lines += ["", "choose_bands: " + "; ".join(chosen)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the issue's federations, or the one given on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--population", type=int)
    parser.add_argument("--cohort", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 3.0, 8.0])
    parser.add_argument("--bands", type=int, nargs="+", default=list(DEFAULT_BANDS))
    args = parser.parse_args(argv)
    given = [args.population, args.cohort, args.rounds]
    if any(v is not None for v in given):
        if any(v is None for v in given):
            parser.error("--population, --cohort and --rounds go together")
        print(table(args.population, args.cohort, args.rounds, args.delta, args.epsilons, args.bands))
        return
    for name, population, cohort, rounds, delta, epsilons in ISSUE_FEDERATIONS:
        print(f"### {name}\n")
        print(table(population, cohort, rounds, delta, epsilons, args.bands))
        print()


if __name__ == "__main__":
    main()
