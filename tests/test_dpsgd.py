"""Record-level DP: local DP-SGD with Opacus (``fedhog.dpsgd``)."""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import sys
import types

import dp_accounting
import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy import stats as scipy_stats
from torch.func import functional_call, grad, vmap

from fedhog import dpsgd
from fedhog.config import ConfigError, RunConfig
from fedhog.data import ArrayData, load_digits
from fedhog.dpsgd import DpSgdSettings, lattice_noisy_sum, record_privacy, train_dpsgd
from fedhog.models import build_model
from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import SecureBits, SeededBits, sampler_log_ratio_bound

logging.getLogger("absl").setLevel(logging.ERROR)  # dp_accounting's dropped-RDP-order warnings

DELTA = 1e-5
ALPHA = 1e-9  # probability that a correct implementation fails one statistical check


@pytest.fixture(scope="module")
def digits() -> ArrayData:
    x, y = load_digits()
    return ArrayData(x[:100].astype(np.float64), y[:100])


def _model(name: str = "mlp", seed: int = 0, normalization: str = "none") -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(name, (1, 8, 8), 10, normalization=normalization).double()


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _settings(sigma: float = 1.0, clip: float = 1.0, accountant: str = "rdp", noise: str = "fedhog") -> DpSgdSettings:
    return DpSgdSettings(noise_multiplier=sigma, max_grad_norm=clip, delta=DELTA, accountant=accountant, noise=noise)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _lattice(sigma: float, clip: float, dimension: int) -> NoiseLattice:
    return NoiseLattice.for_settings(GaussianMechanism(clip, sigma), dimension)


def assert_std(samples: np.ndarray, std: float) -> None:
    """Two-sided chi-square test of the sample variance around a known zero mean, plus a z-test of the mean."""
    n = samples.size
    statistic = float(np.sum(samples.astype(np.float64) ** 2)) / std**2
    low, high = scipy_stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], n)
    assert low < statistic < high, f"sample std {np.sqrt(statistic / n) * std:.6g}, expected {std:.6g}"
    assert abs(float(np.mean(samples))) / (std / math.sqrt(n)) < scipy_stats.norm.isf(ALPHA / 2)


@pytest.mark.parametrize("name, normalization", [("mlp", "none"), ("cnn2d", "none"), ("mlp", "ws"),
                                                 ("cnn2d", "group-ws")])
def test_a_noiseless_step_moves_by_minus_lr_times_the_mean_clipped_per_example_gradient(digits, name, normalization):
    """Also through GroupNorm and weight-standardised layers: Opacus's per-example gradients are vmap's."""
    data = ArrayData(digits.x[:40], digits.y[:40])
    model = _model(name, normalization=normalization)
    start = _params(model)
    x, y = torch.as_tensor(data.x), torch.as_tensor(data.y)

    def loss_of_one(params, xi, yi):
        logits = functional_call(model, params, (xi.unsqueeze(0),))
        return torch.nn.functional.cross_entropy(logits, yi.unsqueeze(0))

    per_example = vmap(grad(loss_of_one), in_dims=(None, 0, 0))(start, x, y)
    norms = torch.sqrt(sum((g.reshape(len(x), -1) ** 2).sum(1) for g in per_example.values()))
    clip = float(norms.median())  # half of the examples are clipped
    factor = torch.clamp(clip / norms, max=1.0)
    assert (factor < 1).any() and (factor == 1).any()
    lr = 0.5
    expected = {k: start[k] - lr * (factor.view(-1, *[1] * (g.dim() - 1)) * g).mean(0)
                for k, g in per_example.items()}

    # batch_size = N: q = 1, so the one Poisson batch of the epoch holds every record
    local, privacy = train_dpsgd(model, data, 1, len(data), lr, 0.0, SeededBits(7), _settings(sigma=0.0, clip=clip))

    assert local.steps == 1 and privacy.steps == 1 and privacy.epsilon == math.inf
    unclipped_change = lr * per_example["features.0.weight" if name == "cnn2d" else "1.weight"].mean(0)
    for k, value in model.named_parameters():  # Opacus clips by C/(‖g‖ + 1e-6): equal to ~1e-6 relative
        change, expected_change = value.detach() - start[k], expected[k] - start[k]
        torch.testing.assert_close(change, expected_change, rtol=0, atol=1e-5 * float(expected_change.abs().max()))
    key = "features.0.weight" if name == "cnn2d" else "1.weight"
    assert not torch.allclose(start[key] - model.get_parameter(key).detach(), unclipped_change)


def test_no_example_moves_the_model_by_more_than_its_clipped_share(digits):
    """Make one record's gradient huge: with σ = 0 its effect on the step stays ≤ lr·(2C + g√d)/N."""
    data = ArrayData(digits.x[:20], digits.y[:20])
    poisoned = ArrayData(data.x.copy(), data.y.copy())
    poisoned.x[0] *= 1e4
    moved = {}
    for name, d in (("clean", data), ("poisoned", poisoned)):
        model = _model()
        train_dpsgd(model, d, 1, len(d), 1.0, 0.0, SeededBits(0), _settings(sigma=0.0, clip=0.1))
        moved[name] = _flat(model)
    # the step is −lr·(Σᵢ clip(gᵢ) rounded onto the lattice)/N; only record 0 differs, both of its clipped
    # gradients have norm ≤ C, and rounding moves each of the two sums by ≤ g√d/2
    slack = _lattice(0.0, 0.1, moved["clean"].numel()).rounding_slack
    assert torch.linalg.norm(moved["clean"] - moved["poisoned"]) <= 1.0 * (2 * 0.1 + 2 * slack) / len(data) + 1e-14


def test_a_step_adds_noise_of_std_sigma_times_c_plus_g_sqrt_d(digits):
    data = ArrayData(digits.x[:50], digits.y[:50])
    sigma, clip, lr = 2.0, 0.5, 0.1
    noiseless, noisy, again = _model(), _model(), _model()
    train_dpsgd(noiseless, data, 1, len(data), lr, 0.0, SeededBits(3), _settings(sigma=0.0, clip=clip))
    train_dpsgd(noisy, data, 1, len(data), lr, 0.0, SeededBits(3), _settings(sigma=sigma, clip=clip))
    train_dpsgd(again, data, 1, len(data), lr, 0.0, SeededBits(3), _settings(sigma=sigma, clip=clip))
    # one step over all N records (q = 1): θ_noiseless − θ_noisy = lr · noise / N (noise on the sum)
    noise = ((_flat(noiseless) - _flat(noisy)) * len(data) / lr).numpy()
    assert noise.size > 4000
    assert_std(noise, sigma * (clip + 2 * _lattice(sigma, clip, noise.size).rounding_slack))
    assert torch.equal(_flat(noisy), _flat(again))  # repeatable for a fixed seed


def test_chi_square_check_rejects_a_wrong_std():
    samples = np.random.default_rng(0).normal(0.0, 0.2, 4000)
    assert_std(samples, 0.2)
    for wrong in (0.2 * 1.25, 0.2 / 1.25, 0.1, 0.4):  # the check above is sharp enough for σC/2, 2σC, ...
        with pytest.raises(AssertionError):
            assert_std(samples, wrong)


@pytest.mark.parametrize("sigma, clip", [(1.0, 1.0), (0.7, 3.0), (4.0, 0.25)])
def test_lattice_noise_covers_the_rounding_of_both_neighbouring_sums(sigma, clip):
    dimension = 200_000
    summed = torch.linspace(-3, 3, dimension, dtype=torch.float64) * clip
    noisy, std = lattice_noisy_sum(summed, _settings(sigma, clip), SeededBits(11))
    lattice = _lattice(sigma, clip, dimension)
    # each of two neighbouring sums is rounded, each by ≤ g√d/2: the sensitivity is C + g√d, not C + g√d/2
    assert std == sigma * (clip + lattice.granularity * math.sqrt(dimension))
    steps = noisy / lattice.granularity
    assert torch.equal(steps, torch.round(steps))  # a lattice point: no floating-point residue of the sum
    clean = lattice.quantize(summed).to(torch.float64) * lattice.granularity
    assert_std((noisy - clean).numpy(), std)
    assert scipy_stats.kstest((noisy - clean).numpy() / std, "norm").pvalue > ALPHA  # Gaussian, not just its variance


class _NoBits:
    """RandomBits that fail the test when anything is drawn from them."""

    def words(self, count: int) -> np.ndarray:
        raise AssertionError(f"{count} words drawn from the fedhog bits")


def test_without_noise_the_release_is_the_sum_rounded_onto_the_lattice():
    summed = torch.randn(1000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    released, std = lattice_noisy_sum(summed, _settings(0.0, 1.0), _NoBits())
    assert std == 0.0
    assert float((released - summed).abs().max()) <= _lattice(0.0, 1.0, 1000).granularity / 2


def test_the_random_bits_drive_noise_and_poisson_sampling(digits):
    def run(bits, sigma: float, batch_size: int) -> tuple[float, torch.Tensor]:
        model = _model()  # reseeds torch's global generator: noise drawn from it would repeat
        local, _ = train_dpsgd(model, digits, 1, batch_size, 0.1, 0.0, bits, _settings(sigma=sigma))
        return local.mean_loss, _flat(model)

    # batch_size = N: q = 1, every record in every batch, so only the noise can differ
    noise = [run(bits, 1.0, len(digits)) for bits in (SeededBits(1), SeededBits(1), SeededBits(2))]
    assert torch.equal(noise[0][1], noise[1][1]) and not torch.equal(noise[0][1], noise[2][1])
    assert not torch.equal(run(SecureBits(), 1.0, len(digits))[1], run(SecureBits(), 1.0, len(digits))[1])
    # σ = 0: no noise, so only the Poisson batches can differ
    batches = [run(bits, 0.0, 10) for bits in (SeededBits(1), SeededBits(1), SeededBits(2))]
    assert batches[0][0] == batches[1][0] and torch.equal(batches[0][1], batches[1][1])
    assert batches[0][0] != batches[2][0]
    assert run(SecureBits(), 0.0, 10)[0] != run(SecureBits(), 0.0, 10)[0]


def test_poisson_batches_include_each_record_independently_with_probability_q():
    num_records, rate, steps = 50, 0.2, 4000
    batches = list(dpsgd._PoissonBatches(SeededBits(5), num_records, rate, steps))
    assert len(batches) == steps
    sizes = np.array([len(b) for b in batches])
    counts = np.bincount(np.concatenate(batches), minlength=num_records)
    # batch sizes ~ Binomial(N, q) (they vary: not a fixed-size shuffle); each record's count ~ Binomial(steps, q)
    for observed, trials, cells in ((sizes, num_records, steps), (counts, steps, num_records)):
        statistic = float(np.sum((observed - trials * rate) ** 2)) / (trials * rate * (1 - rate))
        low, high = scipy_stats.chi2.ppf([ALPHA / 2, 1 - ALPHA / 2], cells)
        assert low < statistic < high


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
def test_epsilon_is_opacus_accountant_of_the_poisson_subsampled_gaussian(digits, accountant):
    sigma, epochs, batch_size = 1.0, 2, 10  # q = 10/100, ⌊1/q⌋ = 10 steps an epoch
    _, privacy = train_dpsgd(_model(), digits, epochs, batch_size, 0.1, 0.0, SeededBits(0),
                             _settings(sigma, accountant=accountant))
    q, steps = batch_size / len(digits), epochs * 10
    assert privacy.steps == steps
    dimension = sum(p.numel() for p in _model().parameters())
    std_steps, _values = privacy.accountant_state["noise_values"]
    assert privacy.accountant_state == {"mechanism": accountant, "history": [[sigma, q, steps]],
                                        "noise_values": [std_steps, dimension]}
    assert 2.0**40 <= std_steps <= 2.0**42  # σ·(C + g√d)/g with g = 2^(⌊log2 σC⌋ − 40)

    independent = PRVAccountant() if accountant == "prv" else RDPAccountant()
    for _ in range(steps):
        independent.step(noise_multiplier=sigma, sample_rate=q)
    # plus the sampler's slack: 2·T·d·(η + 17/σ_ℤ²), the closed form of mechanism.sampler_slack's ε
    slack = 2 * steps * dimension * (sampler_log_ratio_bound() + 17 / std_steps**2)
    assert 0 < slack < 1e-6
    assert privacy.epsilon == pytest.approx(independent.get_epsilon(delta=DELTA) + slack, rel=1e-12)

    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    if accountant == "rdp":
        rdp = dp_accounting.rdp.RdpAccountant(orders=RDPAccountant.DEFAULT_ALPHAS)
        assert privacy.epsilon == pytest.approx(rdp.compose(event).get_epsilon(DELTA), rel=2e-3)
    else:  # PRV is an upper bound within eps_error = 0.01 of the tight PLD value
        pld = dp_accounting.pld.PLDAccountant().compose(event).get_epsilon(DELTA)
        assert pld - 0.005 <= privacy.epsilon <= pld + 0.03


def test_epsilon_accumulates_over_rounds_only_when_the_state_is_carried(digits):
    settings = _settings(accountant="rdp")
    model = _model()
    _, first = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, SeededBits(1), settings)
    carried = json.loads(json.dumps(first.accountant_state))  # as stored on the client's disk
    _, second = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, SeededBits(2), settings, carried)
    _, fresh = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, SeededBits(2), settings)

    assert second.steps == 2 * first.steps and second.epsilon > first.epsilon
    twice = RDPAccountant()
    for _ in range(second.steps):
        twice.step(noise_multiplier=1.0, sample_rate=0.1)
    std_steps, dimension = second.accountant_state["noise_values"]
    slack = 2 * second.steps * dimension * (sampler_log_ratio_bound() + 17 / std_steps**2)
    assert second.epsilon == pytest.approx(twice.get_epsilon(delta=DELTA) + slack, rel=1e-12)
    assert fresh.steps == first.steps and fresh.epsilon == pytest.approx(first.epsilon, rel=1e-12)
    assert record_privacy(settings, carried).epsilon == first.epsilon
    assert record_privacy(settings, None).epsilon == 0.0


def test_the_trained_model_is_the_plain_module_with_its_own_keys(digits):
    model = _model("cnn2d")
    keys, kind, global_state = list(model.state_dict()), type(model), copy.deepcopy(model.state_dict())
    original_attrs = {n: set(vars(p)) for n, p in model.named_parameters()}
    for round_seed in (0, 1):  # a second call must not find hooks of the first
        train_dpsgd(model, digits, 1, 16, 0.1, 0.9, SeededBits(round_seed), _settings())
    assert type(model) is kind and list(model.state_dict()) == keys
    assert not any(k.startswith("_module.") for k in model.state_dict())
    for module in model.modules():
        assert not (module._forward_hooks or module._backward_hooks or module._forward_pre_hooks)
        assert not hasattr(module, "autograd_grad_sample_hooks")
    for name, p in model.named_parameters():
        assert set(vars(p)) == original_attrs[name] and p.grad is None
    update = {k: v - global_state[k] for k, v in model.state_dict().items()}
    assert all(torch.isfinite(v).all() for v in update.values()) and any(v.abs().sum() > 0 for v in update.values())


def test_tiny_batches_take_noise_only_steps_on_empty_poisson_batches(digits):
    data = ArrayData(digits.x[:30], digits.y[:30])
    # q = 1/30: many empty batches
    local, privacy = train_dpsgd(_model(), data, 1, 1, 0.01, 0.0, SeededBits(5), _settings())
    assert local.steps == privacy.steps == 30 and math.isfinite(local.mean_loss)
    assert privacy.accountant_state["history"] == [[1.0, 1 / 30, 30]]


def test_a_client_without_records_trains_nothing_and_spends_nothing(digits):
    settings = _settings()
    _, before = train_dpsgd(_model(), digits, 1, 10, 0.1, 0.0, SeededBits(0), settings)
    model = _model()
    start = _params(model)
    empty = ArrayData(digits.x[:0], digits.y[:0])
    local, after = train_dpsgd(model, empty, 1, 10, 0.1, 0.0, _NoBits(), settings, before.accountant_state)
    assert local.steps == 0 and math.isnan(local.mean_loss)
    assert after.epsilon == before.epsilon and after.accountant_state == before.accountant_state
    assert all(torch.equal(p.detach(), start[k]) for k, p in model.named_parameters())
    assert train_dpsgd(model, empty, 1, 10, 0.1, 0.0, _NoBits(), settings)[1].epsilon == 0.0


@pytest.mark.parametrize("field, value", [
    ("noise_multiplier", -1.0), ("noise_multiplier", math.inf), ("max_grad_norm", 0.0),
    ("max_grad_norm", math.nan), ("delta", 0.0), ("delta", 1.0), ("accountant", "pld"), ("noise", "opacus"),
])
def test_bad_settings_are_rejected_by_name(field, value):
    kwargs = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": DELTA, field: value}
    with pytest.raises(ValueError, match=f"dpsgd: {field}="):
        DpSgdSettings(**kwargs)


@pytest.mark.parametrize("field, value", [
    ("epochs", 0), ("batch_size", 0), ("batch_size", 2.5), ("learning_rate", 0.0), ("momentum", -0.1),
    ("accountant_state", {"mechanism": "prv", "history": []}), ("accountant_state", {"history": [[1.0]]}),
])
def test_bad_training_arguments_are_rejected_by_name(digits, field, value):
    kwargs = {"epochs": 1, "batch_size": 10, "learning_rate": 0.1, "momentum": 0.0, field: value}
    with pytest.raises(ValueError, match=f"dpsgd: {field}="):
        train_dpsgd(_model(), digits, bits=SeededBits(0), settings=_settings(), **kwargs)


def test_a_sigma_too_small_for_the_samplers_analysis_is_refused(digits):
    # values are analysed within 20 std: with σ = 0.05 a neighbour's shift of 1/σ = 20 std leaves that window
    with pytest.raises(ValueError, match=r"dpsgd: noise_multiplier=0\.05 .* within 20 standard deviations"):
        train_dpsgd(_model(), digits, 1, 10, 0.1, 0.0, SeededBits(0), _settings(sigma=0.05))


def test_a_diverged_sum_is_refused_rather_than_rounded(digits):
    model = _model()
    with torch.no_grad():
        next(model.parameters()).fill_(math.nan)
    with pytest.raises(FloatingPointError, match="not finite"):
        train_dpsgd(model, digits, 1, 10, 0.1, 0.0, SeededBits(0), _settings())


def test_more_records_than_the_int64_lattice_sum_holds_are_refused(digits, monkeypatch):
    monkeypatch.setattr(dpsgd, "MAX_CONTRIBUTIONS", len(digits) - 1)
    with pytest.raises(ValueError, match=f"dpsgd: {len(digits)} records exceed the {len(digits) - 1}"):
        train_dpsgd(_model(), digits, 1, 10, 0.1, 0.0, SeededBits(0), _settings())


def test_opacus_secure_mode_needs_torchcsprng(digits, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchcsprng", None)  # `import torchcsprng` raises ImportError
    with pytest.raises(ImportError, match="dpsgd-noise='opacus-secure' needs the torchcsprng package"):
        train_dpsgd(_model(), digits, 1, 10, 0.1, 0.0, _NoBits(), _settings(noise="opacus-secure"))


def _stub_torchcsprng(seed: int, opened: list[str]) -> types.ModuleType:
    """A torchcsprng whose "random device" is a seeded torch.Generator, recording what it opened."""
    stub = types.ModuleType("torchcsprng")

    def create_random_device_generator(path: str) -> torch.Generator:
        opened.append(path)
        return torch.Generator().manual_seed(seed)

    stub.create_random_device_generator = create_random_device_generator
    return stub


def test_opacus_secure_mode_draws_noise_and_batches_from_torchcsprng(digits, monkeypatch):
    import opacus.optimizers.optimizer as opacus_optimizer

    noise_calls = []
    original = opacus_optimizer._generate_noise

    def spy(std, reference, generator=None, secure_mode=False):
        noise_calls.append((std, generator, secure_mode))
        return original(std, reference, generator=generator, secure_mode=secure_mode)

    monkeypatch.setattr(opacus_optimizer, "_generate_noise", spy)
    runs, opened = [], []
    for seed in (1, 1, 2):
        monkeypatch.setitem(sys.modules, "torchcsprng", _stub_torchcsprng(seed, opened))
        model = _model()
        local, privacy = train_dpsgd(model, digits, 1, 10, 0.1, 0.0, _NoBits(), _settings(sigma=0.5, clip=0.8,
                                                                                        noise="opacus-secure"))
        runs.append((local.mean_loss, _flat(model)))
    assert opened == ["/dev/urandom"] * 3
    assert noise_calls and all(std == 0.5 * 0.8 and secure for std, _, secure in noise_calls)
    assert len({id(generator) for _, generator, _ in noise_calls}) == 3  # one generator a run, the stub's
    assert privacy.steps == 10 and privacy.accountant_state["history"] == [[0.5, 0.1, 10]]
    # noise and batches come from the stub's generator alone: the same "device" output, the same run
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][0] != runs[2][0] and not torch.equal(runs[0][1], runs[2][1])


@pytest.mark.parametrize("value", ["opacus", "secure", ""])
def test_dpsgd_noise_is_a_validated_config_key(value):
    allowed = "expected one of fedhog, opacus-secure"
    with pytest.raises(ConfigError, match=re.escape(f"dpsgd-noise={value!r} is not allowed; {allowed}")):
        RunConfig().with_overrides({"dpsgd-noise": value})
    assert RunConfig().dpsgd_settings.noise == "fedhog"
    assert RunConfig().with_overrides({"dpsgd-noise": "opacus-secure"}).dpsgd_settings.noise == "opacus-secure"
