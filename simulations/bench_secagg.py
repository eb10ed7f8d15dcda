"""Round time and bytes per client of SecAgg+ against the trusted mode, cohorts of 10, 50 and 100.

Every client is sampled (population = cohort, ``sampling = "fixed"``,
q = 1): MNIST-1D, the MLP (7 434 parameters), one local epoch, HOG mixing
(γ = 0.5, σ = 1), the in-process engine (one message per client, serialised
both ways as a transport would). Each configuration runs 3 rounds in this
process; the time is the median of rounds 2..3 of ``metrics.json``'s
``seconds`` (sampling to evaluation). Bytes are the serialised Flower
messages (``message_to_proto(...).ByteSize()``) of a round, both ways, per
client: the trusted mode sends the model and gets Δ and t back; SecAgg+ adds
its four stages (public keys, encrypted shares, the masked vector of b-bit
residues, the shares for unmasking).

Rows: ``trusted``; ``secagg`` (SecAgg+ over the whole cohort, k = n,
threshold 0.66); ``secagg+ k=<k>`` (a ring of k neighbours, the SecAgg+ of
Bell et al.; k ≈ 2·log2(n), odd); ``... + distributed noise``: the same
ring (or the whole cohort when it is smaller) with ``noise = "distributed"``,
each client drawing its d discrete Gaussians. Ratios are against ``trusted``
at the same cohort.

Usage::

    python simulations/bench_secagg.py            # a Markdown table
    python simulations/bench_secagg.py --cohorts 10 --json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

WORKLOAD = {"dataset": "mnist1d", "model": "mlp", "sampling": "fixed", "sampling-rate": 1.0,
            "partitioner": "iid", "local-epochs": 1, "batch-size": 16, "learning-rate": 0.05,
            "mechanism": "hog", "noise-multiplier": 1.0, "mixing-strength": 0.5, "clipping-norm": 1.0,
            "rounds": 3, "privacy-seed": 1}


def _sparse_shares(cohort: int) -> int:
    return int(2 * math.log2(cohort)) | 1


def measure(cohort: int, mode: str, shares: int, directory: Path, noise: str = "central") -> dict:
    """Run one configuration; its round seconds and bytes per client and round."""
    from flwr.app import Context, RecordDict
    from flwr.common.serde import message_to_proto

    from fedhog.client_app import app as client_app
    from fedhog.config import RunConfig
    from fedhog.engines.inprocess import InProcessGrid
    from fedhog.server_app import app as server_app

    class CountingGrid(InProcessGrid):
        sent = received = 0

        def push_messages(self, messages):
            messages = list(messages)
            self.sent += sum(message_to_proto(m).ByteSize() for m in messages)
            return super().push_messages(messages)

        def pull_messages(self, message_ids):
            replies = list(super().pull_messages(message_ids))
            self.received += sum(message_to_proto(r).ByteSize() for r in replies)
            return replies

    config = RunConfig().with_overrides({
        **WORKLOAD, "population": cohort, "num-samples": 40 * cohort, "secure-aggregation": mode,
        "secagg-num-shares": shares, "noise": noise, "results-dir": str(directory)})
    grid = CountingGrid(client_app, cohort, config.to_mapping())
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                             run_config=config.to_mapping()))
    rounds = json.loads((directory / "metrics.json").read_text())["rounds"]
    per_client_round = cohort * config.rounds
    label = mode if mode == "off" else (f"secagg+ k={shares}" if shares else "secagg")
    return {"cohort": cohort, "mode": label + (" + distributed noise" if noise == "distributed" else ""),
            "seconds": statistics.median(r["seconds"] for r in rounds[1:]),
            "upload_bytes": grid.received / per_client_round, "download_bytes": grid.sent / per_client_round}


def main() -> None:
    """Print the table (or JSON)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohorts", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    import logging

    logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for cohort in args.cohorts:
            ring = _sparse_shares(cohort) if _sparse_shares(cohort) < cohort else 0
            variants = [("off", 0, "central"), ("secagg+", 0, "central")]
            if ring:
                variants.append(("secagg+", ring, "central"))
            variants.append(("secagg+", ring, "distributed"))
            for mode, shares, noise in variants:
                rows.append(measure(cohort, mode, shares, Path(folder) / f"{cohort}-{mode}-{shares}-{noise}", noise))
    if args.json:
        print(json.dumps({"rows": rows}, indent=1))
        return
    trusted = {r["cohort"]: r for r in rows if r["mode"] == "off"}
    print("| cohort | mode | s / round | × trusted | upload B / client | × trusted | download B / client | × trusted |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t = trusted[r["cohort"]]
        print(f"| {r['cohort']} | {'trusted' if r['mode'] == 'off' else r['mode']} | {r['seconds']:.2f} | "
              f"{r['seconds'] / t['seconds']:.1f} | {r['upload_bytes']:,.0f} | "
              f"{r['upload_bytes'] / t['upload_bytes']:.2f} | "
              f"{r['download_bytes']:,.0f} | {r['download_bytes'] / t['download_bytes']:.2f} |")


if __name__ == "__main__":
    main()
