"""simulations/bench_derivatives.py's ratio in matrix products alone: a hand count, and the products fedhog's Taylor
mode and a gradient really run (torch's FLOP counter)."""

from __future__ import annotations

import pytest
import torch
from helpers import load_simulation
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from fedhog.derivatives import third_order_vector


class MatmulFlops(TorchDispatchMode):
    """The FLOPs of the matrix products run under it, as torch's FLOP counter counts them (without its module hooks,
    which Taylor mode refuses: torch.fx does not run hooks)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = torch.ops.aten.addmm if func._overloadpacket is torch.ops.aten.addmm_ else func._overloadpacket
        count = flop_registry.get(packet)  # in-place addmm_ (∇W accumulated) counted as addmm
        if count is not None:
            self.total += count(*args, **kwargs, out_val=out)
        return out


@pytest.fixture(scope="module")
def bench():
    return load_simulation("bench_derivatives")


def test_product_ratio_counts_three_against_two_for_the_data_layer_and_eleven_against_three_after(bench):
    mlp = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # 32 then 16 multiply-adds an example
    assert bench.product_ratio(mlp, (4,)) == pytest.approx((3 * 32 + 11 * 16) / (2 * 32 + 3 * 16))
    cnn = nn.Sequential(nn.Conv1d(1, 4, 3), nn.Tanh(), nn.Flatten(), nn.Linear(32, 2))  # 8·4·3 = 96, then 64
    assert bench.product_ratio(cnn, (1, 10)) == pytest.approx((3 * 96 + 11 * 64) / (2 * 96 + 3 * 64))


def test_product_ratio_is_what_taylor_mode_and_a_gradient_multiply(bench):
    """Layers large enough for Karatsuba's products: the FLOPs torch counts in fedhog's third-order vector over those
    in one gradient are the script's ratio (elementwise work and the loss hold no matrix product)."""
    torch.manual_seed(0)
    width = 256  # 128 examples x 256 x 256 multiply-adds a product: past KARATSUBA_MIN_MACS
    model = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),
                          nn.Linear(width, width))
    x, y = torch.randn(128, width), torch.randint(0, width, (128,))
    direction = {k: torch.randn_like(p) for k, p in model.named_parameters()}
    with MatmulFlops() as gradient_flops:
        torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
    with MatmulFlops() as third_order_flops:
        result = third_order_vector(model, x, y, direction, method="taylor")
    assert result.method == "taylor" and gradient_flops.total > 0
    ratio = third_order_flops.total / gradient_flops.total
    assert ratio == pytest.approx(bench.product_ratio(model, (width,)), rel=1e-9)
    assert bench.product_ratio(model, (width,)) == pytest.approx(25 / 8)


def test_trace_product_floor_is_what_the_batched_trace_gradient_multiplies(bench):
    """k directions in one batched pass: the FLOPs torch counts over a gradient's are the script's count (the
    primal's products once, ten a direction an inner layer), for a CNN and an MLP."""
    from fedhog.derivatives import hessian_trace_gradient

    torch.manual_seed(0)
    for model, shape in ((nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                                        nn.Linear(32, 5)), (16,)),
                         (nn.Sequential(nn.Conv1d(1, 4, 3), nn.GELU(), nn.Flatten(), nn.Linear(4 * 10, 5)), (1, 12))):
        x, y = torch.randn(8, *shape), torch.randint(0, 5, (8,))
        with MatmulFlops() as gradient_flops:
            torch.autograd.grad(nn.functional.cross_entropy(model(x), y), list(model.parameters()))
        directions = [{k: torch.randn_like(p) for k, p in model.named_parameters()} for _ in range(3)]
        with MatmulFlops() as trace_flops:
            result = hessian_trace_gradient(model, x, y, directions=directions, method="taylor")
        assert result.method == "taylor"
        assert trace_flops.total / gradient_flops.total == pytest.approx(bench.trace_product_floor(model, shape, 3))
