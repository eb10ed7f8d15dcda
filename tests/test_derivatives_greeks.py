"""Black-Scholes Greeks from the engine against analytic formulas (scipy), float64."""

from __future__ import annotations

import numpy as np
import torch
from scipy.stats import norm

from fedhog.derivatives import black_scholes_call, call_greeks

STRIKE, RATE = 100.0, 0.03


def _analytic(s, t, vol) -> dict[str, np.ndarray]:
    sd = vol * np.sqrt(t)
    d1 = (np.log(s / STRIKE) + (RATE + 0.5 * vol**2) * t) / sd
    d2 = d1 - sd
    gamma = norm.pdf(d1) / (s * sd)
    return {
        "d1": d1,
        "price": s * norm.cdf(d1) - STRIKE * np.exp(-RATE * t) * norm.cdf(d2),
        "delta": norm.cdf(d1),
        "gamma": gamma,
        "speed": -gamma / s * (d1 / sd + 1),
        "vega": s * norm.pdf(d1) * np.sqrt(t),
    }


def _engine(s, t, vol) -> dict[str, torch.Tensor]:
    f64 = lambda a: torch.as_tensor(a, dtype=torch.float64)  # noqa: E731
    return call_greeks(f64(s), f64(STRIKE), f64(t), f64(RATE), f64(vol))


def test_greeks_match_analytic_formulas_on_a_grid():
    s, vol, t = np.meshgrid(
        np.linspace(70, 130, 13), [0.02, 0.05, 0.1, 0.2, 0.4, 0.8], [0.01, 0.02, 0.1, 0.5, 1.0, 3.0], indexing="ij"
    )
    s, vol, t = s.ravel(), vol.ravel(), t.ravel()
    expected = _analytic(s, t, vol)
    # Beyond |d1| = 8 gamma, speed and vega are < 1e-14 of their scale and the reference's
    # own exp(−d1²/2) carries relative error ~ d1² · eps; such options are left out.
    keep = np.abs(expected["d1"]) <= 8
    got = _engine(s[keep], t[keep], vol[keep])
    # Differentiating S N(d1) − K e^{−rT} N(d2) produces terms scaling like 1/(σ√T)^k that
    # cancel in the Greeks, so relative accuracy degrades as σ√T → 0: tight bound only
    # where σ√T ≥ 0.1.
    well_conditioned = (vol * np.sqrt(t))[keep] >= 0.1
    assert well_conditioned.sum() > 100 and (~well_conditioned).sum() > 100
    for name in ("price", "delta", "gamma", "speed", "vega"):
        rel = np.abs(got[name].numpy() - expected[name][keep]) / np.abs(expected[name][keep])
        assert rel[well_conditioned].max() <= 1e-11, (name, rel[well_conditioned].max())
        assert rel.max() <= 1e-9, (name, rel.max())


def test_vmap_greeks_for_100k_options():
    rng = np.random.default_rng(0)
    n = 100_000
    s, t, vol = rng.uniform(80, 120, n), rng.uniform(0.25, 2.0, n), rng.uniform(0.15, 0.5, n)
    got = _engine(s, t, vol)
    assert all(g.shape == (n,) and bool(torch.isfinite(g).all()) for g in got.values())
    expected = _analytic(s, t, vol)
    for name in ("delta", "gamma", "speed", "vega"):  # atol covers speed's sign changes
        scale = np.abs(expected[name]).max()
        np.testing.assert_allclose(got[name].numpy(), expected[name], rtol=1e-11, atol=1e-13 * scale)
    price = black_scholes_call(*(torch.as_tensor(a, dtype=torch.float64) for a in (s, STRIKE, t, RATE, vol)))
    np.testing.assert_allclose(price.numpy(), expected["price"], rtol=1e-11)
