"""The figures of the README's *Auditing privacy*: every mechanism audited at ε = 3 and ε = 8.

Prints one Markdown row per (mechanism, ε) and writes the audits' JSON to
``--output``. Each row is ``fedhog.audit()`` on a small committed setting (1000
clients, 10 % sampled, 10 rounds, worst-case canaries) unless it says
otherwise; ``--goal`` adds the Gaussian mechanism's rows at the quickstart's
setting (10 000 clients, 5 %, 80 rounds) and at a few-round one, with two
million trials each.

    nice -n 10 python simulations/audit_table.py --output results/audit-table [--goal] [--only NAME]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from pathlib import Path

from fedhog.auditing import runner

logging.getLogger("flwr").setLevel(logging.WARNING)
SETTING = {"population": 1000, "sampling-rate": 0.1, "rounds": 10}
DPSGD_RECORDS, DPSGD_BATCH = 2000, 200  # one epoch of 10 Poisson steps at q = 0.1, as the table's setting

# name -> (config overrides, harness, canaries per run, runs)
CASES: dict[str, tuple[dict, str, int, int]] = {
    "gaussian, Poisson": ({"mechanism": "gaussian"}, "vectorized", 250_000, 4),
    "gaussian, fixed-size": ({"mechanism": "gaussian", "sampling": "fixed"}, "vectorized", 250_000, 4),
    "hog γ = 0.5 (third-order or random term)": ({"mechanism": "hog", "mixing-strength": 0.5}, "vectorized",
                                                  250_000, 4),
    "hog γ = 2": ({"mechanism": "hog", "mixing-strength": 2.0}, "vectorized", 250_000, 4),
    "gaussian, adaptive clipping": ({"mechanism": "gaussian", "adaptive-clipping": True}, "vectorized", 250_000, 4),
    "gaussian, end-to-end strategy": ({"mechanism": "gaussian"}, "strategy", 1000, 20),
    "secagg+, central noise": ({"mechanism": "gaussian", "secure-aggregation": "secagg+"}, "vectorized", 1000, 100),
    "secagg+, distributed noise": ({"mechanism": "gaussian", "secure-aggregation": "secagg+", "noise": "distributed",
                                    "sampling": "fixed"}, "vectorized", 1000, 20),
    "flower-dp (Flower's wrapper)": ({"aggregator": "flower-dp", "mechanism": "gaussian", "sampling": "fixed",
                                      "accountant": "rdp"}, "vectorized", 1000, 50),
    "DP-SGD, record-level": ({"client-dp": "dpsgd", "mechanism": "gaussian", "batch-size": DPSGD_BATCH,
                              "local-epochs": 1}, "vectorized", DPSGD_RECORDS, 200),
}
GOAL_CASES: dict[str, tuple[dict, str, int, int]] = {
    "gaussian, quickstart setting (N = 10 000, q = 0.05, T = 80)": (
        {"mechanism": "gaussian", "population": 10_000, "sampling-rate": 0.05, "rounds": 80}, "vectorized",
        250_000, 8),
    "gaussian, few rounds (N = 1000, q = 0.5, T = 5)": (
        {"mechanism": "gaussian", "population": 1000, "sampling-rate": 0.5, "rounds": 5}, "vectorized",
        500_000, 4),
}


def dpsgd_noise_multiplier(epsilon: float) -> float:
    """σ of DP-SGD whose PRV ε after one epoch of the table's Poisson steps is ``epsilon`` (Opacus' calibration)."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=1e-5,
                                      sample_rate=DPSGD_BATCH / DPSGD_RECORDS, steps=DPSGD_RECORDS // DPSGD_BATCH,
                                      accountant="prv", epsilon_tolerance=0.005))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, default=Path("results/audit-table"))
    parser.add_argument("--goal", action="store_true", help="also the two-million-trial Gaussian rows")
    parser.add_argument("--only", action="append", default=[], help="run only cases whose name contains this")
    parser.add_argument("--epsilons", default="3,8")
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)
    cases = {**CASES, **(GOAL_CASES if args.goal else {})}
    print("| mechanism | ε accounted | ε ≥ (every round) | ε ≥ (final model) | ε ≈ (μ-GDP estimate, every round) "
          "| statistic | trials | harness | seconds |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (overrides, harness_name, canaries, runs) in cases.items():
        if args.only and not any(part in name for part in args.only):
            continue
        for epsilon in (float(e) for e in args.epsilons.split(",")):
            config = {**SETTING, **overrides}
            if config.get("client-dp") == "dpsgd":
                config["dpsgd-noise-multiplier"] = dpsgd_noise_multiplier(epsilon)
                config["noise-multiplier"] = 1.0  # the server's mechanism is not what this row audits
            else:
                config["target-epsilon"] = epsilon
            started = time.perf_counter()
            result = runner.audit(config, runs=runs, canaries=canaries, harness_name=harness_name)
            every, final = result.threat_models["every-round"], result.threat_models["final-model"]
            share = every.epsilon_lower_bound / result.epsilon_accounted if math.isfinite(
                result.epsilon_accounted) else 0.0
            print(f"| {name} | {result.epsilon_accounted:.2f} | **{every.epsilon_lower_bound:.2f}** ({share:.0%}) | "
                  f"{final.epsilon_lower_bound:.2f} | {every.epsilon_estimate_gdp:.2f} | {every.statistic} | "
                  f"{result.runs} × {result.canaries_per_run} | {result.harness} | "
                  f"{time.perf_counter() - started:.0f} |", flush=True)
            slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
            (args.output / f"{slug}-eps{epsilon:g}.json").write_text(json.dumps(result.to_json(), indent=2) + "\n")


if __name__ == "__main__":
    main()
