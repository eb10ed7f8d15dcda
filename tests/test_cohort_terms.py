"""The cohort's third-order terms against an independent reference: central differences of the HVP.

:class:`fedhog.engines.cohort.CohortTrainer` computes every client's t_k = ∇_θ(v_kᵀ∇²L_k v_k) at once
(Taylor mode vmapped over the clients, or nested ``torch.func`` where a model has no Taylor program).
Here each client's term is checked on its own, in float64, against the central difference of the
Hessian-vector product along v_k (t = T[v, v, ·] = d/dε H(θ + εv) v), the HVP by double backward of
plain autograd: no Taylor series, no ``torch.func``.
"""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from torch import nn

from fedhog.engines import cohort
from fedhog.engines.cohort import CohortTrainer, HogSettings
from fedhog.models import build_model
from fedhog.training import hog_rows, random_direction

EPS = 1e-5


def _population(shape: tuple[int, ...], sizes: list[int]) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(sum(sizes), *shape))
    y = rng.integers(0, 10, size=sum(sizes))
    bounds = np.cumsum([0, *sizes])
    return x, y, tuple(np.arange(a, b) for a, b in itertools.pairwise(bounds))


def _hvp(model: nn.Module, params: dict[str, torch.Tensor], v: dict[str, torch.Tensor], x: torch.Tensor,
         y: torch.Tensor) -> dict[str, torch.Tensor]:
    """∇²L(params)·v by double backward (autograd), L the mean cross-entropy over (x, y)."""
    leaves = {k: p.detach().clone().requires_grad_() for k, p in params.items()}
    loss = nn.functional.cross_entropy(torch.func.functional_call(model, leaves, (x,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()), create_graph=True)
    inner = sum((g * v[k]).sum() for g, k in zip(grads, leaves, strict=True))
    return dict(zip(leaves, torch.autograd.grad(inner, list(leaves.values())), strict=True))


def _check_against_finite_differences(model: nn.Module, shape: tuple[int, ...], taylor: bool) -> None:
    model = model.double()
    sizes = [9, 4, 12]  # hog-batch-size 8: client 1 has fewer rows, so the batch is padded and masked
    x, y, indices = _population(shape, sizes)
    trainer = CohortTrainer(model, x, y, indices, torch.device("cpu"))
    start = model.state_dict()
    partitions, seeds = [0, 1, 2], [21, 22, 23]
    work = trainer.train(start, partitions, seeds, 1, 4, 0.0, 0.0, HogSettings("random", "third-order", 8))
    assert work.terms is not None and all(work.term_finite)
    params = {k: p.detach() for k, p in model.named_parameters()}
    for k, (partition, seed) in enumerate(zip(partitions, seeds, strict=True)):
        v = random_direction(params, seed)
        rows = indices[partition][hog_rows(sizes[partition], 8, seed)]
        xs, ys = torch.as_tensor(x[rows]), torch.as_tensor(y[rows])
        plus = _hvp(model, {n: p + EPS * v[n] for n, p in params.items()}, v, xs, ys)
        minus = _hvp(model, {n: p - EPS * v[n] for n, p in params.items()}, v, xs, ys)
        expected = torch.cat([((plus[n] - minus[n]) / (2 * EPS)).reshape(-1) for n in start])
        torch.testing.assert_close(work.terms[k], expected, rtol=1e-6, atol=1e-8)
    assert (trainer._program is not None) == taylor  # Taylor mode stayed in use (or the fallback was taken)


@pytest.mark.parametrize("name, shape, activation", [
    ("mlp", (1, 40), "gelu"), ("mlp", (1, 40), "tanh"), ("cnn1d", (1, 40), "gelu"), ("cnn1d", (1, 40), "silu"),
    ("cnn2d", (1, 8, 8), "softplus")])
def test_taylor_mode_terms_match_finite_differences_of_the_hvp(name, shape, activation):
    torch.manual_seed(1)
    _check_against_finite_differences(build_model(name, shape, 10, activation), shape, taylor=True)


class _TanhGeluMLP(nn.Module):
    """Calls ``F.gelu(approximate="tanh")``: torch.fx traces it, the Taylor rule is missing only when it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(40, 16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(x.flatten(1)), approximate="tanh"))


def test_models_without_taylor_rules_fall_back_to_nested_jvp_with_the_same_terms():
    torch.manual_seed(2)
    untraced = nn.Sequential(nn.Flatten(), nn.Linear(40, 16), nn.GELU(approximate="tanh"), nn.Linear(16, 10))
    _check_against_finite_differences(untraced, (1, 40), taylor=False)  # no program from the start
    traced = _TanhGeluMLP()
    assert CohortTrainer(traced, *_population((1, 40), [1])[:2], (np.arange(1),),
                         torch.device("cpu"))._program is not None
    _check_against_finite_differences(traced, (1, 40), taylor=False)  # Unsupported at run time, then the fallback


@pytest.mark.parametrize("name, shape", [("mlp", (1, 40)), ("cnn1d", (1, 40))])
def test_terms_computed_in_passes_of_a_few_clients_equal_one_pass(name, shape, monkeypatch):
    """Bit for bit where the batched kernels are per client (matrix products); a convolution over K clients is one
    grouped convolution whose kernel the group count selects, so there the split reassociates float32 sums."""
    torch.manual_seed(3)
    model = build_model(name, shape, 10)
    sizes = [9, 4, 12, 7, 10]
    x, y, indices = _population(shape, sizes)
    trainer = CohortTrainer(model, x.astype(np.float32), y, indices, torch.device("cpu"))
    start, partitions, seeds = model.state_dict(), [0, 1, 2, 3, 4], [31, 32, 33, 34, 35]
    hog = HogSettings("random", "third-order", 8)
    whole = trainer.train(start, partitions, seeds, 1, 4, 0.0, 0.0, hog)
    monkeypatch.setattr(cohort, "TERM_CLIENTS_PER_PASS", 2)  # passes of 2, 2 and 1 clients
    split = trainer.train(start, partitions, seeds, 1, 4, 0.0, 0.0, hog)
    if name == "mlp":
        assert torch.equal(whole.terms, split.terms)
    else:
        torch.testing.assert_close(split.terms, whole.terms, rtol=1e-5, atol=1e-6 * float(whole.terms.abs().max()))


class _MixedDtypeMLP(nn.Module):
    """Parameters of two dtypes (a float32 gain used in float64): random directions take the per-tensor path."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = nn.Linear(40, 16).double(), nn.Linear(16, 10).double()
        self.gain = nn.Parameter(torch.full((16,), 1.5, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.hidden(x.flatten(1))) * self.gain.double())


def test_a_model_of_mixed_dtypes_takes_random_directions_too():
    """hog-direction = "random" on a model whose parameters are not all one dtype: each client's term is along
    ``random_direction(params, seed)``, as the ClientApp's (the per-tensor path once took the update's direction)."""
    torch.manual_seed(4)
    model = _MixedDtypeMLP()
    sizes = [9, 4, 12]
    x, y, indices = _population((1, 40), sizes)
    trainer = CohortTrainer(model, x, y, indices, torch.device("cpu"))
    start, partitions, seeds = model.state_dict(), [0, 1, 2], [41, 42, 43]
    work = trainer.train(start, partitions, seeds, 1, 4, 0.1, 0.0, HogSettings("random", "third-order", 8))
    assert work.terms is not None and all(work.term_finite)
    params = {k: p.detach() for k, p in model.named_parameters()}
    reference = copy.deepcopy(model).double()  # the HVP's central difference in float64 throughout
    for k, (partition, seed) in enumerate(zip(partitions, seeds, strict=True)):
        v = {n: d.double() for n, d in random_direction(params, seed).items()}  # the values the cohort mixes
        rows = indices[partition][hog_rows(sizes[partition], 8, seed)]
        xs, ys = torch.as_tensor(x[rows]), torch.as_tensor(y[rows])
        wide = {n: p.double() for n, p in params.items()}
        plus = _hvp(reference, {n: p + EPS * v[n] for n, p in wide.items()}, v, xs, ys)
        minus = _hvp(reference, {n: p - EPS * v[n] for n, p in wide.items()}, v, xs, ys)
        expected = torch.cat([((plus[n] - minus[n]) / (2 * EPS)).reshape(-1) for n in start])
        torch.testing.assert_close(work.terms[k].double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("cohort_size", [1, 5, 64, 65, 100, 200, 1000])
def test_term_passes_cover_the_cohort_in_few_equal_passes_of_similar_clients(cohort_size):
    """Each client in exactly one pass; ⌈K / TERM_CLIENTS_PER_PASS⌉ passes whose sizes differ by at most one;
    every client of a pass has at least as many term examples as any of a later pass (so each pass pads little)."""
    examples = np.random.default_rng(cohort_size).integers(1, 33, cohort_size).tolist()
    passes = CohortTrainer._term_passes(examples)
    assert sorted(torch.cat(passes).tolist()) == list(range(cohort_size))
    assert len(passes) == -(-cohort_size // cohort.TERM_CLIENTS_PER_PASS)
    sizes = [len(p) for p in passes]
    assert max(sizes) <= cohort.TERM_CLIENTS_PER_PASS and max(sizes) - min(sizes) <= 1
    for earlier, later in itertools.pairwise(passes):
        assert min(examples[k] for k in earlier.tolist()) >= max(examples[k] for k in later.tolist())
    padded = sum(len(p) * max(examples[k] for k in p.tolist()) for p in passes)
    unsorted = sum(len(c) * max(c) for c in np.array_split(np.asarray(examples), len(passes)))
    assert padded <= unsorted
