"""Does the activation (or the normalisation) decide what DP costs? Final accuracy per activation, normalisation, seed.

Runs a committed run config (default ``configs/convergence_plain.toml``: the
built-in cnn1d at plain settings in the convergence federation, ε = 3) once per
``--activations`` × ``--normalizations`` × ``--seeds``, each in its own folder
under ``--output`` (finished runs are kept and reused: run it again after an
interruption), then prints one Markdown row per activation and normalisation
(``fedhog.models.NORMALIZATIONS``): final test accuracy mean ± std over the
seeds (sample std, n − 1), the single runs, training seconds (the rounds' own
time from ``metrics.json``, without start-up and data loading), and the
diagnostics of the final models (:mod:`fedhog.diagnostics`, recomputed from
each folder): the largest growth of a layer's weight norm since
initialisation, how much of its movement the noise's random walk explains,
and for tanh the largest fraction of saturated units.

Usage::

    python simulations/activation_table.py                                  # plain cell, every activation, seed 0
    python simulations/activation_table.py configs/convergence_tuned.toml --activations silu --seeds 0 1 2
    python simulations/activation_table.py --jobs 2                          # two runs at a time, 1 thread each
    python simulations/activation_table.py --activations gelu --normalizations none ws --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fedhog.models import ACTIVATIONS, NORMALIZATIONS

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "convergence_plain.toml"


def _folder(output: Path, activation: str, normalization: str, seed: int) -> Path:
    """A cell's results folder (``gelu-seed0``: the name from before the normalisation was a choice)."""
    name = activation if normalization == "none" else f"{activation}-{normalization}"
    return output / f"{name}-seed{seed}"


def _run(config: Path, folder: Path, activation: str, normalization: str, seed: int, threads: int) -> None:
    """``fedhog run`` one cell in a child process (``threads`` PyTorch threads), unless it finished already."""
    metrics = folder / "metrics.json"
    if metrics.is_file() and json.loads(metrics.read_text()).get("status") == "finished":
        return
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with open(folder.with_suffix(".log"), "w", encoding="utf-8") as log:
        subprocess.run([sys.executable, "-m", "fedhog.cli", "run", str(config), "--overwrite",
                        "--set", f"activation={activation}", "--set", f"normalization={normalization}",
                        "--set", f"seed={seed}",
                        "--set", f"results-dir={folder}"], env=env, stdout=log, stderr=subprocess.STDOUT,
                       check=False)


def final_diagnostics(folder: Path) -> dict[str, float]:
    """:mod:`fedhog.diagnostics` of a finished run's final model, recomputed from its folder.

    The initial model is rebuilt as the ServerApp built it (``torch.manual_seed(seed)``, then the model), so
    runs from before the diagnostics existed get them too.
    """
    import torch

    from fedhog.config import load_config
    from fedhog.data import dataset_info, load_test_set
    from fedhog.diagnostics import saturated_fractions, weight_diagnostics
    from fedhog.models import build_model

    config = load_config(folder / "config.toml")
    document = json.loads((folder / "metrics.json").read_text())
    torch.manual_seed(config.seed)
    model = build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    final = torch.load(folder / "final_model.pt", weights_only=True)
    model.load_state_dict(final)
    momentum = {"sgd": 0.0, "momentum": config.server_momentum}.get(config.server_optimizer)
    last = document["rounds"][-1]
    layers = weight_diagnostics(initial, final, last["round"], last["noise_std"], config.server_learning_rate,
                                momentum)
    return {**layers, **saturated_fractions(model, torch.as_tensor(load_test_set(config.data_spec).x[:512]))}


def _worst(layers: list[dict[str, float]], kind: str) -> float:
    values = [v for d in layers for k, v in d.items() if k.startswith(f"{kind}/")]
    return max(values) if values else math.nan


def _row(activation: str, normalization: str, folders: list[Path]) -> str:
    documents = [json.loads((f / "metrics.json").read_text()) if (f / "metrics.json").is_file() else {}
                 for f in folders]
    finished = [(f, d) for f, d in zip(folders, documents, strict=True) if d.get("status") == "finished"]
    accuracies = [d["summary"]["final_accuracy"] for _, d in finished]
    if not accuracies:
        return f"| {activation} | {normalization} | – | not finished | | | | |"
    spread = f" ± {statistics.stdev(accuracies):.3f}" if len(accuracies) > 1 else ""
    seconds = [sum(r["seconds"] for r in d["rounds"]) for _, d in finished]
    layers = [final_diagnostics(f) for f, _ in finished]
    saturated = _worst(layers, "saturated")
    return (f"| {activation} | {normalization} | {statistics.mean(accuracies):.3f}{spread} (n = {len(accuracies)}) | "
            f"{', '.join(f'{a:.3f}' for a in accuracies)} | {statistics.mean(seconds):.0f} | "
            f"{_worst(layers, 'growth'):.1f}× | {_worst(layers, 'walk'):.2f} | "
            f"{'–' if math.isnan(saturated) else f'{saturated:.0%}'} |")


def main(argv: list[str] | None = None) -> int:
    """Run the missing cells, print the table; an exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", type=Path, default=DEFAULT, help=f"run config (default: {DEFAULT.name})")
    parser.add_argument("--activations", nargs="+", default=list(ACTIVATIONS), choices=list(ACTIVATIONS))
    parser.add_argument("--normalizations", nargs="+", default=["none"], choices=list(NORMALIZATIONS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--output", type=Path, default=None,
                        help="folder of the runs (default: results/activations/<config name>)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads per run (default 1)")
    parser.add_argument("--report-only", action="store_true", help="run nothing, print what has finished")
    args = parser.parse_args(argv)
    output = args.output or ROOT / "results" / "activations" / args.config.stem
    output.mkdir(parents=True, exist_ok=True)
    cells = [(a, n, s, _folder(output, a, n, s)) for s in args.seeds for a in args.activations
             for n in args.normalizations]
    if not args.report_only:
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda cell: _run(args.config, cell[3], *cell[:3], args.threads), cells))
    print(f"{args.config.name}, seeds {args.seeds}: final test accuracy (100 rounds unless the config says otherwise)")
    print("| activation | normalization | accuracy mean ± std | single runs | training s (mean) | weight growth "
          "| noise walk | saturated |")
    print("|---|---|---|---|---|---|---|---|")
    for activation in args.activations:
        for normalization in args.normalizations:
            print(_row(activation, normalization,
                       [folder for a, n, _, folder in cells if (a, n) == (activation, normalization)]))
    print("\nweight growth: ‖W_T‖/‖W_0‖, noise walk: the noise's expected random walk / ‖W_T − W_0‖, saturated: "
          "share of units past tanh's flat point (|x| > 2) on 512 test examples; each the largest over the layers "
          "and runs, of the final models (fedhog.diagnostics)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
