"""Third-order step size (`optimizer = hog-step`) against tuned SGD on MNIST-1D.

Centralised training (no federation, no privacy) of one model with each
optimizer for the same budget of minibatch steps, over several seeds. SGD's
learning rate is tuned on a grid (the best mean final training loss wins);
hog-step's `learning-rate` is its largest allowed step, tuned on a grid of its own.
Prints one Markdown table: final training loss and test accuracy (mean ± std
over seeds) and seconds per step relative to SGD.

    python simulations/compare_optimizers.py [--steps 300] [--seeds 3] [--model mlp]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fedhog.data import DataSpec, dataset_info, load_client_data, load_test_set
from fedhog.models import build_model
from fedhog.training import evaluate, train_locally

GRIDS = {"sgd": (0.03, 0.1, 0.3, 1.0), "hog-step": (0.3, 1.0, 3.0, 10.0)}


def run(optimizer: str, learning_rate: float, seed: int, args: argparse.Namespace) -> dict[str, float]:
    """Train from a seeded initialisation; return final loss, accuracy and seconds per step."""
    spec = DataSpec(dataset="mnist1d", num_samples=args.samples, partitioner="iid", population=1,
                    validation_fraction=0.0, seed=0)
    train, _ = load_client_data(spec, 0)
    torch.manual_seed(seed)
    model = build_model(args.model, *dataset_info(spec))
    epochs = max(1, -(-args.steps * args.batch_size // len(train)))
    used = args.steps * args.batch_size // epochs
    subset = type(train)(train.x[:used], train.y[:used])
    started = time.perf_counter()
    local = train_locally(model, subset, epochs, args.batch_size, learning_rate, 0.0, seed, optimizer)
    seconds = (time.perf_counter() - started) / local.steps
    train_loss, _ = evaluate(model, train)
    _, accuracy = evaluate(model, load_test_set(spec))
    return {"loss": train_loss, "accuracy": accuracy, "seconds_per_step": seconds,
            "cubic_fraction": local.cubic_steps / local.steps}


def summarise(runs: list[dict[str, float]], key: str) -> tuple[float, float]:
    values = [r[key] for r in runs]
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--samples", type=int, default=5000)
    args = parser.parse_args()
    torch.set_num_threads(2)
    seeds = list(range(args.seeds))
    best: dict[str, tuple[float, list[dict[str, float]]]] = {}
    for optimizer, grid in GRIDS.items():
        for lr in grid:
            runs = [run(optimizer, lr, seed, args) for seed in seeds]
            mean_loss = summarise(runs, "loss")[0]
            print(f"  {optimizer:8s} lr={lr:<5g} final training loss {mean_loss:.4f}", flush=True)
            if optimizer not in best or mean_loss < summarise(best[optimizer][1], "loss")[0]:
                best[optimizer] = (lr, runs)
    sgd_seconds = summarise(best["sgd"][1], "seconds_per_step")[0]
    print(f"\nMNIST-1D, {args.model}, {args.steps} steps of batch {args.batch_size}, {args.seeds} seeds "
          "(mean ± std), best learning rate of the grid per optimizer\n")
    print("| optimizer | learning rate (max step) | final training loss | test accuracy | time per step vs SGD "
          "| steps at the cubic minimiser |")
    print("|---|---|---|---|---|---|")
    for optimizer, (lr, runs) in best.items():
        loss, accuracy = summarise(runs, "loss"), summarise(runs, "accuracy")
        ratio = summarise(runs, "seconds_per_step")[0] / sgd_seconds
        cubic = f"{summarise(runs, 'cubic_fraction')[0]:.0%}" if optimizer == "hog-step" else "–"
        print(f"| {optimizer} | {lr:g} | {loss[0]:.4f} ± {loss[1]:.4f} | {accuracy[0]:.3f} ± {accuracy[1]:.3f} "
              f"| {ratio:.1f}× | {cubic} |")


if __name__ == "__main__":
    main()
