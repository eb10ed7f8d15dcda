"""Noise needed for a privacy budget: Flower's accounted DP wrapper vs fedhog.

Setting (MNIST-1D): N = 1000 clients, T = 100 rounds, δ = 1e-5, ε ∈ {1, 3, 8}.

Flower: ``DifferentialPrivacyServerSideFixedClipping`` with an ``RdpAccountant``.
In accounted mode the wrapper only accepts ``SamplingMethod.NO_AMPLIFICATION``
(with ADD_OR_REMOVE_ONE), an un-overridden ``FedAvg.aggregate_train``, exactly
``num_sampled_clients`` replies and equal client weights. Each released round it
adds N(0, (σ·C/K)²) to the average of the K clipped updates (σ·C on their sum)
and composes ``GaussianPrivacyEvent(σ, K, N)``, which the accountant treats as a
plain ``GaussianDpEvent(σ)``: no credit for sampling. Every client therefore
takes part every round (q = 1, K = 1000), where that accounting is exact.

fedhog: Poisson sampling with q = 0.1 (100 clients a round in expectation),
noise σ·C on the clipped sum divided by K = q·N, accounted with PLD.

σ is the smallest meeting the budget (:mod:`fedhog.privacy.calibration`,
relative tolerance 1e-3); the spent ε columns are what the two runtime accountants
report after T releases at that σ. The fair comparison is the noise std on the
averaged update, σ·C/K, shown per unit C.

A second table takes the setting of ``configs/sweep_privacy_utility.toml``
(N = 1000, K = 50 clients a round, T = 20 rounds) and splits the gap between
Flower's accounted wrapper and fedhog at the same cohort into its two causes:
sampling amplification (Flower's no-amplification σ ÷ fedhog's Poisson σ, both
RDP) and the accountant (fedhog's RDP σ ÷ its PLD σ).

A third table asks what Flower's number means when the cohort is a fixed-size
draw, as in Flower's runs: its no-amplification bound composes a Gaussian of
sensitivity C, but replacing one client of a given cohort moves the sum by 2C.
It shows, at the Flower σ of the second table, the ε of the actual mechanism
(K of N drawn without replacement, replace-one, RDP: ``dp_accounting``'s
SampledWithoutReplacementDpEvent) and the ε if the same cohort were chosen by
someone (no sampling, sensitivity 2C): Flower's ε holds because the cohort is
random, not whoever chose it.

Usage::

    python simulations/noise_table.py
"""

from __future__ import annotations

import dp_accounting
from dp_accounting import dp_event, rdp
from flwr.serverapp import RdpAccountant
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

from fedhog.privacy.accounting import ClientLevelAccountant
from fedhog.privacy.calibration import (
    calibrate_noise_multiplier,
    calibrate_unamplified_noise_multiplier,
    unamplified_privacy_config,
)

POPULATION = 1000
ROUNDS = 100
DELTA = 1e-5
EPSILONS = (1.0, 3.0, 8.0)
FEDHOG_RATE = 0.1
FEDHOG_COHORT = round(FEDHOG_RATE * POPULATION)


def flower_row(epsilon: float) -> tuple[float, float]:
    """σ of Flower's accounted wrapper with every client every round, and the ε it reports."""
    sigma = calibrate_unamplified_noise_multiplier(epsilon, DELTA, ROUNDS, POPULATION, POPULATION)
    accountant = RdpAccountant(unamplified_privacy_config(POPULATION, DELTA))
    accountant.compose(GaussianPrivacyEvent(sigma, POPULATION, POPULATION), ROUNDS)
    return sigma, accountant.get_epsilon(DELTA)


def fedhog_row(epsilon: float) -> tuple[float, float]:
    """σ of fedhog (Poisson, PLD), and the ε its runtime accountant reports."""
    sigma = calibrate_noise_multiplier(epsilon, DELTA, ROUNDS, "poisson", FEDHOG_RATE, POPULATION, "pld")
    accountant = ClientLevelAccountant(sigma, "poisson", FEDHOG_RATE, POPULATION, DELTA, accountant="pld")
    backend = accountant.state_dict()["backend"]
    backend["compositions"] = [{"event": vars(accountant.event), "count": ROUNDS}]
    accountant.load_state_dict({"releases": ROUNDS, "backend": backend})
    return sigma, accountant.epsilon()


SWEEP_COHORT = 50  # configs/sweep_privacy_utility.toml: q = 0.05 of N = 1000
SWEEP_ROUNDS = 20


def same_cohort_row(epsilon: float) -> tuple[float, float, float]:
    """σ at the sweep's setting: Flower (no amplification, RDP), fedhog Poisson with RDP, with PLD."""
    rate = SWEEP_COHORT / POPULATION
    flower = calibrate_unamplified_noise_multiplier(epsilon, DELTA, SWEEP_ROUNDS, POPULATION, SWEEP_COHORT)
    fedhog_rdp, fedhog_pld = (calibrate_noise_multiplier(epsilon, DELTA, SWEEP_ROUNDS, "poisson", rate, POPULATION,
                                                         accountant) for accountant in ("rdp", "pld"))
    return flower, fedhog_rdp, fedhog_pld


def flower_bound_row(sigma: float) -> tuple[float, float]:
    """ε of Flower's sweep-setting release at σ: its random cohort (replace-one), and a chosen one (2C)."""
    def epsilon(event: dp_event.DpEvent) -> float:
        accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        return accountant.compose(dp_event.SelfComposedDpEvent(event, SWEEP_ROUNDS)).get_epsilon(DELTA)

    gaussian = dp_event.GaussianDpEvent(sigma / 2)  # replace-one: sensitivity 2C
    random_cohort = dp_event.SampledWithoutReplacementDpEvent(POPULATION, SWEEP_COHORT, gaussian)
    return epsilon(random_cohort), epsilon(gaussian)


def main() -> None:
    """Print the Markdown tables."""
    print(f"N = {POPULATION} clients, T = {ROUNDS} rounds, δ = {DELTA:g}; "
          "noise std on the averaged update in units of the clipping norm C\n")
    print(f"| ε | Flower σ (q = 1, RDP) | ε spent | Flower std/C (K = {POPULATION}) "
          f"| fedhog σ (q = {FEDHOG_RATE:g}, PLD) | ε spent | fedhog std/C (K = {FEDHOG_COHORT}) "
          "| fedhog ÷ Flower std |")
    print("|---|---|---|---|---|---|---|---|")
    for epsilon in EPSILONS:
        flower_sigma, flower_spent = flower_row(epsilon)
        fedhog_sigma, fedhog_spent = fedhog_row(epsilon)
        flower_std, fedhog_std = flower_sigma / POPULATION, fedhog_sigma / FEDHOG_COHORT
        print(f"| {epsilon:g} | {flower_sigma:.4g} | {flower_spent:.4g} | {flower_std:.4g} "
              f"| {fedhog_sigma:.4g} | {fedhog_spent:.4g} | {fedhog_std:.4g} | {fedhog_std / flower_std:.3g} |")
    print(f"\nSame cohort: N = {POPULATION}, K = {SWEEP_COHORT} a round, T = {SWEEP_ROUNDS} rounds, δ = {DELTA:g} "
          "(the setting of configs/sweep_privacy_utility.toml)\n")
    print("| ε | Flower σ (no amplification, RDP) | fedhog σ (Poisson, RDP) | fedhog σ (Poisson, PLD) "
          "| Flower ÷ fedhog noise | amplification | accountant |")
    print("|---|---|---|---|---|---|---|")
    for epsilon in EPSILONS:
        flower, fedhog_rdp, fedhog_pld = same_cohort_row(epsilon)
        print(f"| {epsilon:g} | {flower:.4g} | {fedhog_rdp:.4g} | {fedhog_pld:.4g} | {flower / fedhog_pld:.3g}× "
              f"| {flower / fedhog_rdp:.3g}× | {fedhog_rdp / fedhog_pld:.3g}× |")
    print(f"\nWhat Flower's ε means: its σ at the same cohort, replace-one neighbours, RDP, δ = {DELTA:g}\n")
    print("| ε Flower reports | Flower σ | ε of its random cohort (K of N without replacement) "
          "| ε if the cohort were chosen (sensitivity 2C) |")
    print("|---|---|---|---|")
    for epsilon in EPSILONS:
        flower = calibrate_unamplified_noise_multiplier(epsilon, DELTA, SWEEP_ROUNDS, POPULATION, SWEEP_COHORT)
        random_cohort, chosen = flower_bound_row(flower)
        print(f"| {epsilon:g} | {flower:.4g} | {random_cohort:.3g} | {chosen:.3g} |")


if __name__ == "__main__":
    main()
