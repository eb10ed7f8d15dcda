"""Bad input: errors that name the argument, the value and what is allowed; one signature style."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fedhog.derivatives as derivatives
from fedhog.derivatives import (
    Unsupported,
    directional_derivatives,
    gradient,
    hessian,
    hessian_vector_product,
    third_order_step_size,
    third_order_vector,
)

ENGINE = [gradient, hessian_vector_product, third_order_vector, directional_derivatives, hessian]
WITH_DIRECTION = [hessian_vector_product, third_order_vector, directional_derivatives]


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    v = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    return model, x, y, v


def _call(f, model, x, y, v, **kwargs):
    if f is directional_derivatives:
        kwargs.setdefault("order", 3)
    return f(model, x, y, v, **kwargs) if f in WITH_DIRECTION else f(model, x, y, **kwargs)


def test_exception_types_are_exported():
    assert issubclass(derivatives.UntrustedOperation, derivatives.Unsupported)
    assert issubclass(derivatives.Unsupported, ValueError)
    assert {"Unsupported", "UntrustedOperation"} <= set(derivatives.__all__)


@pytest.mark.parametrize("f", ENGINE)
def test_a_plain_function_as_model(f):
    _, x, y, v = _setup()

    def logits(inputs):
        return inputs[:, :3]

    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module.*function 'test_a_plain_function.*logits'"):
        _call(f, logits, x, y, v)


@pytest.mark.parametrize("f", WITH_DIRECTION)
def test_direction_none_or_flat_vector(f):
    model, x, y, v = _setup()
    with pytest.raises(TypeError, match=r"direction must be a dict keyed by parameter name.*got None"):
        _call(f, model, x, y, None)
    flat = torch.cat([t.reshape(-1) for t in v.values()])
    with pytest.raises(TypeError, match=r"direction must be a dict keyed by parameter name") as info:
        _call(f, model, x, y, flat)
    message = str(info.value)
    assert f"shape ({flat.numel()},)" in message and len(message) < 400
    assert f"{float(flat[0]):.4f}" not in message  # the elements are not listed


def test_direction_with_wrong_keys_or_shapes():
    model, x, y, v = _setup()
    many = {f"layer{i}.weight": torch.zeros(1) for i in range(50)}
    with pytest.raises(ValueError, match=r"missing \['0\.bias'.*unexpected \['layer0\.weight'.*\(50 in all\)") as info:
        third_order_vector(model, x, y, many)
    assert len(str(info.value)) < 400
    with pytest.raises(ValueError, match=r"direction\['0\.weight'\] has shape \(4, 5\); expected \(5, 4\)"):
        third_order_vector(model, x, y, {**v, "0.weight": torch.zeros(4, 5)})
    with pytest.raises(TypeError, match=r"direction\['0\.bias'\] must be a torch\.Tensor.*got a list"):
        third_order_vector(model, x, y, {**v, "0.bias": [0.0] * 5})


@pytest.mark.parametrize("order", [2.5, 3.0, "3", None, True])
def test_order_must_be_a_non_negative_int(order):
    model, x, y, v = _setup()
    with pytest.raises(TypeError, match=rf"order must be a non-negative int.*got {order!r}"):
        directional_derivatives(model, x, y, v, order=order)


def test_negative_order_and_positional_order():
    model, x, y, v = _setup()
    with pytest.raises(ValueError, match=r"order must be a non-negative int.*got -1"):
        directional_derivatives(model, x, y, v, order=-1)
    with pytest.raises(TypeError):
        directional_derivatives(model, x, y, v, 3)  # options are keyword-only


@pytest.mark.parametrize("f", ENGINE)
def test_unknown_method_loss_and_argument_types(f):
    model, x, y, v = _setup()
    allowed = r"\('auto', 'taylor', 'torch.func', 'autograd'\)"
    with pytest.raises(ValueError, match=rf"method must be one of {allowed}; got 'jax'"):
        _call(f, model, x, y, v, method="jax")
    with pytest.raises(ValueError, match=r"loss must be one of \['cross_entropy', 'mse'\] or a callable.*got 'nll'"):
        _call(f, model, x, y, v, loss="nll")
    with pytest.raises(TypeError, match=r"inputs must be a torch\.Tensor; got a list"):
        _call(f, model, x.tolist(), y, v)
    with pytest.raises(TypeError, match=r"per_example must be True or False; got 1"):
        _call(f, model, x, y, v, per_example=1)


def test_method_not_available_for_a_quantity():
    model, x, y, v = _setup()
    expected = r"method='taylor' is not available for the Hessian; expected one of \('auto', 'torch.func'\)"
    with pytest.raises(ValueError, match=expected):
        hessian(model, x, y, method="taylor")
    with pytest.raises(ValueError, match=r"method='autograd' is not available for the directional derivatives"):
        directional_derivatives(model, x, y, v, order=2, method="autograd")
    with pytest.raises(ValueError, match=r"method must be one of \('auto', 'taylor', 'torch.func'\); got 'autograd'"):
        third_order_step_size(model, x, y, method="autograd")
    with pytest.raises(ValueError, match=r"max_step must be a positive finite number; got 0"):
        third_order_step_size(model, x, y, max_step=0)


class TanhGelu(nn.Module):
    """Traces (F.gelu has a rule) but its rule refuses the tanh approximation at run time."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.lin(x), approximate="tanh")


def test_taylor_rule_failing_at_run_time():
    torch.manual_seed(1)
    model = TanhGelu().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    v = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    for f in WITH_DIRECTION:
        with pytest.raises(Unsupported, match=r"method='taylor': tanh-approximated GELU"):
            _call(f, model, x, y, v, method="taylor")
        res = _call(f, model, x, y, v)  # auto falls back
        assert res.method in ("torch.func", "autograd") and res.finite


def test_taylor_without_a_rule_names_the_module():
    model = nn.Sequential(nn.Linear(4, 3), nn.ELU()).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    v = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    with pytest.raises(Unsupported, match=r"method='taylor': no Taylor rule for module '1' \(ELU\)"):
        third_order_vector(model, x, y, v, method="taylor")
    with pytest.raises(Unsupported, match=r"method='taylor': Taylor mode needs a named loss"):
        third_order_vector(model, x, y, v, loss=lambda out, t: out.pow(2).mean(), method="taylor")


def test_one_signature_style():
    for f in [*ENGINE, third_order_step_size]:
        params = inspect.signature(f).parameters
        data = [p for p in params.values() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        options = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert [p.name for p in data][:3] == ["model", "inputs", "targets"], f.__name__
        assert {p.name for p in data} <= {"model", "inputs", "targets", "direction"}, f.__name__
        assert "method" in {p.name for p in options} and "loss" in {p.name for p in options}, f.__name__
