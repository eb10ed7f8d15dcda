"""What noise-aware mixing assumes, measured on finished runs: is ½τ² tr ∇²L(θ) the loss the release noise adds?

For each results folder (a run's ``final_model.pt`` and ``config.toml``) it prints, on the test set:
L(θ); the Monte-Carlo loss of the noised model E_z[L(θ + z)] − L(θ) for z ~ N(0, τ²I), τ = η_s σ C/(K(1 − β))
(:func:`fedhog.privacy.noise_aware.release_noise_std`, from the noise std the run's last round recorded); and
the second-order prediction ½τ² tr ∇²L(θ), tr ∇²L by Hutchinson (Rademacher: the quadratic forms of
:func:`fedhog.derivatives.hessian_trace_gradient`). Where the two agree the smoothed loss's expansion holds at
the noise's scale; where they do not, ∇ tr ∇²L is not the gradient of what the noise costs. Each estimate comes
with its standard error.

Usage::

    python simulations/smoothing_gap.py RESULTS_DIR [RESULTS_DIR ...] [--draws 64] [--directions 64]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import nn

from fedhog.config import load_config
from fedhog.data import dataset_info, load_test_set
from fedhog.derivatives import hessian_trace_gradient
from fedhog.models import build_model
from fedhog.privacy.noise_aware import release_noise_std

EXAMPLES = 1000  # test examples the trace is estimated on (the loss differences use the same ones)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def measure(folder: Path, draws: int, directions: int) -> dict[str, float]:
    """L, the Monte-Carlo noise cost and ½τ² tr ∇²L (with standard errors) for one run's final model."""
    config = load_config(folder / "config.toml")
    last = json.loads((folder / "metrics.json").read_text())["rounds"][-1]
    momentum = config.server_momentum if config.server_optimizer == "momentum" else 0.0
    # the release's noise std on ū, σ(C + lattice slack)/K, as the run recorded it (σ calibrated): τ's σC/K
    tau = release_noise_std(float(last["noise_std"]), 1.0, 1.0, config.server_learning_rate, momentum)
    model = build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)
    model.load_state_dict(torch.load(folder / "final_model.pt"))
    model.eval()
    test = load_test_set(config.data_spec)
    x, y = torch.as_tensor(test.x[:EXAMPLES]), torch.as_tensor(test.y[:EXAMPLES])
    base = _loss(model, x, y)
    generator = torch.Generator().manual_seed(0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    costs = []
    for _ in range(draws):
        model.load_state_dict({k: v + tau * torch.randn(v.shape, generator=generator) for k, v in state.items()})
        costs.append(_loss(model, x, y) - base)
    model.load_state_dict(state)
    forms = hessian_trace_gradient(model, x, y, samples=directions, generator=torch.Generator().manual_seed(1)).values
    assert forms is not None
    mean_cost = sum(costs) / draws
    cost_se = math.sqrt(sum((c - mean_cost) ** 2 for c in costs) / (draws - 1) / draws)
    return {"tau": tau, "loss": base, "noise_cost": mean_cost, "noise_cost_se": cost_se,
            "second_order": 0.5 * tau**2 * float(forms.mean()),
            "second_order_se": 0.5 * tau**2 * float(forms.std()) / math.sqrt(directions)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--draws", type=int, default=64, help="noise draws z for E_z[L(θ + z)]")
    parser.add_argument("--directions", type=int, default=64, help="Hutchinson directions for tr ∇²L")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| run | τ | L(θ) | E_z[L(θ+z)] − L(θ) | ½τ² tr ∇²L(θ) |")
    print("|---|---|---|---|---|")
    for folder in args.folders:
        r = measure(folder, args.draws, args.directions)
        print(f"| {folder.name} | {r['tau']:.4f} | {r['loss']:.4f} | {r['noise_cost']:.4f} ± {r['noise_cost_se']:.4f} "
              f"| {r['second_order']:.4f} ± {r['second_order_se']:.4f} |")


if __name__ == "__main__":
    main()
