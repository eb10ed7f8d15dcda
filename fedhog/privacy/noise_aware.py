"""Noise-aware mixing: the third-order term descends the loss that the release noise adds.

The released model is θ + z, not θ: the server's Gaussian noise stays in the weights. For z ~ N(0, τ²I),

    E_z[L(θ + z)] ≈ L(θ) + ½ τ² tr ∇²L(θ),   ∇_θ tr ∇²L = E_v[∇_θ(vᵀ∇²L v)]   (E[v vᵀ] = I),

so a client that also descends ``½ κ τ² tr ∇²L`` optimises the loss of the model the noise will release
(κ = 1 the principled strength). Each client estimates ĝ_i ≈ ∇ tr ∇²L at the round's model by Hutchinson
(:func:`fedhog.derivatives.hessian_trace_gradient`); the mechanism contributes, before clipping,

    u_i = Δ_i − λ_i · ½ κ τ² · ĝ_i.

Two scales, both fixed by the run's configuration (:func:`release_noise_std`, :func:`local_step_scale`):

τ, the per-coordinate std of the noise the model carries. The release ū = (Σ c_i + n)/K has noise std
s = σC/K per coordinate (:class:`~fedhog.privacy.mechanism.GaussianMechanism`; its lattice slack g√d/2 is
≈ 2⁻⁴⁰ of C). The server moves θ by η_s·ū (``sgd``), or with FedAvgM's momentum m ← β m + ū, θ ← θ + η_s m:
one round's noise n_t enters m and keeps moving θ by η_s β^j n_t/K in round t + j, a total displacement of
η_s n_t/(K(1 − β)). So

    τ = η_s σ C / (K (1 − β))          (β = 0 for ``sgd``),

the displacement one round's noise adds to the weights once the momentum has carried it out
(``tests/test_noise_aware.py`` measures it on :class:`~fedhog.server_optimizer.ServerOptimizer`). Older
rounds' noise has been trained against by the clients since; the newest round's is where the momentum
will carry it. Adaptive optimizers (Adam, Yogi) rescale each coordinate by its history, and a server step
rescales the step: no τ here, and the config refuses them with noise-aware mixing.

λ_i, the client's local step scale. The term enters once per round, mixed into the update, as if the client
had descended L + ½κτ² tr ∇²L for its S_i local steps with the term held at its value at θ: plain SGD
(learning rate η) adds −η·S_i·(½κτ² ĝ_i); heavy-ball momentum μ, whose velocity after s steps of a constant
gradient is (1 − μˢ)/(1 − μ) of it, adds −η Σ_{s=1}^{S} (1 − μˢ)/(1 − μ) times it:

    λ_i = η (S_i − μ (1 − μ^{S_i}) / (1 − μ)) / (1 − μ)      (= η S_i for μ = 0).

The client sends λ_i ĝ_i as its term (it knows its own S_i; under secure aggregation it mixes itself), and
the mechanism multiplies by ½κτ² (:meth:`NoiseAwareMixing.coefficient`). Nothing here touches privacy: the
term is a function of the client's data like Δ_i, mixed before clipping; ε and σ are those of ``gaussian``.

Expectation. Random-sign mixing (u = Δ + γξ(‖Δ‖/‖t‖)t, ξ ~ N(0, 1)) has mean Δ: it is DP-FedAvg in
expectation and can only add variance. Noise-aware mixing has mean Δ − λ·½κτ² ∇ tr ∇²L (Hutchinson is
unbiased): DP-FedAvg's mean moved by a deterministic descent direction of the smoothed loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def release_noise_std(noise_multiplier: float, clipping_norm: float, expected_cohort: float,
                      server_learning_rate: float, server_momentum: float = 0.0) -> float:
    """τ = η_s σ C / (K (1 − β)): the per-coordinate std one round's release noise moves the weights by."""
    if not 0 <= server_momentum < 1:
        raise ValueError(f"server_momentum={server_momentum!r} must be in [0, 1)")
    if not expected_cohort > 0:
        raise ValueError(f"expected_cohort={expected_cohort!r} must be > 0")
    return server_learning_rate * noise_multiplier * clipping_norm / (expected_cohort * (1 - server_momentum))


def local_step_scale(learning_rate: float, steps: int, momentum: float = 0.0) -> float:
    """λ = η (S − μ(1 − μ^S)/(1 − μ)) / (1 − μ): how far S heavy-ball steps move along a constant unit gradient."""
    if not 0 <= momentum < 1:
        raise ValueError(f"momentum={momentum!r} must be in [0, 1)")
    if momentum == 0:
        return learning_rate * steps
    return learning_rate * (steps - momentum * (1 - momentum**steps) / (1 - momentum)) / (1 - momentum)


@dataclass(frozen=True)
class NoiseAwareMixing:
    """What the mechanism needs to scale the clients' terms: κ and the server's step (η_s, β) and K.

    Parameters
    ----------
    strength : float
        κ ≥ 0 (``noise-aware-strength``; 1 descends exactly the smoothed loss's second-order term).
    server_learning_rate : float
        η_s > 0.
    server_momentum : float
        β in [0, 1) (0 for a server without momentum).
    expected_cohort : float
        K > 0, the release's denominator.
    """

    strength: float
    server_learning_rate: float
    server_momentum: float
    expected_cohort: float

    def __post_init__(self) -> None:
        for name, value, ok, allowed in (
            ("strength", self.strength, self.strength >= 0, "a finite number ≥ 0"),
            ("server_learning_rate", self.server_learning_rate, self.server_learning_rate > 0, "a finite number > 0"),
            ("server_momentum", self.server_momentum, 0 <= self.server_momentum < 1, "a number in [0, 1)"),
            ("expected_cohort", self.expected_cohort, self.expected_cohort > 0, "a finite number > 0"),
        ):
            if not (math.isfinite(value) and ok):
                raise ValueError(f"{name}={value!r} is not allowed; expected {allowed}")

    def noise_std(self, noise_multiplier: float, clipping_norm: float) -> float:
        """τ for this σ and C (:func:`release_noise_std`)."""
        return release_noise_std(noise_multiplier, clipping_norm, self.expected_cohort, self.server_learning_rate,
                                 self.server_momentum)

    def coefficient(self, noise_multiplier: float, clipping_norm: float) -> float:
        """½ κ τ²: what the mechanism multiplies each client's term λ_i ĝ_i by before subtracting it from Δ_i."""
        return 0.5 * self.strength * self.noise_std(noise_multiplier, clipping_norm) ** 2
