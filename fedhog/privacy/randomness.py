"""The one source of private randomness: cohort sampling, ξ and the Gaussian noise.

Two sources of raw 64-bit words, one set of samplers on top of them:

- :class:`SecureBits` (``privacy-seed = -1``, the default): a ChaCha20
  keystream (``cryptography``, i.e. OpenSSL) under a fresh 256-bit key read
  from the operating system's generator. The key lives only inside the cipher
  object, which refuses to be pickled, so it cannot reach a checkpoint, a log
  or a metric. Each round (and each DP-SGD client round) gets a new key.
- :class:`SeededBits` (``privacy-seed ≥ 0``, experiments only): NumPy's PCG64
  keyed by the whole seed and a stream key ``(round, stream)`` through a
  ``SeedSequence``. Repeatable — and predictable to anyone who knows the seed.

Samplers never touch NumPy's, Python's or PyTorch's global generators (data
generators such as mnist1d reseed those).

:func:`standard_normal` is Box–Muller in float64, one 64-bit word per
normal. Its radius uses a uniform with 2⁻¹²⁸ resolution near 0 (a second word
is drawn in the rare case the first is below 2⁻¹¹), so normals reach
|z| ≤ :data:`MAX_STANDARD_NORMAL` ≈ 13.37; the mass a Gaussian puts beyond is
below 10⁻⁴⁰. How the mechanism turns
these into noise without floating-point leaks is in
:mod:`fedhog.privacy.mechanism`.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

KEY_BYTES = 32  # ChaCha20's 256-bit key, all of it from the OS
_BLOCK_BYTES = 64
_MAX_BLOCKS = 2**32  # ChaCha20's 32-bit block counter: 256 GiB of keystream per key
_RADIUS_RESOLUTION_BITS = 128  # smallest radius uniform is 2^-129
#: The largest |z| :func:`standard_normal` can return: √(2 · 129 · ln 2).
MAX_STANDARD_NORMAL = math.sqrt(2 * (_RADIUS_RESOLUTION_BITS + 1) * math.log(2))
_EXPONENT_OF_ONE = np.uint64(0x3FF0000000000000)
_CHUNK = 2**17  # normals drawn per pass (1 MiB of float64 each temporary)


class RandomBits(Protocol):
    """A stream of independent uniform 64-bit words."""

    def words(self, count: int) -> np.ndarray:
        """``count`` uniform words as a uint64 array."""


class SecureBits:
    """ChaCha20 keystream under a 256-bit key from the operating system's CSPRNG.

    The key is read once (``secrets.token_bytes``) and handed to the cipher;
    it is not kept as an attribute. Instances cannot be pickled, so no
    checkpoint or ``torch.save`` can carry the generator's state.
    """

    def __init__(self) -> None:
        self._rekey()

    def _rekey(self) -> None:
        nonce = bytes(4) + secrets.token_bytes(12)  # a 32-bit block counter starting at 0, a random 96-bit nonce
        self._encryptor = Cipher(algorithms.ChaCha20(secrets.token_bytes(KEY_BYTES), nonce), mode=None).encryptor()
        self._blocks_left = _MAX_BLOCKS

    def words(self, count: int) -> np.ndarray:
        """``count`` words of keystream (a fresh key before the block counter could wrap)."""
        blocks = -(-8 * count // _BLOCK_BYTES)
        if blocks > self._blocks_left:
            self._rekey()
        self._blocks_left -= blocks
        words = np.zeros(count, dtype="<u8")  # encrypted in place: the keystream itself
        buffer = memoryview(words).cast("B")
        self._encryptor.update_into(buffer, buffer)
        return words.astype(np.uint64, copy=False)

    def __getstate__(self) -> None:
        raise TypeError("SecureBits holds a secret key and cannot be pickled or saved")

    def __repr__(self) -> str:
        return "SecureBits(ChaCha20, 256-bit key from the OS)"


class SeededBits:
    """PCG64 keyed by ``SeedSequence(seed, spawn_key=key)``: repeatable, for experiments only."""

    def __init__(self, seed: int, key: tuple[int, ...] = ()) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be an integer ≥ 0")
        self._generator = np.random.PCG64(np.random.SeedSequence(seed, spawn_key=key))

    def words(self, count: int) -> np.ndarray:
        """The next ``count`` words of the seeded stream."""
        return self._generator.random_raw(count).astype(np.uint64, copy=False)

    def __repr__(self) -> str:
        return "SeededBits(PCG64, fixed seed: predictable)"


@dataclass(frozen=True)
class RoundRandomness:
    """The three independent streams one round draws from.

    ``mixing`` has a stream of its own so that runs with and without mixing
    (same fixed privacy seed) draw the same cohorts and the same noise.
    """

    sampling: RandomBits
    mixing: RandomBits
    noise: RandomBits


class PrivacyRandomness:
    """Where every round's private randomness comes from.

    Parameters
    ----------
    seed : int or None
        ``None``: every round draws fresh 256-bit keys from the OS (what a
        deployment must use; nothing needs saving to resume). An integer: each
        round's streams are derived from ``(seed, round)`` alone, so a resumed
        run draws exactly what a never-stopped one would, again with nothing
        saved — and anyone who knows the seed can predict every draw.
    """

    STREAMS = ("sampling", "mixing", "noise")

    def __init__(self, seed: int | None = None) -> None:
        if seed is not None:
            SeededBits(seed)  # validates
        self.seed = seed

    @property
    def seed_is_fixed(self) -> bool:
        """Whether draws are repeatable (and therefore predictable)."""
        return self.seed is not None

    def for_round(self, server_round: int) -> RoundRandomness:
        """The streams of round ``server_round``."""
        if self.seed is None:
            return RoundRandomness(SecureBits(), SecureBits(), SecureBits())
        return RoundRandomness(*(SeededBits(self.seed, (server_round, i)) for i in range(len(self.STREAMS))))

    def __repr__(self) -> str:
        return "PrivacyRandomness(OS entropy)" if self.seed is None else "PrivacyRandomness(fixed seed)"


def client_bits(seed: int | None, server_round: int, partition_id: int, stream: int = 0) -> RandomBits:
    """A client's own stream for one round: OS entropy, or derived from a fixed seed.

    ``stream`` 0 is DP-SGD's; 1 is secure aggregation's (ξ and stochastic rounding).
    """
    if seed is None:
        return SecureBits()
    return SeededBits(seed, (server_round, len(PrivacyRandomness.STREAMS), partition_id) + ((stream,) if stream else ()))


def uniform(bits: RandomBits, count: int) -> np.ndarray:
    """``count`` uniforms on [0, 1) with 53 random bits each (float64)."""
    return (bits.words(count) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _unit_interval(words: np.ndarray, offset: float) -> np.ndarray:
    """The top 52 bits k of each word as k·2⁻⁵² + ``offset`` in float64, by setting the exponent of 1."""
    return ((words >> np.uint64(12)) | _EXPONENT_OF_ONE).view(np.float64) - (1.0 - offset)


def standard_normal(bits: RandomBits, count: int) -> np.ndarray:
    """``count`` independent N(0, 1) in float64 (Box–Muller; see the module docstring for the tail)."""
    normals = np.empty(count)
    for start in range(0, count, _CHUNK):  # in chunks: the temporaries stay small however large the model
        stop = min(count, start + _CHUNK)
        pairs = (stop - start + 1) // 2
        words = bits.words(2 * pairs)
        high, angle_words = words[:pairs], words[pairs:]
        radius_uniform = _unit_interval(high, 2.0**-53)  # (k + ½)·2⁻⁵²: in (0, 1)
        small = np.flatnonzero(high < np.uint64(2**53))  # below 2⁻¹¹, refined by a second word (p = 2⁻¹¹)
        if small.size:
            radius_uniform[small] = (high[small].astype(np.float64) * 2.0**-64
                                     + (bits.words(small.size).astype(np.float64) + 0.5) * 2.0**-128)
        # the transcendental functions run in torch (vectorised) on the same memory
        radius = torch.from_numpy(radius_uniform).log_().mul_(-2.0).sqrt_()
        angle = torch.from_numpy(_unit_interval(angle_words, 0.0)).mul_(2 * math.pi)
        pair_normals = torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])
        normals[start:stop] = pair_normals[:stop - start].numpy()
    return normals


def uniform_below(bits: RandomBits, bound: int) -> int:
    """An integer uniform on 0..bound-1, without modulo bias (rejection)."""
    if bound < 1:
        raise ValueError(f"bound={bound!r} must be ≥ 1")
    return int(_uniform_integers(bits, 1, bound)[0])


def discrete_gaussian(bits: RandomBits, count: int, sigma: float) -> np.ndarray:
    """``count`` independent draws of the discrete Gaussian N_ℤ(0, σ²) (int64), P[x] ∝ exp(−x²/2σ²).

    The algorithm of Canonne, Kamath & Steinke (NeurIPS 2020, "The Discrete
    Gaussian for Differential Privacy", Algorithms 1–3), vectorised: a
    discrete Laplace Y with scale t = ⌊σ⌋ + 1, kept with probability
    exp(−(|Y| − σ²/t)²/(2σ²)); rejected draws are redrawn. Every random bit
    comes from ``bits``. As TensorFlow Privacy's ``discrete_gaussian_utils``
    does, a Bernoulli(exp(−x)) is a float64 comparison, uniform < exp(−x)
    (53-bit uniforms), not the paper's exact rational arithmetic: the
    probabilities are off by float64 rounding (relative 2⁻⁵²).
    """
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma={sigma!r} must be positive and finite")
    scale = math.floor(sigma) + 1
    out = np.empty(count, dtype=np.int64)
    pending = np.arange(count)
    while pending.size:
        candidate = _discrete_laplace(bits, pending.size, scale)
        excess = (np.abs(candidate) - sigma**2 / scale) ** 2 / (2 * sigma**2)
        keep = uniform(bits, pending.size) < np.exp(-excess)
        out[pending[keep]] = candidate[keep]
        pending = pending[~keep]
    return out


def _discrete_laplace(bits: RandomBits, count: int, scale: int) -> np.ndarray:
    """P[y] ∝ exp(−|y|/t) (Canonne et al., Algorithm 2): X = U + t·V, U uniform below t kept w.p. exp(−U/t),
    V geometric with P[V = k] ∝ e^{−k}; a random sign, rejecting −0."""
    out = np.empty(count, dtype=np.int64)
    pending = np.arange(count)
    while pending.size:
        n = pending.size
        below = _uniform_integers(bits, n, scale)
        kept = uniform(bits, n) < np.exp(-below / scale)
        magnitude = below + scale * _geometric(bits, n)
        negative = (bits.words(n) >> np.uint64(63)).astype(bool)
        kept &= ~(negative & (magnitude == 0))
        out[pending[kept]] = np.where(negative, -magnitude, magnitude)[kept]
        pending = pending[~kept]
    return out


def _geometric(bits: RandomBits, count: int) -> np.ndarray:
    """The number of successes of Bernoulli(e⁻¹) before the first failure: P[V = k] = (1 − e⁻¹)·e^{−k}."""
    out = np.zeros(count, dtype=np.int64)
    active = np.arange(count)
    while active.size:
        more = uniform(bits, active.size) < math.exp(-1.0)
        active = active[more]
        out[active] += 1
    return out


def _uniform_integers(bits: RandomBits, count: int, bound: int) -> np.ndarray:
    """``count`` integers uniform on 0..bound−1 (int64), without modulo bias (rejection of the top words)."""
    limit = np.uint64(2**64 - 2**64 % bound - 1)  # the largest accepted word
    out = np.empty(count, dtype=np.int64)
    pending = np.arange(count)
    while pending.size:
        words = bits.words(pending.size)
        ok = words <= limit
        out[pending[ok]] = (words[ok] % np.uint64(bound)).astype(np.int64)
        pending = pending[~ok]
    return out
