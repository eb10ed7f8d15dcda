"""Write a generated, imbalanced, fraud-like card-transaction table split by bank (offline, seeded).

    python simulations/make_fraud_data.py                       # data/fraud.csv: 50 banks, 50 000 rows
    python simulations/make_fraud_data.py --out data/fraud.parquet

Columns: ``bank`` (the client: 50 banks of lognormal sizes), ``is_fraud`` (the
label, ~2 % positives; each bank its own rate between 0.5 % and 5 %), and the
features ``amount`` (lognormal), ``hour`` (0–23), ``merchant_category`` (codes
0–9: categorical-looking numbers), ``channel`` (0 card present, 1 online, 2 ATM),
``foreign`` (0/1), ``distance_km`` (lognormal), ``transactions_1h`` (a count),
``account_age_days``. Banks differ in their customers (amount and distance
shift per bank) as well as in their fraud rates.

Fraud follows a logistic model of the features with interactions (online +
foreign at night, large amounts at risky merchant categories, young accounts
with many transactions in the hour) and a per-bank intercept solved so that the
bank's expected fraud rate is its own rate: a linear model finds part of the
signal, a small network more.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import brentq
from scipy.special import expit

RISKY_CATEGORIES = (3, 7)  # merchant categories (codes) where large amounts are suspicious


def make_fraud_table(banks: int = 50, rows: int = 50_000, seed: int = 0) -> pd.DataFrame:
    """The table described in the module docstring, one row per transaction."""
    rng = np.random.default_rng(seed)
    sizes = rng.lognormal(0.0, 0.9, banks)
    counts = np.maximum(100, np.round(sizes / sizes.sum() * rows)).astype(int)
    rates = np.clip(rng.lognormal(np.log(0.02), 0.6, banks), 0.005, 0.05)
    frames = []
    for bank, (n, rate) in enumerate(zip(counts, rates, strict=True)):
        amount_shift, distance_shift = rng.normal(0, 0.3), rng.normal(0, 0.3)
        hour = rng.integers(0, 24, n)
        channel = rng.choice(3, n, p=[0.6, 0.3, 0.1])
        foreign = (rng.random(n) < 0.08).astype(int)
        category = rng.integers(0, 10, n)
        amount = np.round(rng.lognormal(3.5 + amount_shift, 1.0, n), 2)
        distance = np.round(rng.lognormal(1.5 + distance_shift, 1.2, n), 1)
        velocity = rng.poisson(1.0, n)
        age = rng.integers(1, 3650, n)
        night = (hour < 6).astype(float)
        risky = np.isin(category, RISKY_CATEGORIES).astype(float)
        score = 2.0 * (0.6 * (np.log(amount) - 3.5) + 1.6 * (channel == 1) * foreign * (0.5 + night)
                 + 1.2 * risky * (amount > np.exp(4.5)) + 0.5 * night + 0.35 * np.log1p(distance)
                 + 0.8 * (velocity >= 3) * (age < 180) + 0.25 * velocity - 0.4 * (channel == 0)
                 + rng.normal(0, 0.3, n))
        intercept = brentq(lambda a, score, rate: expit(a + score).mean() - rate, -40, 40, args=(score, rate))
        fraud = (rng.random(n) < expit(intercept + score)).astype(int)
        frames.append(pd.DataFrame({
            "bank": f"bank-{bank:02d}", "amount": amount, "hour": hour, "merchant_category": category,
            "channel": channel, "foreign": foreign, "distance_km": distance, "transactions_1h": velocity,
            "account_age_days": age, "is_fraud": fraud}))
    return pd.concat(frames, ignore_index=True).sample(frac=1.0, random_state=seed).reset_index(drop=True)


def main() -> None:
    """Write the table as CSV or Parquet (by the file's suffix) and print its shape and fraud rates."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/fraud.csv"), help="a .csv or .parquet file")
    parser.add_argument("--banks", type=int, default=50)
    parser.add_argument("--rows", type=int, default=50_000, help="about this many (each bank has ≥ 100)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    table = make_fraud_table(args.banks, args.rows, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix == ".parquet":
        table.to_parquet(args.out, index=False)
    else:
        table.to_csv(args.out, index=False)
    by_bank = table.groupby("bank")["is_fraud"].agg(["size", "mean"])
    print(f"{args.out}: {len(table)} rows, {args.banks} banks ({by_bank['size'].min()}–{by_bank['size'].max()} rows "
          f"each), fraud {table['is_fraud'].mean():.2%} overall, {by_bank['mean'].min():.2%}–"
          f"{by_bank['mean'].max():.2%} by bank")


if __name__ == "__main__":
    main()
