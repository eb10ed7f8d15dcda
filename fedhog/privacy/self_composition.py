"""``dp_accounting``'s PLD self-composition, memoised across the number of compositions.

A run composes one subsampled Gaussian's PLD with itself n times for n = 1, 2, 3…, one per round.
``dp_accounting`` (``DensePLDPmf.self_compose`` → ``common.self_convolve``) recomputes, for every n, what does
not depend on n: the log moment-generating function of the one-release PMF at 40 orders (the Chernoff
truncation bounds; most of the time) and that PMF's FFT at a length that changes only now and then.
:class:`SelfComposition` keeps both and runs the rest of the same arithmetic, operation for operation, so the
composed PMFs are the same bits as ``dp_accounting``'s (``tests/test_compat.py`` checks that, so a
``dp_accounting`` that changes its algorithm fails there and not in a run).
"""

from __future__ import annotations

import math
import threading

import numpy as np
from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution
from scipy import fft, special

from ..compat import DensePmf, dense_pmfs, new_dense_pmf

TAIL_MASS_TRUNCATION = 1e-15  # dp_accounting's default for PrivacyLossDistribution.self_compose
_KEPT_SPECTRA = 2  # FFT lengths kept per PMF: n grows, so the length only moves forward


class _PmfSelfComposition:
    """One dense PMF composed with itself n times, as ``DensePLDPmf.self_compose(n)`` computes it."""

    def __init__(self, pmf: DensePmf, tail_mass_truncation: float) -> None:
        self._pmf = pmf
        self._tail = tail_mass_truncation
        size = len(pmf.probs)
        self._orders = np.concatenate((np.arange(-20, 0), np.arange(1, 21))) / size
        self._log_mgfs = [float(special.logsumexp(np.arange(size) * order, b=pmf.probs)) for order in self._orders]
        self._spectra: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()  # the ε schedule's worker thread and the round's may compose at once

    def _bounds(self, num_times: int) -> tuple[int, int]:
        """``common.compute_self_convolve_bounds`` from the memoised log-MGFs."""
        upper = (len(self._pmf.probs) - 1) * num_times
        lower = 0
        for order, log_mgf in zip(self._orders, self._log_mgfs, strict=True):
            bound = (num_times * log_mgf + math.log(2 / self._tail)) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper = min(upper, math.ceil(bound))
            if order < 0:
                lower = max(lower, math.floor(bound))
        return lower, upper

    def _spectrum(self, length: int) -> np.ndarray:
        with self._lock:
            spectrum = self._spectra.get(length)
            if spectrum is None:
                if len(self._spectra) >= _KEPT_SPECTRA:
                    del self._spectra[next(iter(self._spectra))]
                spectrum = self._spectra[length] = fft.fft(self._pmf.probs, length)
            return spectrum

    def fft_length(self, num_times: int) -> int:
        """The FFT length that composing ``num_times`` times takes (grows about linearly with it)."""
        lower, upper = self._bounds(num_times)
        return int(fft.next_fast_len(max(upper - lower + 1, len(self._pmf.probs))))

    def __call__(self, num_times: int) -> object:
        if num_times <= 0:
            raise ValueError(f"num_times should be >= 1, num_times={num_times}")
        pmf = self._pmf
        lower, upper = self._bounds(num_times)
        output_len = upper - lower + 1
        fast_len = fft.next_fast_len(max(output_len, len(pmf.probs)))
        convolution = np.real(fft.ifft(self._spectrum(fast_len) ** num_times))
        probs = np.array(np.roll(convolution, -lower)[:output_len])
        infinity_mass = self._tail - math.expm1(num_times * math.log1p(-pmf.infinity_mass))
        return new_dense_pmf(pmf, pmf.lower_loss * num_times + lower, probs, infinity_mass)


class SelfComposition:
    """``pld.self_compose(n)`` for any n, with what does not depend on n computed once.

    Falls back to ``dp_accounting`` itself for a PLD that is not dense (none of fedhog's are).
    """

    def __init__(self, pld: PrivacyLossDistribution, tail_mass_truncation: float = TAIL_MASS_TRUNCATION) -> None:
        self._pld = pld
        self._tail = tail_mass_truncation
        pmfs = dense_pmfs(pld)
        self._remove: _PmfSelfComposition | None = None
        self._add: _PmfSelfComposition | None = None
        if pmfs is not None:
            self._remove = _PmfSelfComposition(pmfs[0], tail_mass_truncation)
            self._add = None if pmfs[1] is None else _PmfSelfComposition(pmfs[1], tail_mass_truncation)

    def working_bytes(self, num_times: int) -> int:
        """The memory composing ``num_times`` times takes at its peak: per PMF a spectrum, its power and inverse
        (complex128) of :meth:`_PmfSelfComposition.fft_length` (sparse PMFs are made dense first, as
        ``dp_accounting`` does for many compositions)."""
        pmfs = dense_pmfs(self._pld, densify=True)
        if pmfs is None:
            return 0
        sizing = [_PmfSelfComposition(pmf, self._tail) for pmf in pmfs if pmf is not None]
        return sum(3 * 16 * pmf.fft_length(num_times) for pmf in sizing)

    def __call__(self, num_times: int) -> PrivacyLossDistribution:
        """The PLD of ``num_times`` compositions: the same as ``pld.self_compose(num_times)``, bit for bit."""
        if self._remove is None:
            return self._pld.self_compose(num_times, self._tail)
        remove = self._remove(num_times)
        if self._add is None:
            return PrivacyLossDistribution(remove)
        return PrivacyLossDistribution(remove, self._add(num_times))
