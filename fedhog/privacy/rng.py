"""The dedicated randomness of the privacy mechanism.

DP noise, client sampling and the mixing coefficients ξ never come from numpy's
or torch's global generators (data generators such as mnist1d reseed those).
"""

from __future__ import annotations

import secrets

import numpy as np
import torch


class PrivacyRng:
    """Generators for sampling, ξ and Gaussian noise, seeded together.

    Parameters
    ----------
    seed : int or None
        ``None`` draws 128 bits of OS entropy: what a deployment must use. A
        fixed seed makes experiments repeatable but the noise predictable to
        anyone who knows it.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed_is_fixed = seed is not None
        entropy = secrets.randbits(128) if seed is None else seed
        sampling_seq, noise_seq, mixing_seq = np.random.SeedSequence(entropy).spawn(3)
        self.sampling = np.random.default_rng(sampling_seq)
        self.noise = torch.Generator(device="cpu")
        self.noise.manual_seed(int(noise_seq.generate_state(1, dtype=np.uint64)[0]))
        # ξ has a stream of its own, so that runs with and without mixing draw the same noise
        self.mixing = torch.Generator(device="cpu")
        self.mixing.manual_seed(int(mixing_seq.generate_state(1, dtype=np.uint64)[0]))

    def standard_normals(self, count: int) -> list[float]:
        """ξ_1..ξ_count ~ N(0, 1), drawn from the mixing generator."""
        return torch.randn(count, generator=self.mixing, dtype=torch.float64).tolist()

    def state_dict(self) -> dict[str, object]:
        """The generators' states, for checkpoints."""
        return {"sampling": self.sampling.bit_generator.state, "noise": self.noise.get_state(),
                "mixing": self.mixing.get_state()}

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore states written by :meth:`state_dict`."""
        self.sampling.bit_generator.state = state["sampling"]
        self.noise.set_state(state["noise"])
        self.mixing.set_state(state["mixing"])
