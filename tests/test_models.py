import pytest
import torch
from torch.func import functional_call, jvp

from fedhog.derivatives import directional_derivatives
from fedhog.models import ACTIVATIONS, MODELS, build_model

SHAPES = {"mnist1d": (1, 40), "mnist1d_flat": (40,), "digits": (1, 8, 8), "synthetic": (60,)}
PAIRS = [(m, s) for m in ("logreg", "mlp") for s in SHAPES] + [
    ("cnn1d", "mnist1d"),
    ("cnn1d", "mnist1d_flat"),
    ("cnn1d", "synthetic"),
    ("cnn2d", "digits"),
]


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name, data", PAIRS)
def test_output_shape(name, data):
    shape = SHAPES[data]
    model = build_model(name, shape, 10)
    assert model(torch.randn(5, *shape)).shape == (5, 10)


def test_cnns_accept_inputs_without_channel_axis():
    assert build_model("cnn1d", (1, 40), 10)(torch.randn(2, 40)).shape == (2, 10)
    assert build_model("cnn2d", (1, 8, 8), 10)(torch.randn(2, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize("name, data", PAIRS)
def test_parameter_counts_small(name, data):
    n = num_params(build_model(name, SHAPES[data], 10))
    assert 0 < n < 20_000


def test_logreg_parameter_count():
    assert num_params(build_model("logreg", (1, 8, 8), 10)) == 64 * 10 + 10


@pytest.mark.parametrize("name", MODELS)
def test_deterministic_init(name):
    shape = (1, 8, 8) if name == "cnn2d" else (1, 40)
    torch.manual_seed(3)
    a = build_model(name, shape, 10).state_dict()
    torch.manual_seed(3)
    b = build_model(name, shape, 10).state_dict()
    torch.manual_seed(4)
    c = build_model(name, shape, 10).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


@pytest.mark.parametrize("name", MODELS)
def test_third_directional_derivative_nonzero(name):
    """Models are pure (no buffers) and smooth enough for nested torch.func transforms."""
    torch.manual_seed(0)
    shape = (1, 8, 8) if name == "cnn2d" else (1, 40)
    model = build_model(name, shape, 10)
    assert not list(model.buffers())
    params = {k: v.detach() for k, v in model.named_parameters()}
    direction = {k: torch.randn_like(v) for k, v in params.items()}
    x, y = torch.randn(4, *shape), torch.tensor([0, 1, 2, 3])

    def loss(p):
        return torch.nn.functional.cross_entropy(functional_call(model, p, (x,)), y)

    def d1(p):
        return jvp(loss, (p,), (direction,))[1]

    def d2(p):
        return jvp(d1, (p,), (direction,))[1]

    d3 = jvp(d2, (params,), (direction,))[1]
    assert torch.isfinite(d3) and d3.abs() > 1e-8


def test_unknown_name_error():
    with pytest.raises(ValueError, match="model") as info:
        build_model("resnet", (1, 40), 10)
    message = str(info.value)
    assert "'resnet'" in message and all(name in message for name in MODELS)


@pytest.mark.parametrize("name, shape", [("cnn1d", (1, 8, 8)), ("cnn1d", (10,)), ("cnn2d", (60,))])
def test_incompatible_input_shape_error(name, shape):
    with pytest.raises(ValueError, match="model: input"):
        build_model(name, shape, 10)


# --- the activation choice ----------------------------------------------------------------------

SMOOTH = [name for name in ACTIVATIONS if name != "relu"]


class _TanhCNN1dBeforeTheChoice(torch.nn.Module):
    """fedhog's cnn1d as it was before ``activation`` existed (an independent copy, not an import)."""

    def __init__(self) -> None:
        super().__init__()
        layers: list[torch.nn.Module] = []
        for c_in in (1, 25, 25):
            layers += [torch.nn.Conv1d(c_in, 25, 5, stride=2, padding=1), torch.nn.Tanh()]
        self.features = torch.nn.Sequential(*layers, torch.nn.Flatten())
        self.head = torch.nn.Linear(25 * 4, 10)

    def forward(self, x):
        return self.head(self.features(x.unsqueeze(1) if x.dim() == 2 else x))


def test_tanh_builds_the_earlier_cnn1d_bit_for_bit():
    torch.manual_seed(5)
    old = _TanhCNN1dBeforeTheChoice()
    torch.manual_seed(5)
    new = build_model("cnn1d", (1, 40), 10, activation="tanh")
    assert list(old.state_dict()) == list(new.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(old.state_dict().values(), new.state_dict().values(), strict=True))
    x = torch.randn(7, 1, 40)
    assert torch.equal(old(x), new(x))


@pytest.mark.parametrize("name", MODELS)
def test_the_activation_changes_the_nonlinearity_not_the_weights(name):
    shape = (1, 8, 8) if name == "cnn2d" else (1, 40)
    states = []
    for activation in ACTIVATIONS:
        torch.manual_seed(2)
        states.append(build_model(name, shape, 10, activation=activation).state_dict())
    assert all(torch.equal(s[k], states[0][k]) for s in states for k in s)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_parameter_counts_by_formula(activation):
    # cnn1d on length 40: three Conv1d(k=5, s=2, p=1) take 40 → 19 → 9 → 4 positions of 25 channels
    assert num_params(build_model("cnn1d", (1, 40), 10, activation)) == (25 * 5 + 25) + 2 * (25 * 25 * 5 + 25) \
        + (25 * 4 * 10 + 10)
    assert num_params(build_model("mlp", (1, 40), 10, activation)) == (40 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)
    # cnn2d on 8x8: 3x3 convolutions to 16 channels, then 32 channels at stride 2 (4x4)
    assert num_params(build_model("cnn2d", (1, 8, 8), 10, activation)) == (9 * 16 + 16) + (16 * 9 * 32 + 32) \
        + (32 * 16 * 10 + 10)


def _third_derivative_by_differences(f, x: torch.Tensor, h: float = 1e-2) -> torch.Tensor:
    """Central fourth-order-accurate differences of f''' (float64)."""
    return (-f(x + 3 * h) + 8 * f(x + 2 * h) - 13 * f(x + h) + 13 * f(x - h) - 8 * f(x - 2 * h) + f(x - 3 * h)) \
        / (8 * h ** 3)


@pytest.mark.parametrize("activation", SMOOTH)
def test_smooth_activations_have_the_third_derivative_of_their_formula(activation):
    """Nested autograd through the module against finite differences of the textbook formula."""
    formula = {"tanh": torch.tanh, "silu": lambda x: x / (1 + torch.exp(-x)),
               "gelu": lambda x: 0.5 * x * (1 + torch.erf(x / 2 ** 0.5)),
               "softplus": lambda x: torch.log1p(torch.exp(x))}[activation]
    module = ACTIVATIONS[activation]().double()
    x = torch.linspace(-3, 3, 13, dtype=torch.float64, requires_grad=True)
    (d1,) = torch.autograd.grad(module(x).sum(), x, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), x, create_graph=True)
    (d3,) = torch.autograd.grad(d2.sum(), x)
    torch.testing.assert_close(d3, _third_derivative_by_differences(formula, x.detach()), atol=1e-5, rtol=1e-4)
    assert d3.abs().max() > 0.05


@pytest.mark.parametrize("activation", SMOOTH)
@pytest.mark.parametrize("name", ["mlp", "cnn1d", "cnn2d"])
def test_smooth_models_third_directional_derivative_matches_differences(name, activation):
    """d³/ds³ L(θ + s v) from the derivative engine the HOG term uses against differences of L in float64."""
    torch.manual_seed(1)
    shape = (1, 8, 8) if name == "cnn2d" else (1, 40)
    model = build_model(name, shape, 10, activation).double()
    x, y = torch.randn(6, *shape, dtype=torch.float64), torch.tensor([0, 1, 2, 3, 4, 5])
    direction = {k: 0.1 * torch.randn_like(v) for k, v in model.named_parameters()}
    result = directional_derivatives(model, x, y, direction, order=3)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_along(s: float) -> torch.Tensor:
        moved = {k: params[k] + s * direction[k] for k in params}
        return torch.nn.functional.cross_entropy(functional_call(model, moved, (x,)), y)

    by_differences = _third_derivative_by_differences(lambda s: loss_along(float(s)), torch.tensor(0.0), 1e-2)
    assert float(result.values[3]) == pytest.approx(float(by_differences), rel=1e-3, abs=1e-6)
    assert abs(float(result.values[3])) > 1e-4


def test_relus_third_derivative_vanishes_away_from_its_kink():
    """Why relu is not the default: it gives the third-order term nothing from the hidden layers."""
    x = torch.tensor([-2.0, -0.5, 0.5, 2.0], dtype=torch.float64, requires_grad=True)
    (d1,) = torch.autograd.grad(ACTIVATIONS["relu"]()(x).sum(), x, create_graph=True)
    assert not d1.requires_grad or torch.equal(torch.autograd.grad(d1.sum(), x, allow_unused=True,
                                                                   materialize_grads=True)[0], torch.zeros_like(x))


def test_unknown_activation_error():
    with pytest.raises(ValueError, match="activation='sine'") as info:
        build_model("mlp", (1, 40), 10, activation="sine")
    assert all(name in str(info.value) for name in ACTIVATIONS)
