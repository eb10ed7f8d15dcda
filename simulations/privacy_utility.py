"""The privacy–utility experiment: does higher-order mixing buy accuracy at equal ε?

A thin script over :mod:`fedhog.sweep` (the same as ``fedhog sweep``): runs the
cells of ``configs/sweep_privacy_utility.toml`` — gaussian DP-FedAvg against HOG
mixing at two strengths, with the update direction, and with a random term in
place of the third-order one (the control), at ε ∈ {1, 3, 8}, three paired
seeds each — on the in-process engine, and writes ``results.csv``,
``summary.md`` (final accuracy mean ± std, paired t-test and Wilcoxon per ε)
and the plots into the sweep's output folder. Finished cells are kept: run it
again after an interruption to continue.

Usage::

    python simulations/privacy_utility.py                         # the committed sweep
    python simulations/privacy_utility.py --list                  # cells and which are finished
    python simulations/privacy_utility.py my_sweep.toml --output results/sweeps/mine
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fedhog.sweep.runner import sweep_command

DEFAULT = Path(__file__).resolve().parents[1] / "configs" / "sweep_privacy_utility.toml"


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the sweep; an exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default=str(DEFAULT), help=f"sweep TOML (default: {DEFAULT.name})")
    parser.add_argument("--output", help="output folder (default: the sweep file's `output`)")
    parser.add_argument("--list", dest="list_only", action="store_true", help="list the cells, run nothing")
    parser.add_argument("--threads", type=int, default=1, help="PyTorch threads while cells run (default: 1)")
    args = parser.parse_args(argv)
    return sweep_command(args.config, args.output, args.list_only, args.threads)


if __name__ == "__main__":
    sys.exit(main())
