import pytest
import torch
from torch.func import functional_call, jvp

from fedhog.models import MODELS, build_model

SHAPES = {"mnist1d": (1, 40), "mnist1d_flat": (40,), "digits": (1, 8, 8), "synthetic": (60,)}
PAIRS = [(m, s) for m in ("logreg", "mlp") for s in SHAPES] + [
    ("cnn1d", "mnist1d"),
    ("cnn1d", "mnist1d_flat"),
    ("cnn1d", "synthetic"),
    ("cnn2d", "digits"),
]


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(("name", "data"), PAIRS)
def test_output_shape(name, data):
    shape = SHAPES[data]
    model = build_model(name, shape, 10)
    assert model(torch.randn(5, *shape)).shape == (5, 10)


def test_cnns_accept_inputs_without_channel_axis():
    assert build_model("cnn1d", (1, 40), 10)(torch.randn(2, 40)).shape == (2, 10)
    assert build_model("cnn2d", (1, 8, 8), 10)(torch.randn(2, 8, 8)).shape == (2, 10)


@pytest.mark.parametrize(("name", "data"), PAIRS)
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


@pytest.mark.parametrize(("name", "shape"), [("cnn1d", (1, 8, 8)), ("cnn1d", (10,)), ("cnn2d", (60,))])
def test_incompatible_input_shape_error(name, shape):
    with pytest.raises(ValueError, match="model: input"):
        build_model(name, shape, 10)
