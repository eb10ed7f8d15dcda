"""The normalisation choice of the built-in models: GroupNorm and weight standardisation (fedhog.models).

What each layer is for, checked as a property: GroupNorm uses one example's statistics (DP-SGD bounds each
example's gradient; BatchNorm would mix them), a weight-standardised layer is invariant to the scale of its
weights (the DP noise's random walk inflates it), and both stay smooth enough for the third-order term (against
finite differences of the Hessian-vector product in float64, through every derivative formulation).
"""

from __future__ import annotations

import pytest
import torch
from helpers import call_at
from torch import nn
from torch.func import functional_call

from fedhog.derivatives import hessian_vector_product, third_order_vector
from fedhog.models import MODELS, NORMALIZATIONS, build_model, group_count, standardize

SHAPES = {"mlp": (1, 40), "cnn1d": (1, 40), "cnn2d": (1, 8, 8)}
NORMALIZED = [n for n in NORMALIZATIONS if n != "none"]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _hidden_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))][:-1]  # less the head


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
@pytest.mark.parametrize("name", MODELS)
def test_the_normalization_keeps_every_layers_initial_weights(name, normalization):
    """For one seed the linear and convolution layers start from the same weights whatever the choice."""
    shape = SHAPES.get(name, (1, 40))
    torch.manual_seed(4)
    plain = build_model(name, shape, 10)
    torch.manual_seed(4)
    normalized = build_model(name, shape, 10, normalization=normalization)
    layers = [m for m in plain.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    others = [m for m in normalized.modules() if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d))]
    assert len(layers) == len(others)
    assert all(torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
               for a, b in zip(layers, others, strict=True))
    if normalization == "ws":  # the same parameters under the same names: only the forward differs
        assert list(plain.state_dict()) == list(normalized.state_dict())


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_parameter_counts_by_formula(normalization):
    """GroupNorm adds a scale and a shift per channel of each hidden layer; weight standardisation adds nothing."""
    extra = 2 if "group" in normalization else 0
    assert num_params(build_model("cnn1d", (1, 40), 10, normalization=normalization)) == \
        (25 * 5 + 25) + 2 * (25 * 25 * 5 + 25) + (25 * 4 * 10 + 10) + extra * 3 * 25
    assert num_params(build_model("mlp", (1, 40), 10, normalization=normalization)) == \
        (40 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10) + extra * 2 * 64
    assert num_params(build_model("cnn2d", (1, 8, 8), 10, normalization=normalization)) == \
        (9 * 16 + 16) + (16 * 9 * 32 + 32) + (32 * 16 * 10 + 10) + extra * (16 + 32)


def test_group_counts_are_near_the_square_root_of_the_width():
    assert [group_count(w) for w in (25, 16, 32, 64, 7, 1)] == [5, 4, 4, 8, 1, 1]
    model = build_model("cnn1d", (1, 40), 10, normalization="group")
    assert [(m.num_groups, m.num_channels) for m in model.modules() if isinstance(m, nn.GroupNorm)] == [(5, 25)] * 3


def test_standardize_centres_each_row_and_scales_it_to_norm_one():
    weight = torch.randn(6, 3, 5, dtype=torch.float64) * 4 + 2
    rows = standardize(weight).flatten(1)
    torch.testing.assert_close(rows.sum(1), torch.zeros(6, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(rows.norm(dim=1), torch.ones(6, dtype=torch.float64), atol=1e-6, rtol=0)
    reference = weight.flatten(1) - weight.flatten(1).mean(1, keepdim=True)
    torch.testing.assert_close(rows, reference / reference.norm(dim=1, keepdim=True), atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["mlp", "cnn1d", "cnn2d"])
def test_weight_standardized_layers_ignore_the_scale_and_offset_of_their_weights(name):
    """What bounds the noise's random walk: inflating a hidden layer's weights (×25) and shifting each of its
    units' weights by a constant leave the function unchanged with ws, not without."""
    shape = SHAPES[name]
    x = torch.randn(5, *shape, dtype=torch.float64)
    for normalization, invariant in (("ws", True), ("group-ws", True), ("none", False), ("group", False)):
        torch.manual_seed(0)
        model = build_model(name, shape, 10, normalization=normalization).double()
        before = model(x)
        with torch.no_grad():
            for layer in _hidden_layers(model):
                shift = torch.randn(layer.weight.shape[0], *[1] * (layer.weight.dim() - 1), dtype=torch.float64)
                layer.weight.mul_(25).add_(shift)
        assert torch.allclose(model(x), before, rtol=1e-5, atol=1e-6) == invariant, normalization


@pytest.mark.parametrize("normalization", NORMALIZED)
@pytest.mark.parametrize("name", ["mlp", "cnn1d", "cnn2d"])
def test_each_examples_output_depends_on_that_example_alone(name, normalization):
    """GroupNorm's statistics are one example's (BatchNorm's would be the batch's: not per-example, not DP-SGD)."""
    shape = SHAPES[name]
    torch.manual_seed(1)
    model = build_model(name, shape, 10, normalization=normalization).double()
    x = torch.randn(6, *shape, dtype=torch.float64)
    alone = torch.cat([model(x[i:i + 1]) for i in range(6)])
    torch.testing.assert_close(model(x), alone, rtol=1e-10, atol=1e-12)
    changed = x.clone()
    changed[1:] = 100 * torch.randn_like(changed[1:])
    torch.testing.assert_close(model(changed)[0], model(x)[0], rtol=1e-10, atol=1e-12)


CASES = [("mlp", "taylor"), ("mlp", "torch.func"), ("mlp", "autograd"), ("cnn1d", "torch.func"),
         ("cnn1d", "autograd"), ("cnn2d", "torch.func")]


@pytest.mark.parametrize("normalization", NORMALIZED)
@pytest.mark.parametrize("name, method", CASES)
def test_third_order_vector_matches_differences_of_the_hessian_vector_product(name, method, normalization):
    """t = T[v, v, ·] is the derivative of H(θ)v along v; float64, central differences (error O(h²))."""
    shape = SHAPES[name]
    torch.manual_seed(2)
    model = build_model(name, shape, 10, normalization=normalization).double()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, *shape, generator=g, dtype=torch.float64)
    y = torch.randint(0, 10, (6,), generator=g)
    v = {k: 0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64) for k, p in model.named_parameters()}
    t = third_order_vector(model, x, y, v, loss="cross_entropy", method=method)
    assert t.finite and t.method == method
    h = 1e-5  # GroupNorm's higher derivatives are large: the O(h²) error needs a small step
    params = {k: p.detach() for k, p in model.named_parameters()}
    plus = call_at(model, {k: params[k] + h * v[k] for k in v}, hessian_vector_product, x, y, v, loss="cross_entropy")
    minus = call_at(model, {k: params[k] - h * v[k] for k in v}, hessian_vector_product, x, y, v, loss="cross_entropy")
    scale = max(float(t.vector[k].abs().max()) for k in v)
    assert scale > 1e-3  # the term carries something through the normalised layers
    for k in v:
        fd = (plus.vector[k] - minus.vector[k]) / (2 * h)
        torch.testing.assert_close(t.vector[k], fd, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("normalization", NORMALIZED)
def test_the_normalized_models_batch_over_clients_with_vmap(normalization):
    """The vectorized engine's forward: functional_call under vmap, one parameter set per client."""
    torch.manual_seed(5)
    model = build_model("cnn1d", (1, 40), 10, normalization=normalization)
    params = {k: torch.stack([p.detach() + 0.1 * client * torch.randn_like(p) for client in range(3)])
              for k, p in model.named_parameters()}
    x = torch.randn(3, 4, 1, 40)
    batched = torch.func.vmap(lambda p, xs: functional_call(model, p, (xs,)))(params, x)
    for client in range(3):
        alone = functional_call(model, {k: v[client] for k, v in params.items()}, (x[client],))
        torch.testing.assert_close(batched[client], alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("normalization", NORMALIZED)
def test_the_normalized_models_script_for_export(normalization):
    """``fedhog export`` writes TorchScript: the scripted model computes what the eager one does."""
    model = build_model("cnn1d", (1, 40), 10, normalization=normalization).eval()
    x = torch.randn(3, 40)
    torch.testing.assert_close(torch.jit.script(model)(x), model(x))


def test_an_unknown_normalization_names_the_key_and_the_choices():
    with pytest.raises(ValueError, match="normalization='batch'") as info:
        build_model("mlp", (1, 40), 10, normalization="batch")
    assert all(name in str(info.value) for name in NORMALIZATIONS)
