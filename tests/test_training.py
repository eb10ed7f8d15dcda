"""Local training: SGD and the third-order step size (`optimizer = hog-step`)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from fedhog.data import ArrayData, load_digits
from fedhog.derivatives import third_order_step_size
from fedhog.models import build_model
from fedhog.training import evaluate, hog_rows, local_batches, random_direction, train_locally, unit_direction


@pytest.fixture(scope="module")
def digits() -> ArrayData:
    x, y = load_digits()
    return ArrayData(x[:200], y[:200])


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model("mlp", (1, 8, 8), 10, activation="tanh").double()  # the figures below were set on tanh


def _double(data: ArrayData) -> ArrayData:
    return ArrayData(data.x.astype(np.float64), data.y)


def test_hog_step_moves_by_the_cubic_step_along_the_negative_gradient(digits):
    data = _double(digits)
    model = _model()
    before = copy.deepcopy(model)
    x, y = torch.as_tensor(data.x), torch.as_tensor(data.y)
    expected = third_order_step_size(before, x, y, max_step=5.0, fallback_step=1e-2)
    loss = torch.nn.functional.cross_entropy(before(x), y)
    grads = torch.autograd.grad(loss, list(before.parameters()))

    local = train_locally(model, data, epochs=1, batch_size=len(data), learning_rate=5.0,
                          momentum=0.0, seed=0, optimizer="hog-step")

    assert local.steps == 1 and local.cubic_steps == int(expected.reason == "cubic minimiser")
    assert 0 < expected.step <= 5.0
    for new, old, grad in zip(model.parameters(), before.parameters(), grads, strict=True):
        torch.testing.assert_close(new.detach(), old.detach() - expected.step * grad, rtol=1e-9, atol=1e-12)


def test_hog_step_reduces_the_training_loss(digits):
    model = _model(1)
    start, _ = evaluate(model.float(), digits)
    local = train_locally(model, digits, epochs=3, batch_size=50, learning_rate=3.0,
                          momentum=0.0, seed=0, optimizer="hog-step")
    end, _ = evaluate(model, digits)
    assert local.steps == 12
    assert end < start - 0.3


def test_sgd_shuffling_depends_on_the_seed_only(digits):
    results = []
    for seed in (3, 3, 4):
        model = _model().float()
        train_locally(model, digits, epochs=1, batch_size=16, learning_rate=0.1, momentum=0.9, seed=seed)
        results.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert torch.equal(results[0], results[1])
    assert not torch.equal(results[0], results[2])


def test_empty_client_trains_nothing():
    model = _model().float()
    local = train_locally(model, ArrayData(np.zeros((0, 1, 8, 8), np.float32), np.zeros(0, np.int64)),
                          epochs=2, batch_size=8, learning_rate=0.1, momentum=0.0, seed=0)
    assert local.steps == 0 and np.isnan(local.mean_loss)


def test_directions_are_unit_and_seeded():
    like = {"a": torch.zeros(3, 4), "b": torch.zeros(5)}
    v = random_direction(like, seed=9)
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in v.values()))
    assert norm.item() == pytest.approx(1.0, abs=1e-6)
    assert all(torch.equal(v[k], random_direction(like, seed=9)[k]) for k in like)
    assert not torch.equal(v["a"], random_direction(like, seed=10)["a"])
    assert unit_direction({k: torch.zeros_like(t) for k, t in like.items()}) is None
    scaled = unit_direction({k: 7 * t for k, t in v.items()})
    assert all(torch.allclose(scaled[k], v[k], atol=1e-6) for k in like)


@pytest.mark.parametrize("batch_size", [1, 3, 10, 32])
def test_local_batches_are_the_seeds_permutations_cut_as_numpy_array_split(batch_size):
    """The order every engine trains a client in: ⌈n/B⌉ nearly equal batches of each epoch's permutation."""
    for num_examples in range(70):
        seed = 1000 * batch_size + num_examples
        rng = np.random.default_rng(seed)
        expected = [np.array_split(rng.permutation(num_examples), max(1, -(-num_examples // batch_size)))
                    for _ in range(2)]
        got = local_batches(num_examples, 2, batch_size, seed)
        assert [[b.tolist() for b in epoch] for epoch in got] == [[b.tolist() for b in epoch] for epoch in expected]


def test_hog_rows_are_the_first_of_the_first_epochs_order():
    """A client's term examples: the first hog-batch-size of its seed's first permutation, which is also the order
    its first epoch trains in (the vectorized engine takes them from its step plan instead of drawing again)."""
    for num_examples in (0, 1, 7, 22, 40):
        for hog_batch_size in (1, 8, 32):
            seed = 31 * num_examples + hog_batch_size
            rows = hog_rows(num_examples, hog_batch_size, seed).tolist()
            assert rows == np.random.default_rng(seed).permutation(num_examples)[:hog_batch_size].tolist()
            assert rows == np.concatenate(local_batches(num_examples, 2, 10, seed)[0])[:hog_batch_size].tolist()
