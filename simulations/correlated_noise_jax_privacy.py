"""fedhog's correlated-noise accounting and losses against ``jax_privacy``'s own, run in a separate venv.

``jax_privacy`` is never a fedhog dependency: this script (fedhog's venv) sends a table of settings to a child
Python that has it (``--jax-python``), which returns ε of ``amplified_bandmf_event`` (PLD on fedhog's grid width
1e-3, and RDP), ``toeplitz.loss`` of BSR's coefficients (``optimal_max_error_strategy_coefs``, the same c_k) and
of ``optimize_banded_toeplitz`` (mean squared error); the script prints them beside
:func:`~fedhog.privacy.correlated.accounting.banded_epsilon`,
:func:`~fedhog.privacy.correlated.strategies.mean_prefix_loss` and fedhog's optimised coefficients, with the
relative differences.

Usage::

    python3 -m venv /work/venv-jaxp && /work/venv-jaxp/bin/pip install jax_privacy==2.0.0
    python simulations/correlated_noise_jax_privacy.py --jax-python /work/venv-jaxp/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess

from fedhog.privacy.correlated.accounting import BandedParticipation, banded_epsilon
from fedhog.privacy.correlated.strategies import bsr_coefficients, mean_prefix_loss, optimised_coefficients

#: (N, K, T, b, σ, δ)
EVENTS = ((100_000, 1000, 1000, 8, 3.5, 1e-5), (1_000_000, 1000, 2000, 32, 1.5, 1e-6),
          (1000, 100, 100, 2, 5.5, 1e-5), (10_000, 100, 301, 7, 2.0, 1e-5))
#: (T, b)
LOSSES = ((100, 2), (1000, 8), (1000, 32), (2000, 64))

CHILD = """
import json, sys
import dp_accounting
import jax
import jax.numpy as jnp
from dp_accounting.pld import PLDAccountant
try:
    from jax_privacy import accounting
    accounting.amplified_bandmf_event
except AttributeError:  # jax_privacy 2.0.0 keeps it in experimental/
    from jax_privacy.experimental import accounting
from jax_privacy.matrix_factorization import toeplitz
jax.config.update("jax_enable_x64", True)
settings = json.loads(sys.argv[1])
epsilons = []
for population, cohort, rounds, bands, sigma, delta in settings["events"]:
    event = accounting.amplified_bandmf_event(sigma, rounds, num_bands=bands, sampling_prob=cohort * bands / population)
    epsilons.append([PLDAccountant(value_discretization_interval=1e-3).compose(event).get_epsilon(delta),
                     dp_accounting.rdp.RdpAccountant().compose(event).get_epsilon(delta)])
losses = []
for rounds, bands in settings["losses"]:
    bsr = toeplitz.optimal_max_error_strategy_coefs(bands)
    optimised = toeplitz.optimize_banded_toeplitz(n=rounds, bands=bands, reduction_fn=jnp.mean)
    losses.append([float(toeplitz.loss(bsr, n=rounds)), float(toeplitz.loss(optimised, n=rounds))])
print(json.dumps({"epsilons": epsilons, "losses": losses}))
"""


def main() -> None:
    """Run the child, print both sides."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jax-python", required=True, help="a Python with jax_privacy installed")
    args = parser.parse_args()
    settings = json.dumps({"events": EVENTS, "losses": LOSSES})
    reply = json.loads(subprocess.run([args.jax_python, "-c", CHILD, settings], capture_output=True, text=True,
                                      check=True).stdout)
    print("| N | K | T | b | σ | δ | ε PLD fedhog | ε PLD jax_privacy | rel. diff | ε RDP fedhog | ε RDP jax_privacy "
          "| rel. diff |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    for (population, cohort, rounds, bands, sigma, delta), (pld, rdp) in zip(EVENTS, reply["epsilons"], strict=True):
        participation = BandedParticipation(population, cohort, rounds, bands)
        ours_pld = banded_epsilon(sigma, participation, delta, "pld")
        ours_rdp = banded_epsilon(sigma, participation, delta, "rdp")
        print(f"| {population} | {cohort} | {rounds} | {bands} | {sigma:g} | {delta:g} | {ours_pld:.9f} | {pld:.9f} "
              f"| {abs(ours_pld / pld - 1):.1e} | {ours_rdp:.9f} | {rdp:.9f} | {abs(ours_rdp / rdp - 1):.1e} |")
    print("\n| T | b | BSR loss fedhog | BSR loss jax_privacy | rel. diff | optimised fedhog | optimised jax_privacy "
          "|\n|---|---|---|---|---|---|---|")
    for (rounds, bands), (bsr, optimised) in zip(LOSSES, reply["losses"], strict=True):
        ours = mean_prefix_loss(bsr_coefficients(bands), rounds)
        ours_optimised = mean_prefix_loss(optimised_coefficients(bands, rounds), rounds)
        print(f"| {rounds} | {bands} | {ours:.6f} | {bsr:.6f} | {abs(ours / bsr - 1):.1e} | {ours_optimised:.6f} "
              f"| {optimised:.6f} |")


if __name__ == "__main__":
    main()
