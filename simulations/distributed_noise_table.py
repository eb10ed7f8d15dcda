"""What distributed noise costs: the noise on the averaged update, central vs distributed, at equal ε.

Setting: the quickstart's federation (N = 10 000 clients, the 1-D CNN on
MNIST-1D, T = 80 rounds, δ = 1e-5, C = 1) with cohorts of K = 500 and
SecAgg+ over 32-bit integers (threshold 0.66, so m = 330 noise shares).
Columns: the central mode's σ under Poisson sampling (q = 0.05, PLD: what
``fedhog run`` uses) and under fixed-size sampling (replace-one, RDP), and
the distributed mode's plan (:func:`~fedhog.secure_aggregation.distributed_noise.plan_distributed_noise`:
m, g, σ_l in lattice steps, the equivalent total noise multiplier of m
shares) with the std on the averaged update per unit C when m and when all K
clients' shares are in the sum.

Usage::

    python simulations/distributed_noise_table.py
"""

from __future__ import annotations

import math

from fedhog.data import dataset_info
from fedhog.models import build_model
from fedhog.privacy.calibration import calibrate_noise_multiplier
from fedhog.secure_aggregation.distributed_noise import plan_distributed_noise

POPULATION = 10_000
COHORT = 500
ROUNDS = 80
DELTA = 1e-5
THRESHOLD = 0.66
MODULUS_BITS = 32
EPSILONS = (1.0, 3.0, 8.0)


def main() -> None:
    """Print the Markdown table."""
    from fedhog.config import RunConfig

    spec = RunConfig().with_overrides({"dataset": "mnist1d", "model": "cnn1d"}).data_spec
    dimension = sum(p.numel() for p in build_model("cnn1d", *dataset_info(spec)).parameters())
    rate = COHORT / POPULATION
    print(f"N = {POPULATION}, K = {COHORT}, T = {ROUNDS}, δ = {DELTA:g}, C = 1, d = {dimension}, "
          f"b = {MODULUS_BITS}; std on the averaged update per unit C\n")
    print("| ε | central, Poisson (PLD) σ | std | central, fixed (RDP) σ | std | distributed m | g "
          "| σ_l (steps) | total σ of m shares | std, m shares | std, K shares | distributed ÷ central Poisson |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for epsilon in EPSILONS:
        poisson = calibrate_noise_multiplier(epsilon, DELTA, ROUNDS, "poisson", rate, POPULATION, "pld")
        fixed = calibrate_noise_multiplier(epsilon, DELTA, ROUNDS, "fixed", rate, POPULATION, "rdp")
        plan = plan_distributed_noise(1.0, dimension, MODULUS_BITS, COHORT, THRESHOLD, ROUNDS, DELTA, epsilon, 0.0)
        g = plan.lattice.granularity
        std_m = math.sqrt(plan.shares) * plan.local_std * g / COHORT
        std_k = math.sqrt(COHORT) * plan.local_std * g / COHORT
        print(f"| {epsilon:g} | {poisson:.4g} | {poisson / COHORT:.3g} | {fixed:.4g} | {fixed / COHORT:.3g} "
              f"| {plan.shares} | 2^{int(math.log2(g))} | {plan.local_std:.4g} | {plan.noise_multiplier:.4g} "
              f"| {std_m:.3g} | {std_k:.3g} | {std_k / (poisson / COHORT):.3g}× |")


if __name__ == "__main__":
    main()
