"""What secure noise costs: fedhog's noise on the sum against torch.randn, for 1M and 5M floats.

Each row times, interleaved and repeated (median), on the same machine in one run:

- ``torch.randn float32`` / ``float64``: PyTorch's CPU generator (Mersenne Twister), what the first wave used;
- ``fedhog, seeded``: :func:`fedhog.privacy.mechanism.add_noise` with a fixed privacy seed (PCG64);
- ``fedhog, OS entropy``: the same with fresh 256-bit ChaCha20 keys (the default), split into
  ``keystream`` (the ChaCha20 words alone, as many as the draw consumes) and the rest (the exact
  discrete Gaussian sampler, the sum);
- ``Opacus secure mode``: its sampler's arithmetic, 4 + 1 ``torch.normal`` calls (here from torch's
  default generator; Opacus draws them from torchcsprng, which is slower).

Ratios are to ``torch.randn float64``, the first wave's noise. ``--threads`` pins torch's threads.
Run: ``python simulations/bench_noise.py`` (about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import SecureBits, SeededBits


def opacus_secure_sampler(count: int) -> torch.Tensor:
    """Opacus' secure_mode noise: one discarded draw, then the mean of four (Holohan & Braghin 2021)."""
    torch.normal(0.0, 1.0, size=(1, 1))
    total = torch.zeros(count)
    for _ in range(4):
        total += torch.normal(0.0, 1.0, size=(count,))
    return total / 2


class _CountingBits:
    """A RandomBits that counts the words drawn through it."""

    def __init__(self, bits: SeededBits) -> None:
        self.bits, self.count = bits, 0

    def words(self, count: int):
        self.count += count
        return self.bits.words(count)


def measure(candidates: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each candidate, timed round-robin so that load hits all alike."""
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for fn in candidates.values():
        fn()  # warm up
    for _ in range(repeats):
        for name, fn in candidates.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def _candidates(size: int, settings: GaussianMechanism, lattice: NoiseLattice, zero_sum: torch.Tensor,
                consumed: int) -> dict[str, Callable[[], object]]:
    """The draws a row times, each a call of its own (fresh bits where the real run takes fresh bits)."""
    return {
        "randn32": lambda: torch.randn(size),
        "randn64": lambda: torch.randn(size, dtype=torch.float64),
        "seeded": lambda: settings.add_noise(zero_sum, lattice, SeededBits(1), 0),
        "secure": lambda: settings.add_noise(zero_sum, lattice, SecureBits(), 0),
        "keystream": lambda: SecureBits().words(consumed),
        "opacus": lambda: opacus_secure_sampler(size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 5_000_000])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = GaussianMechanism(clipping_norm=1.0, noise_multiplier=1.0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.repeats}, seconds "
          "(ratio to torch.randn float64)")
    print("| floats | torch.randn float32 | torch.randn float64 | fedhog, seeded | fedhog, OS entropy "
          "| of which keystream | Opacus secure mode |")
    print("|---|---|---|---|---|---|---|")
    for size in args.sizes:
        lattice = NoiseLattice.for_settings(settings, size)
        zero_sum = torch.zeros(size, dtype=torch.int64)
        counter = _CountingBits(SeededBits(1))
        settings.add_noise(zero_sum, lattice, counter, 0)
        consumed = counter.count
        candidates = _candidates(size, settings, lattice, zero_sum, consumed)
        median = measure(candidates, args.repeats)
        base = median["randn64"]
        cells = [f"{median[name] * 1e3:.1f} ms ({median[name] / base:.2f}×)" for name in candidates]
        print(f"| {size:,} | " + " | ".join(cells) + f" |   ({consumed / size:.2f} words a value)")


if __name__ == "__main__":
    main()
