"""Server optimizers applied to the private release: FedAvgM, FedAdam and FedYogi.

Each round the mechanism releases ū, the noised average of the clipped
contributions. The server then moves the global model θ by ū (``sgd``: θ ← θ + η·ū)
or treats ū as a pseudo-gradient of an adaptive optimizer (Reddi et al.,
"Adaptive Federated Optimization", ICLR 2021). Either way it is
post-processing of a differentially private release: it costs no privacy, and
its state (momenta) is a function of released values only, safe in a checkpoint.

The updates are those of Flower's own strategies (``flwr.serverapp.strategy``),
which a test checks round by round:

- ``momentum`` (FedAvgM, Hsu et al. 2019): m ← β₁·m + ū (m = ū at first), θ ← θ + η·m;
- ``adam`` (FedAdam): m ← β₁·m + (1 − β₁)·ū, v ← β₂·v + (1 − β₂)·ū²,
  θ ← θ + η·√(1 − β₂^(t+1)) / (1 − β₁^(t+1)) · m / (√v + τ)  (Flower's bias correction, round t);
- ``yogi`` (FedYogi): m as Adam, v ← v − (1 − β₂)·ū²·sign(v − ū²), θ ← θ + η·m / (√v + τ).

m and v start at zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .choices import SERVER_OPTIMIZERS


@dataclass(frozen=True)
class ServerOptimizerSettings:
    """How the server applies the release.

    Parameters
    ----------
    kind : {"sgd", "momentum", "adam", "yogi"}
        The optimizer.
    learning_rate : float
        η > 0.
    momentum : float
        β₁ in [0, 1): FedAvgM's momentum, Adam's and Yogi's first-moment decay.
    beta2 : float
        β₂ in [0, 1): the second-moment decay of Adam and Yogi.
    tau : float
        τ > 0: the adaptivity floor of Adam and Yogi.
    """

    kind: str = "sgd"
    learning_rate: float = 1.0
    momentum: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3

    def __post_init__(self) -> None:
        if self.kind not in SERVER_OPTIMIZERS:
            raise ValueError(f"kind={self.kind!r} is not allowed; expected one of {', '.join(SERVER_OPTIMIZERS)}")
        for name, value, ok, allowed in (
            ("learning_rate", self.learning_rate, self.learning_rate > 0, "a finite number > 0"),
            ("momentum", self.momentum, 0 <= self.momentum < 1, "a number in [0, 1)"),
            ("beta2", self.beta2, 0 <= self.beta2 < 1, "a number in [0, 1)"),
            ("tau", self.tau, self.tau > 0, "a finite number > 0"),
        ):
            if not (math.isfinite(value) and ok):
                raise ValueError(f"{name}={value!r} is not allowed; expected {allowed}")


class ServerOptimizer:
    """The server's step from the release ū, with its state across rounds."""

    def __init__(self, settings: ServerOptimizerSettings) -> None:
        self.settings = settings
        self.first_moment: torch.Tensor | None = None
        self.second_moment: torch.Tensor | None = None

    def __repr__(self) -> str:
        s = self.settings
        return f"ServerOptimizer({s.kind}, η={s.learning_rate}, β₁={s.momentum}, β₂={s.beta2}, τ={s.tau})"

    def step(self, model: torch.Tensor, release: torch.Tensor, server_round: int) -> torch.Tensor:
        """θ after round ``server_round`` (1-based) from θ (``model``) and ū (``release``), both flat."""
        s = self.settings
        if s.kind == "sgd":
            return model + s.learning_rate * release
        if s.kind == "momentum":
            self.first_moment = (release.clone() if self.first_moment is None
                                 else s.momentum * self.first_moment + release)
            return model + s.learning_rate * self.first_moment
        first = torch.zeros_like(release) if self.first_moment is None else self.first_moment
        second = torch.zeros_like(release) if self.second_moment is None else self.second_moment
        self.first_moment = s.momentum * first + (1 - s.momentum) * release
        squared = release**2
        if s.kind == "adam":
            self.second_moment = s.beta2 * second + (1 - s.beta2) * squared
            rate = (s.learning_rate * math.sqrt(1 - s.beta2 ** (server_round + 1.0))
                    / (1 - s.momentum ** (server_round + 1.0)))
        else:  # yogi
            self.second_moment = second - (1 - s.beta2) * squared * torch.sign(second - squared)
            rate = s.learning_rate
        return model + rate * self.first_moment / (torch.sqrt(self.second_moment) + s.tau)

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        """The moments (functions of released values only), for checkpoints."""
        return {"first_moment": self.first_moment, "second_moment": self.second_moment}

    def load_state_dict(self, state: dict[str, torch.Tensor | None]) -> None:
        """Restore :meth:`state_dict` output."""
        self.first_moment, self.second_moment = state["first_moment"], state["second_moment"]
