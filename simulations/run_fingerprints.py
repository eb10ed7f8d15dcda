"""Fingerprints of short fixed-seed runs, to show a refactoring changed no result bit for bit.

Runs each configuration below with a fixed ``privacy-seed`` (private randomness repeatable: for experiments only)
through the CLI, in its own results folder, and prints one line per run: a SHA-256 of every round's record
without its timings, and one of the final model's tensors. Run it before and after a change and compare:

    python simulations/run_fingerprints.py OUT_DIR > before.txt   # on the old tree
    python simulations/run_fingerprints.py OUT_DIR > after.txt    # on the new one
    diff <(grep ^fingerprint before.txt) <(grep ^fingerprint after.txt)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from fedhog.cli import main as fedhog_main

SMALL = ["rounds=2", "population=200", "num-samples=4000", "sampling-rate=0.1", "privacy-seed=7"]
RUNS: dict[str, tuple[str, list[str]]] = {
    "dp-fedavgm, vectorized": ("vectorized", []),
    "dp-fedavgm, in-process": ("inprocess", []),
    "hog + adaptive clipping": ("vectorized", ['mechanism="hog"', "adaptive-clipping=true"]),
    "noise-aware mixing": ("vectorized", ['mechanism="hog"', 'hog-mixing="noise-aware"']),
    "SecAgg+, central noise": ("inprocess", ['secure-aggregation="secagg+"', "population=20", "sampling-rate=0.5"]),
    "SecAgg+, distributed noise": ("inprocess", ['secure-aggregation="secagg+"', 'noise="distributed"',
                                                 'sampling="fixed"',
                                                 "population=20", "sampling-rate=0.5"]),
    "flower-dp baseline": ("inprocess", ['aggregator="flower-dp"', 'sampling="fixed"', 'accountant="rdp"']),
    "dp-sgd clients, adam server": ("vectorized", ['client-dp="dpsgd"', 'server-optimizer="adam"']),
}
TIMINGS = {"seconds", "third_order_seconds_max", "bytes_received"}


def fingerprint(folder: Path) -> tuple[str, str]:
    """SHA-256 of the rounds' records (timings left out) and of the final model's tensors."""
    rounds = json.loads((folder / "metrics.json").read_text())["rounds"]
    records = [{k: v for k, v in r.items() if k not in TIMINGS} for r in rounds]
    state = torch.load(folder / "final_model.pt", map_location="cpu", weights_only=True)
    model = hashlib.sha256()
    for key in sorted(state):
        model.update(key.encode() + state[key].contiguous().numpy().tobytes())
    return hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16], model.hexdigest()[:16]


def main(out: Path) -> None:
    quickstart = Path(__file__).resolve().parents[1] / "configs" / "quickstart.toml"
    for number, (name, (engine, overrides)) in enumerate(RUNS.items()):
        folder = out / f"run{number}"
        sets = [f"--set={s}" for s in [*SMALL, *overrides, f'results-dir="{folder}"']]
        code = fedhog_main(["run", str(quickstart), "--engine", engine, "--overwrite", *sets])
        if code:
            print(f"{name}: exit {code}")
            continue
        records, model = fingerprint(folder)
        print(f"fingerprint {name}: rounds {records}  model {model}", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
