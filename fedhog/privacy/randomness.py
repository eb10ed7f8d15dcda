"""The one source of private randomness: cohort sampling, ξ and the Gaussian noise.

Two sources of raw 64-bit words, one set of samplers on top of them:

- :class:`SecureBits` (``privacy-seed = -1``, the default): a ChaCha20
  keystream (``cryptography``, i.e. OpenSSL) under a fresh 256-bit key read
  from the operating system's generator. The key lives only inside the cipher
  object, which refuses to be pickled, so it cannot reach a checkpoint, a log
  or a metric. Each round (and each DP-SGD client round) gets a new key.
- :class:`SeededBits` (``privacy-seed ≥ 0``, experiments only): NumPy's PCG64
  keyed by the whole seed and a stream key ``(round, stream)`` through a
  ``SeedSequence``. Repeatable — and so the noise can be recomputed by anyone
  who holds the config or guesses the seed (small seeds are found from two
  released models in under a second): a seeded run's ε is void against them.

Samplers never touch NumPy's, Python's or PyTorch's global generators (data
generators such as mnist1d reseed those).

:func:`discrete_gaussian` (and :func:`lattice_gaussian`, the same in chunks)
draws the privacy noise: N_ℤ(0, σ²) exactly on the lattice, by rejection from
bit fields and exact Bernoulli trials, so that every integer can be drawn and
the pmf is within a proven factor of the exact one
(:func:`sampler_log_ratio_bound`). :func:`standard_normal` is Box–Muller in
float64, one 64-bit word per normal, for ξ (the mixing coefficients, which
carry no privacy): its radius uses a uniform with 2⁻¹²⁸ resolution near 0, so
normals reach |z| ≤ :data:`MAX_STANDARD_NORMAL` ≈ 13.37. How the mechanism
turns lattice noise into a release is in :mod:`fedhog.privacy.mechanism`.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from fractions import Fraction
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
#: The largest σ :func:`discrete_gaussian` takes: candidates (≤ ~50·√2·σ in practice) stay exact in float64.
MAX_SIGMA = 2.0**46


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
        buffer = words.data.cast("B")
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
    return SeededBits(seed, (server_round, len(PrivacyRandomness.STREAMS), partition_id)
                      + ((stream,) if stream else ()))


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

    Rejection sampling in the manner of Canonne, Kamath & Steinke (NeurIPS
    2020, "The Discrete Gaussian for Differential Privacy", Algorithm 3),
    vectorised, every random bit from ``bits``. The proposal is a two-sided
    staircase: Y = ±(U + t·V) with t = 2^k, U uniform below t and V
    geometric with P[V = v] = 2^{−(v+1)}, so q(y) ∝ 2^{−⌊|y|/t⌋}; −0 is
    rejected. One 64-bit word gives U (its top k bits), the sign (bit 0) and V
    (the trailing zeros of the bits between). Y is kept with probability
    exp(−x), x = (|y| − λσ²/t)²/(2σ²) + λ·U/t with λ = ln 2: then
    q(y)·e^{−x} ∝ exp(−y²/2σ²), exactly N_ℤ(0, σ²), and x ≥ 0. t = 2^k is the
    power of two nearest λσ, where the acceptance rate peaks (0.47–0.55).

    Where the paper evaluates Bernoulli(exp(−x)) in exact rational
    arithmetic, fedhog computes p = exp(−x) in float64 and then draws
    **exactly** Bernoulli(p) for that float (:func:`bernoulli_exp`: an
    unbounded-precision uniform compared with p; no p is rounded to 0, exp(−x)
    below float64's range is split into factors). So every integer keeps a
    positive probability (no hole), and float64 moves each probability by a
    factor bounded in :func:`sampler_log_ratio_bound`. σ² is rounded up,
    never down, to a float.
    """
    if not (math.isfinite(sigma) and 0 < sigma <= MAX_SIGMA):
        raise ValueError(f"sigma={sigma!r} must be positive, finite and at most 2^46")
    variance = _float_square_at_least(sigma)
    scale_bits = max(0, round(math.log2(_LN2 * sigma)))
    scale = 2.0**scale_bits
    shift = _LN2 * variance / scale  # λσ²/t
    shift_whole = math.floor(shift)
    shift_fraction = shift - shift_whole  # exact
    ratio = sigma / scale  # acceptance ≈ √(2π)/4 · (σ/t) · exp(−λ²σ²/2t²)
    kept_share = min(1.0, math.sqrt(2 * math.pi) / 4 * ratio * math.exp(-(_LN2 * ratio) ** 2 / 2))
    out = np.empty(count, dtype=np.int64)
    filled = 0
    while filled < count:
        wanted = count - filled
        magnitude, below, negative = _staircase(bits, int(1.03 * wanted / kept_share) + 32, scale_bits)
        exponent = (magnitude - shift_whole).astype(np.float64)
        exponent -= shift_fraction  # |y| − λσ²/t, to 2⁻⁵³ relative
        exponent *= exponent
        exponent *= 1 / (2 * variance)
        exponent += np.multiply(below, _LN2 * 2.0**-scale_bits)  # λ·U/t
        keep = np.flatnonzero(bernoulli_exp(bits, exponent))
        keep = keep[~(negative[keep] & (magnitude[keep] == 0))][:wanted]  # −0 is rejected
        kept = magnitude[keep]
        np.negative(kept, out=kept, where=negative[keep])
        out[filled:filled + kept.size] = kept
        filled += kept.size
    return out


def lattice_gaussian(bits: RandomBits, count: int, std_steps: float) -> np.ndarray:
    """``count`` draws of N_ℤ(0, s²) for s = ``std_steps`` (int64): Gaussian noise drawn on the lattice itself.

    In chunks, so that the temporaries stay small however large the model.
    """
    out = np.empty(count, dtype=np.int64)
    for start in range(0, count, _NOISE_CHUNK):
        stop = min(count, start + _NOISE_CHUNK)
        out[start:stop] = discrete_gaussian(bits, stop - start, std_steps)
    return out


_NOISE_CHUNK = 2**16  # draws per pass: ~2.5 MB of temporaries, which stay in cache (measured fastest of 2^14..2^18)


_LN2 = math.log(2)
#: The relative error of float64 ``numpy.exp`` that :func:`sampler_log_ratio_bound` allows for, in ulp
#: (a test checks NumPy's exp against exact arithmetic).
EXP_ULPS = 4
#: The bulk: |x| ≤ 20σ. Outside it :func:`discrete_gaussian`'s exponent may carry more float error; the mass
#: there (below 3·e^{−200}) is left to δ (:func:`fedhog.privacy.mechanism.sampler_slack`).
BULK_STDS = 20.0


def sampler_log_ratio_bound() -> float:
    """η: |log P̂(x) − log P(x)| ≤ η for every |x| ≤ 20σ, where P̂ is the pmf :func:`discrete_gaussian` draws and P
    is N_ℤ(0, σ²).

    The random bits are used exactly (U, the sign and V are bit fields, each
    Bernoulli(p) is exact for the float p), so all the error is in p: the
    exponent x (≤ ½·(20 + √2)² + 1 < 231 in the bulk) is computed with a
    relative error below 5·2⁻⁵³ (a shift of 2⁻⁵³ relative, a square, a product,
    a sum); λσ²/t is off by 2⁻⁵² relative, which tilts the pmf by at most
    (|x|/σ + 2)·2⁻⁵²; exp adds :data:`EXP_ULPS` ulp. The normalising constant
    moves by at most the same factor, hence the 2. About 2.7·10⁻¹³.
    """
    largest_exponent = (BULK_STDS + math.sqrt(2)) ** 2 / 2 + 1
    exponent_error = largest_exponent * 5 * 2.0**-53 + (BULK_STDS + 2) * 2.0**-52 + EXP_ULPS * 2.0**-52
    return 2 * exponent_error


def bernoulli_exp(bits: RandomBits, exponent: np.ndarray) -> np.ndarray:
    """Exactly Bernoulli(p) per entry for the float64 p = exp(−x) (x ≥ 0), also where exp(−x) underflows:
    exp(−x) = exp(−700)^j · exp(−rest), one independent Bernoulli per factor."""
    exponent = np.asarray(exponent, dtype=np.float64)
    probability = np.minimum(exponent, _EXP_STEP)
    np.negative(probability, out=probability)
    accepted = bernoulli(bits, np.exp(probability, out=probability))
    far = np.flatnonzero(exponent > _EXP_STEP)
    far = far[accepted[far]]
    rest = exponent[far] - _EXP_STEP
    while far.size:  # never in practice (a candidate 37 σ out), but no value is made impossible
        accepted[far] = bernoulli(bits, np.exp(-np.minimum(rest, _EXP_STEP)))
        rest -= _EXP_STEP
        going = accepted[far] & (rest > 0)
        far, rest = far[going], rest[going]
    return accepted


_EXP_STEP = 700.0  # exp(−700) ≈ 1e−304 is a normal float64


def bernoulli(bits: RandomBits, probability: np.ndarray) -> np.ndarray:
    """Exactly Bernoulli(p) per entry for float64 p ∈ [0, 1].

    A uniform U of unbounded precision, read 32 bits at a time, against p:
    p·2³² is exact, its whole part is compared with the next 32 random bits,
    and only a tie (probability 2⁻³²) reads the next 32 against the fraction.
    P[U < p] = p exactly, for every float64 p, subnormals included.
    """
    scaled = np.asarray(probability, dtype=np.float64) * _DIGIT
    threshold = np.minimum(scaled, _DIGIT - 1).astype(np.uint32)  # ⌊p·2³²⌋ (truncation; p = 1: 2³² − 1 and a tie)
    digits = bits.words(-(-scaled.size // 2)).view(np.uint32)[:scaled.size]
    out = digits < threshold
    tie = np.flatnonzero(digits == threshold)
    tie = tie[scaled[tie] > threshold[tie]]  # equal so far, and p has bits left
    if tie.size:  # the next 32 bits of p decide: p·2³² − ⌊p·2³²⌋ is exact
        out[tie] = bernoulli(bits, scaled[tie] - threshold[tie])
    return out


_DIGIT = 2.0**32


def _float_square_at_least(sigma: float) -> float:
    """The float64 nearest σ² from above (σ² itself when representable)."""
    square = sigma * sigma
    if Fraction(square) < Fraction(sigma) ** 2:
        square = math.nextafter(square, math.inf)
    return square


def _staircase(bits: RandomBits, count: int, scale_bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``count`` proposals |y| = U + t·V of :func:`discrete_gaussian` (t = 2^k), with U and the sign.

    One word each: U its top k bits, the sign bit 0, V the number of trailing
    zeros of the bits between (P[V = v] = 2^{−(v+1)}); where those bits are all
    zero (rare unless k is large), V continues into fresh words.
    """
    words = bits.words(count)
    below = (words >> np.uint64(64 - scale_bits)).view(np.int64) if scale_bits else np.zeros(count, np.int64)
    negative = (words & np.uint64(1)).astype(bool)
    field_bits = 63 - scale_bits
    field = (words >> np.uint64(1)) & np.uint64(2**field_bits - 1)
    geometric = _trailing_zeros(field)
    empty = np.flatnonzero(geometric < 0)  # an all-zero field
    if empty.size:
        geometric[empty] = field_bits + _geometric_words(bits, empty.size)
    return below + (geometric << scale_bits), below, negative


def _trailing_zeros(words: np.ndarray) -> np.ndarray:
    """The number of trailing zero bits of each nonzero uint64 (callers replace the entries of zero words)."""
    lowest = (words & (np.uint64(0) - words)).astype(np.float64)  # the lowest set bit: a power of two, exact
    return (lowest.view(np.int64) >> 52) - 1023  # its float64 exponent (zero words give −1023)


def _geometric_words(bits: RandomBits, count: int) -> np.ndarray:
    """P[V = v] = 2^{−(v+1)} from whole words: trailing zeros, 64 more for every zero word."""
    out = np.zeros(count, dtype=np.int64)
    pending = np.arange(count)
    while pending.size:
        words = bits.words(pending.size)
        done = words != 0
        out[pending[done]] += _trailing_zeros(words[done])
        out[pending[~done]] += 64
        pending = pending[~done]
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
