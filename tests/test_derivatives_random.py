"""Randomised architectures: every method against triple backward, and triple backward against finite differences.

Each seed builds a random composition of the supported layers (linear, conv
1-D/2-D, average/max/adaptive pooling, eval-mode BatchNorm, LayerNorm,
GroupNorm, RMSNorm, smooth and piecewise-linear activations, residual
additions, a module applied twice, weights tied between two modules and a raw
parameter used twice) in float64.  The reference is triple backward on the
engine's trusted formulation (``method="autograd"``: normalisations as
mean/var/rsqrt); the reference itself is checked against fourth-order finite
differences of the loss values alone (no automatic differentiation), for the
architectures without kinks.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedhog.derivatives import directional_derivatives, hessian_vector_product, third_order_vector
from fedhog.derivatives.losses import cross_entropy, mse
from fedhog.derivatives.taylor import program_for

CLASSES = 3
SMOOTH = ("tanh", "sigmoid", "gelu", "softplus")
KINKED = ("relu", "leaky_relu")


class RandomNet(nn.Module):
    """Applies ``plan`` (a list of ``(kind, name)``) to its input; traced by ``torch.fx`` as an unrolled graph."""

    def __init__(self) -> None:
        super().__init__()
        self.plan: list[tuple[str, str]] = []
        self.kinked = False
        self.shared_weights: list[str] = []

    def add(self, kind: str, name: str = "", module: nn.Module | None = None) -> None:
        if module is not None:
            self.add_module(name, module)
        self.plan.append((kind, name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for kind, name in self.plan:
            if kind == "layer":
                h = getattr(self, name)(h)
            elif kind == "residual":
                h = h + torch.tanh(getattr(self, name)(h))
            elif kind == "twice":  # one module applied twice: its weight is used twice
                m = getattr(self, name)
                h = m(torch.tanh(m(h)))
            elif kind == "fn_layer_norm":
                w, b = getattr(self, name + "_w"), getattr(self, name + "_b")
                h = F.layer_norm(h, (h.shape[-1],), w, b, 1e-5)
            elif kind == "raw_twice":  # a raw parameter in two products
                w = getattr(self, name)
                h = torch.tanh(h @ w) @ w + h
            elif kind == "flatten":
                h = h.flatten(1)
            else:
                h = {
                    "tanh": torch.tanh,
                    "sigmoid": torch.sigmoid,
                    "gelu": F.gelu,
                    "softplus": F.softplus,
                    "relu": F.relu,
                    "leaky_relu": lambda t: F.leaky_relu(t, 0.1),
                }[kind](h)
        return h


def _activation(net: RandomNet, rng: random.Random) -> None:
    kind = rng.choice(SMOOTH + KINKED if rng.random() < 0.3 else SMOOTH)
    net.kinked |= kind in KINKED
    net.add(kind)


def _bn(cls: type[nn.Module], c: int, g: torch.Generator) -> nn.Module:
    bn = cls(c)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(c, generator=g) * 0.3)
        bn.running_var.copy_(torch.rand(c, generator=g) + 0.5)
        bn.weight.copy_(torch.randn(c, generator=g) * 0.3 + 1)
        bn.bias.copy_(torch.randn(c, generator=g) * 0.3)
    return bn


def _affine_norm(m: nn.Module, g: torch.Generator) -> nn.Module:
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p is getattr(m, "weight", None) else 0.0))
    return m


def build(seed: int) -> tuple[RandomNet, tuple[int, ...]]:
    """A random network and its per-example input shape."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = RandomNet()
    spatial = rng.choice([0, 1, 2])
    count = iter(range(1000))
    name = lambda prefix: f"{prefix}{next(count)}"  # noqa: E731
    if spatial:
        one_d = (nn.Conv1d, nn.AvgPool1d, nn.BatchNorm1d, 8)
        conv, pool, bn, side = one_d if spatial == 1 else (nn.Conv2d, nn.AvgPool2d, nn.BatchNorm2d, 6)
        max_pool = nn.MaxPool1d if spatial == 1 else nn.MaxPool2d
        adaptive = nn.AdaptiveAvgPool1d if spatial == 1 else nn.AdaptiveAvgPool2d
        c = rng.choice([1, 2])
        shape: tuple[int, ...] = (c,) + (side,) * spatial
        net.add("layer", name("conv"), conv(c, 4, 3, padding=1))
        c = 4
        _activation(net, rng)
        for _ in range(rng.randint(2, 4)):
            kind = rng.choice(["conv", "residual", "tied", "twice", "bn", "group_norm", "layer_norm", "pool"])
            if kind == "conv":
                net.add("layer", name("conv"), conv(c, c, 3, padding=1))
                _activation(net, rng)
            elif kind == "residual":
                net.add("residual", name("res"), conv(c, c, 3, padding="same"))
            elif kind == "tied":  # two convs sharing one weight (each its own bias)
                a, b = conv(c, c, 3, padding=1), conv(c, c, 3, padding=1)
                b.weight = a.weight
                for m in (a, b):
                    net.add("layer", name("tied"), m)
                    _activation(net, rng)
            elif kind == "twice":
                net.add("twice", name("twice"), conv(c, c, 3, padding=1))
            elif kind == "bn":
                net.add("layer", name("bn"), _bn(bn, c, g))
            elif kind == "group_norm":
                net.add("layer", name("gn"), _affine_norm(nn.GroupNorm(2, c), g))
            elif kind == "layer_norm":
                net.add("layer", name("ln"), _affine_norm(nn.LayerNorm(side), g))
            elif side >= 4:
                choice = rng.choice(["avg", "max", "adaptive"])
                net.kinked |= choice == "max"
                module = {"avg": pool(2), "max": max_pool(2), "adaptive": adaptive(side // 2)}[choice]
                net.add("layer", name("pool"), module)
                side //= 2
        net.add("flatten")
        features = c * side**spatial
    else:
        shape = (5,)
        features = 5
    width = 6
    net.add("layer", name("lin"), nn.Linear(features, width))
    _activation(net, rng)
    square: nn.Linear | None = None
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(
            ["linear", "tied", "residual", "bn", "layer_norm", "fn_layer_norm", "rms", "group_norm", "raw"]
        )
        if kind == "linear":
            square = nn.Linear(width, width)
            net.add("layer", name("lin"), square)
            _activation(net, rng)
        elif kind == "tied":  # shares the weight of an earlier square layer, or of a new one
            if square is None:
                square = nn.Linear(width, width)
                net.add("layer", name("lin"), square)
                _activation(net, rng)
            tied = nn.Linear(width, width)
            tied.weight = square.weight
            net.add("layer", name("tied"), tied)
            _activation(net, rng)
        elif kind == "residual":
            net.add("residual", name("res"), nn.Linear(width, width))
        elif kind == "bn":
            net.add("layer", name("bn"), _bn(nn.BatchNorm1d, width, g))
        elif kind == "layer_norm":
            net.add("layer", name("ln"), _affine_norm(nn.LayerNorm(width), g))
        elif kind == "fn_layer_norm":
            n = name("fln")
            net.register_parameter(n + "_w", nn.Parameter(torch.randn(width, generator=g) * 0.3 + 1))
            net.register_parameter(n + "_b", nn.Parameter(torch.randn(width, generator=g) * 0.3))
            net.add("fn_layer_norm", n)
        elif kind == "rms":
            net.add("layer", name("rms"), _affine_norm(nn.RMSNorm(width), g))
        elif kind == "group_norm":
            net.add("layer", name("gn"), _affine_norm(nn.GroupNorm(2, width), g))
        else:
            n = name("raw")
            net.register_parameter(n, nn.Parameter(torch.randn(width, width, generator=g) / width**0.5))
            net.add("raw_twice", n)
    head = nn.Linear(width, CLASSES)
    net.add("layer", name("head"), head)
    return net.double().eval(), shape


def _data(net: nn.Module, shape: tuple[int, ...], seed: int, loss: str):
    g = torch.Generator().manual_seed(10_000 + seed)
    x = torch.randn(3, *shape, generator=g, dtype=torch.float64)
    if loss == "cross_entropy":
        y = torch.randint(0, CLASSES, (3,), generator=g)
    else:
        y = torch.randn(3, CLASSES, generator=g)
    v = {k: torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5 for k, p in net.named_parameters()}
    u = {k: torch.randn(p.shape, generator=g, dtype=torch.float64) for k, p in net.named_parameters()}
    return x, y.double() if loss == "mse" else y, v, u


def _close(a: dict, b: dict, rtol: float) -> None:
    scale = max(float(t.abs().max()) for t in b.values())
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=rtol * scale)


def _mixed_fd(net: nn.Module, x, y, loss: str, v: dict, u: dict) -> float:
    """∂³/∂s²∂r L(θ + s v + r u) at 0 from loss values: fourth-order central differences, extrapolated."""
    base = dict(net.named_parameters())
    f_loss = {"cross_entropy": cross_entropy, "mse": mse}[loss]

    def f(s: float, r: float) -> float:
        with torch.no_grad():
            p = {k: t + s * v[k] + r * u[k] for k, t in base.items()}
            return float(f_loss(functional_call(net, p, (x,)), y))

    d2 = {-2: -1 / 12, -1: 16 / 12, 0: -30 / 12, 1: 16 / 12, 2: -1 / 12}
    d1 = {-2: 1 / 12, -1: -8 / 12, 1: 8 / 12, 2: -1 / 12}

    def stencil(h: float) -> float:
        return sum(a * b * f(i * h, j * h) for i, a in d2.items() for j, b in d1.items()) / h**3

    coarse, fine = stencil(1e-3), stencil(5e-4)
    return (16 * fine - coarse) / 15  # Richardson: the O(h⁴) error terms cancel


SEEDS = list(range(24))


def test_generator_covers_every_layer_kind():
    kinds: set[str] = set()
    tied = twice = 0
    for seed in SEEDS:
        net, _ = build(seed)
        kinds |= {type(m).__name__ for m in net.modules()} | {k for k, _ in net.plan}
        params = list(net.named_parameters(remove_duplicate=False))
        tied += len(params) > len(list(net.named_parameters()))
        twice += any(k in ("twice", "raw_twice") for k, _ in net.plan)
    expected = {
        "Conv1d", "Conv2d", "Linear", "BatchNorm1d", "BatchNorm2d", "LayerNorm", "GroupNorm", "RMSNorm",
        "AvgPool1d", "MaxPool2d", "residual", "fn_layer_norm", "relu",
    }  # fmt: skip
    assert expected <= kinds, expected - kinds
    assert tied >= 3 and twice >= 3


FAST_SEEDS = 8  # the fast tier's architectures; CI builds every seed


@pytest.mark.parametrize("seed", [seed if seed < FAST_SEEDS else pytest.param(seed, marks=pytest.mark.slow)
                                  for seed in SEEDS])
def test_random_architecture(seed):
    net, shape = build(seed)
    loss = "cross_entropy" if seed % 2 == 0 else "mse"
    x, y, v, u = _data(net, shape, seed, loss)
    program_for(net)  # every layer of the generator has a Taylor rule

    ref = third_order_vector(net, x, y, v, loss=loss, method="autograd")
    assert ref.finite
    for method in ("taylor", "torch.func"):
        res = third_order_vector(net, x, y, v, loss=loss, method=method)
        assert res.method == method and res.finite
        _close(res.vector, ref.vector, 1e-9)

    hv_ref = hessian_vector_product(net, x, y, v, loss=loss, method="autograd")
    _close(hessian_vector_product(net, x, y, v, loss=loss, method="taylor").vector, hv_ref.vector, 1e-9)

    d_ref = directional_derivatives(net, x, y, v, order=4, loss=loss, method="torch.func")
    d_taylor = directional_derivatives(net, x, y, v, order=4, loss=loss, method="taylor")
    scale = d_ref.values.abs().clamp_min(1.0)
    assert float(((d_taylor.values - d_ref.values).abs() / scale).max()) < 1e-9
    # vᵀHv from the Hessian-vector product and from the directional derivatives agree
    vhv = sum(float((hv_ref.vector[k] * v[k]).sum()) for k in v)
    assert abs(vhv - float(d_ref.values[2])) <= 1e-9 * max(1.0, abs(vhv))

    if not net.kinked:  # the reference against loss values alone
        fd = _mixed_fd(net, x, y, loss, v, u)
        ut = sum(float((ref.vector[k] * u[k]).sum()) for k in u)
        assert abs(ut - fd) <= 1e-6 * abs(fd) + 1e-4, (ut, fd)  # truncation; round-off ≈ 1e-5
