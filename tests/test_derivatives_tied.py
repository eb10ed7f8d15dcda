"""Tied (shared) parameters: every method against the chain rule through an untied twin (float64).

A model whose weights are shared, ``f(θ) = g(Aθ)`` with ``A = [I; I]`` duplicating
each shared parameter, has ``∇f = Aᵀ∇g``, ``∇²f v = Aᵀ ∇²g A v``,
``t_f(v) = Aᵀ t_g(Av)``, and the same directional derivatives along ``v`` as ``g``
along ``Av``.  The twin is the same network
with every use of a parameter given its own copy, differentiated by triple
backward (``method="autograd"``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedhog.derivatives import (
    cubic_step,
    directional_derivatives,
    gradient,
    hessian_vector_product,
    third_order_step_size,
    third_order_vector,
)
from fedhog.derivatives.taylor import program_for

METHODS = ["taylor", "torch.func", "autograd"]


class Tied(nn.Module):
    """Two Linear layers sharing one weight, the encoder weight reused transposed, and a conv used twice."""

    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.conv = nn.Conv1d(2, 2, 3, padding=1)
        self.conv_again = nn.Conv1d(2, 2, 3, padding=1)
        self.enc = nn.Linear(12, 5)
        self.mid = nn.Linear(5, 5)
        self.mid_again = nn.Linear(5, 5)
        self.dec_weight = nn.Parameter(torch.randn(5, 12) * 0.3)  # untied copy of enc.weight, transposed use
        self.head = nn.Linear(12, 3)
        if tie:
            self.conv_again.weight = self.conv.weight
            self.mid_again.weight = self.mid.weight
            del self.dec_weight
        self.tie = tie

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv_again(torch.tanh(self.conv(x)))).flatten(1)
        z = torch.tanh(self.enc(h))
        z = torch.tanh(self.mid_again(torch.tanh(self.mid(z))))
        back = z @ (self.enc.weight if self.tie else self.dec_weight)  # the decoder reuses the encoder's weight
        return self.head(torch.tanh(back) + h)


ALIASES = {"conv.weight": "conv_again.weight", "mid.weight": "mid_again.weight", "enc.weight": "dec_weight"}


def _pair() -> tuple[Tied, Tied]:
    torch.manual_seed(0)
    tied = Tied(tie=True).double()
    twin = Tied(tie=False).double()
    state = {k: p.detach() for k, p in tied.named_parameters()}
    with torch.no_grad():
        for name, p in twin.named_parameters():
            source = {v: k for k, v in ALIASES.items()}.get(name, name)
            p.copy_(state[source])
    return tied, twin


def _lift(v: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``A v``: every copy of a shared parameter gets its value."""
    return {**v, **{copy: v[shared] for shared, copy in ALIASES.items()}}


def _reduce(g: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``Aᵀ g``: the copies' entries summed into the shared parameter."""
    out = {k: t for k, t in g.items() if k not in ALIASES.values()}
    for shared, copy in ALIASES.items():
        out[shared] = g[shared] + g[copy]
    return out


def _setup():
    tied, twin = _pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 2, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (4,), generator=g)
    v = {k: torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 for k, p in tied.named_parameters()}
    return tied, twin, x, y, v


def _close(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=1e-10, atol=1e-12)


def test_the_model_is_tied():
    tied, twin = _pair()
    assert len(list(tied.named_parameters(remove_duplicate=False))) == len(list(tied.named_parameters())) + 2
    assert len(list(twin.named_parameters())) == len(list(tied.named_parameters())) + 3
    program_for(tied)  # Taylor mode supports the tied model
    x = torch.randn(4, 2, 6, dtype=torch.float64)
    torch.testing.assert_close(tied(x), twin(x))


@pytest.mark.parametrize("method", METHODS)
def test_vectors_follow_the_chain_rule(method):
    tied, twin, x, y, v = _setup()
    cases = [
        (gradient(tied, x, y, method=method), gradient(twin, x, y, method="autograd")),
        (
            hessian_vector_product(tied, x, y, v, method=method),
            hessian_vector_product(twin, x, y, _lift(v), method="autograd"),
        ),
        (third_order_vector(tied, x, y, v, method=method), third_order_vector(twin, x, y, _lift(v), method="autograd")),
    ]
    for res, ref in cases:
        assert res.method == method and res.finite
        _close(res.vector, _reduce(ref.vector))


@pytest.mark.parametrize("method", ["taylor", "torch.func"])
def test_directional_derivatives_and_step_size(method):
    tied, twin, x, y, v = _setup()
    res = directional_derivatives(tied, x, y, v, order=4, method=method)
    ref = directional_derivatives(twin, x, y, _lift(v), order=4, method="torch.func")
    torch.testing.assert_close(res.values, ref.values, rtol=1e-10, atol=1e-12)

    step = third_order_step_size(tied, x, y, method=method, max_step=10.0)
    d = {k: -t for k, t in _reduce(gradient(twin, x, y, method="autograd").vector).items()}
    _, d1, d2, d3 = directional_derivatives(twin, x, y, _lift(d), order=3, method="torch.func").values.tolist()
    expected = cubic_step(d1, d2, d3, max_step=10.0)
    assert step.reason == expected.reason and step.step == pytest.approx(expected.step, rel=1e-9)


def test_per_example_with_tied_weights():
    tied, twin, x, y, v = _setup()
    per = third_order_vector(tied, x, y, v, method="taylor", per_example=True)
    for i in range(x.shape[0]):
        ref = third_order_vector(twin, x[i : i + 1], y[i : i + 1], _lift(v), method="autograd")
        _close({k: t[i] for k, t in per.vector.items()}, _reduce(ref.vector))


def test_retying_after_first_use_retraces():
    tied, _, x, y, v = _setup()
    before = third_order_vector(tied, x, y, v, method="taylor").vector
    tied.mid_again.weight = nn.Parameter(tied.mid.weight.detach().clone())  # untie
    v = {**v, "mid_again.weight": v["mid.weight"]}
    after = third_order_vector(tied, x, y, v, method="taylor")
    ref = third_order_vector(tied, x, y, v, method="autograd")
    _close(after.vector, ref.vector)
    assert not torch.allclose(after.vector["mid.weight"], before["mid.weight"])
