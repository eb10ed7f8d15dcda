"""fedhog on a CUDA device against the CPU: derivatives, the cohort's local work, a round's hot path, the noise.

Each test is parametrised by device. The ``cuda`` cases are marked ``gpu`` and skipped where
``torch.cuda.is_available()`` is false (``simulations/gpu/check.sh`` runs them on a GPU machine); the ``cpu``
cases run the same assertions here (a float32 CPU computation against the float64 CPU reference, or the CPU
against itself), so the tests' own logic is proven where there is no GPU: the cheap ones in the fast tier, the
derivatives, the cohort and the whole round (seconds on this CPU) marked ``slow``. TF32 is switched off inside
the tests: they check the kernels' float32 results, not TensorFloat-32's 10-bit products.
"""

from __future__ import annotations

import json
import sys
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from fedhog import derivatives
from fedhog.config import RunConfig
from fedhog.data import DataSpec, _partition, clients_training_data
from fedhog.engines.cohort import CohortTrainer, HogSettings
from fedhog.models import build_model
from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import SeededBits
from fedhog.training import direction_seed, random_direction

CUDA = torch.cuda.is_available()
ON_CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="no CUDA device")])
DEVICES = ["cpu", ON_CUDA]
DEVICES_SLOW_ON_CPU = [pytest.param("cpu", marks=pytest.mark.slow), ON_CUDA]  # the CPU case takes seconds here


@pytest.fixture(autouse=True)
def _no_tf32() -> Iterator[None]:
    """Full float32 matrix products and convolutions on CUDA while a test runs (torch's defaults restored after)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _relative_error(value: dict[str, torch.Tensor] | torch.Tensor,
                    reference: dict[str, torch.Tensor] | torch.Tensor) -> float:
    """‖value − reference‖ / ‖reference‖ over all entries, in float64 on the CPU."""
    if isinstance(value, dict) and isinstance(reference, dict):
        assert value.keys() == reference.keys()
        value = torch.cat([value[k].reshape(-1) for k in reference])
        reference = torch.cat([reference[k].reshape(-1) for k in reference])
    assert isinstance(value, torch.Tensor) and isinstance(reference, torch.Tensor)
    value, reference = value.detach().cpu().double(), reference.detach().cpu().double()
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference))


# --- the derivative engine -------------------------------------------------------------------------------------------

def _small_model(name: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A GELU MLP (12 features) or the 1-D CNN (one channel of 40), 5 classes, and a batch of 8, seeded."""
    torch.manual_seed(3)
    shape = (12,) if name == "mlp" else (1, 40)
    model = build_model(name, shape, 5, "gelu")
    return model, torch.randn(8, *shape), torch.randint(0, 5, (8,))


@pytest.mark.parametrize("device", DEVICES_SLOW_ON_CPU)
@pytest.mark.parametrize("name", ["mlp", "cnn1d"])
def test_derivatives_on_the_device_match_the_float64_cpu_reference(device: str, name: str) -> None:
    """Gradient, HVP, third-order vector (Taylor mode, float32, on ``device``) and the order-5 directional
    derivatives against nested torch.func in float64 on the CPU (an independent formulation and precision)."""
    model, x, y = _small_model(name)
    reference = model.double()
    direction = random_direction(dict(reference.named_parameters()), 11)
    x64 = x.double()
    expected = {
        "gradient": derivatives.gradient(reference, x64, y, method="torch.func").vector,
        "hvp": derivatives.hessian_vector_product(reference, x64, y, direction, method="torch.func").vector,
        "third": derivatives.third_order_vector(reference, x64, y, direction, method="torch.func").vector,
        "order5": derivatives.directional_derivatives(reference, x64, y, direction, order=5,
                                                      method="torch.func").values,
    }
    on_device = model.float().to(device)
    v = {k: t.float().to(device) for k, t in direction.items()}
    xd, yd = x.to(device), y.to(device)
    got = {
        "gradient": derivatives.gradient(on_device, xd, yd),
        "hvp": derivatives.hessian_vector_product(on_device, xd, yd, v),
        "third": derivatives.third_order_vector(on_device, xd, yd, v),
        "order5": derivatives.directional_derivatives(on_device, xd, yd, v, order=5),
    }
    assert all(r.finite for r in got.values()) and got["gradient"].method == "autograd"  # the engine's own routes
    assert all(got[q].method == "taylor" for q in ("hvp", "third", "order5"))
    assert all(t.device.type == device for r in got.values() for t in (r.vector or {"values": r.values}).values()
               if t is not None)
    for quantity in ("gradient", "hvp", "third"):
        assert _relative_error(got[quantity].vector, expected[quantity]) < 2e-5, quantity  # float32: ~2e-7 here
    values, reference_values = got["order5"].values, expected["order5"]
    assert values.shape == (6,)
    scale = reference_values.abs().clamp_min(1e-3)  # derivatives near zero: absolute error against 1e-3
    assert ((values.cpu().double() - reference_values).abs() / scale).max() < 2e-4


# --- the vectorized engine's cohort ----------------------------------------------------------------------------------

SPEC = DataSpec(dataset="synthetic-large", population=1000)


def _trainer(model_name: str, device: str, dtype: torch.dtype, partitions: list[int]) -> CohortTrainer:
    """A cohort trainer of these synthetic-large clients on ``device``, the model and data in ``dtype``."""
    x, y, indices = clients_training_data(SPEC, partitions)
    torch.manual_seed(5)
    model = build_model(model_name, (60,), 10, "gelu").to(dtype)
    return CohortTrainer(model, x.astype(np.float64) if dtype == torch.float64 else x, y, indices,
                         torch.device(device))


def _cohort_work(trainer: CohortTrainer, clients: int, hog: HogSettings | None, dtype: torch.dtype = torch.float32):
    state = {k: v.detach().clone().to(dtype) for k, v in trainer.model.state_dict().items()}
    seeds = [direction_seed(0, 1, p) for p in range(clients)]
    return trainer.train(state, list(range(clients)), seeds, 1, 10, 0.05, 0.5, hog)


@pytest.mark.parametrize("device", DEVICES_SLOW_ON_CPU)
@pytest.mark.parametrize("model_name, hog", [("mlp", None), ("mlp", HogSettings("update", "third-order", 8)),
                                             ("cnn1d", HogSettings("random", "third-order", 8))])
def test_the_cohorts_work_on_the_device_matches_float64_on_the_cpu(device: str, model_name: str,
                                                                  hog: HogSettings | None) -> None:
    """Every client's update and third-order term (float32, on ``device``) against the same cohort trained in
    float64 on the CPU: the same steps, examples and directions, so they differ by float32 rounding alone."""
    partitions = list(range(6))
    work = _cohort_work(_trainer(model_name, device, torch.float32, partitions), 6, hog)
    reference = _cohort_work(_trainer(model_name, "cpu", torch.float64, partitions), 6, hog, torch.float64)
    assert work.updates.device.type == "cpu" and work.updates.dtype == torch.float32  # handed back to the mechanism
    assert work.steps == reference.steps
    for k in range(6):
        assert _relative_error(work.updates[k], reference.updates[k]) < 2e-5  # ~6e-7 on this CPU
    if hog is not None:
        assert work.terms is not None and reference.terms is not None and all(work.term_finite)
        for k in range(6):
            assert _relative_error(work.terms[k], reference.terms[k]) < 2e-4
    assert np.allclose(work.mean_losses, reference.mean_losses, rtol=1e-5)


SYNCING = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def _syncs() -> Iterator[Counter[str]]:
    """Count the calls that read a tensor's values back to Python or the host (each a device synchronisation on
    CUDA), and on CUDA also the synchronisations torch's sync debug mode reports."""
    counts: Counter[str] = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def counting(name: str):
        method = saved[name]

        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return method(self, *args, **kwargs)

        return wrapper

    for name in SYNCING:
        setattr(torch.Tensor, name, counting(name))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if CUDA:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield counts
            finally:
                if CUDA:
                    torch.cuda.set_sync_debug_mode("default")
        counts["cuda-sync"] = sum("synchroniz" in str(w.message) for w in caught)
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hog", [None, HogSettings("random", "third-order", 8),
                                 HogSettings("update", "third-order", 8)], ids=["gaussian", "hog-random", "hog-update"])
def test_the_cohorts_work_synchronises_per_round_not_per_client(device: str, hog: HogSettings | None) -> None:
    """A cohort of 12 reads values back from the device exactly as often as a cohort of 3 (a few times a block:
    losses, updates, which terms are finite), however many clients it trains."""
    trainer = _trainer("mlp", device, torch.float32, list(range(12)))
    _cohort_work(trainer, 3, hog)  # warm: kernels chosen, nothing lazily initialised inside the counts
    counted = []
    for clients in (3, 12):
        with _syncs() as counts:
            _cohort_work(trainer, clients, hog)
        counted.append(counts)
    assert counted[0] == counted[1]  # the counts and, on CUDA, the synchronisations torch saw
    assert sum(n for name, n in counted[0].items() if name != "cuda-sync") <= 8  # a few a block, none a step


# --- the privacy noise -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_the_lattice_noise_is_the_cpu_streams_bits_whatever_the_device(device: str) -> None:
    """The release g·(S + n) of a lattice sum S held on ``device``: n is the integer noise that the same private
    stream gives on the CPU, bit for bit, on the same lattice (so its law is the one the accountant assumes)."""
    mechanism = GaussianMechanism(clipping_norm=1.0, noise_multiplier=1.1)
    lattice = NoiseLattice.for_settings(mechanism, 1000)
    total = torch.randint(-2**40, 2**40, (1000,), dtype=torch.int64, generator=torch.Generator().manual_seed(2))
    released, std = mechanism.add_noise(total.to(device), lattice, SeededBits(9, (4,)), 30)
    expected, expected_std = mechanism.add_noise(total, lattice, SeededBits(9, (4,)), 30)
    assert std == expected_std
    noise = torch.round(released.cpu() / lattice.granularity).to(torch.int64) - total
    assert torch.equal(noise, torch.round(expected / lattice.granularity).to(torch.int64) - total)
    assert torch.equal(released.cpu(), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_the_lattice_sum_of_contributions_on_the_device_is_the_cpus(device: str) -> None:
    """Contributions held on ``device`` (inside the clipping ball, so none is rescaled): the mechanism's exact int64
    lattice sum is the CPU's, bit for bit, for DP-FedAvg and HOG (whose ξ meet the terms on the device)."""
    from fedhog.privacy.mechanism import Contribution, HogMechanism

    generator = torch.Generator().manual_seed(8)
    rows = torch.randn(5, 300, generator=generator)
    rows = rows / torch.linalg.vector_norm(rows, dim=1, keepdim=True) * 0.3  # well inside C = 1
    terms = torch.randn(5, 300, generator=generator)
    xis = [0.0] * 5  # ξ = 0: HOG mixes nothing in, and the rows stay exact
    for mechanism in (GaussianMechanism(1.0, 1.1), HogMechanism(1.0, 1.1, mixing_strength=0.5)):
        lattice = NoiseLattice.for_settings(mechanism, 300)
        on_device = [Contribution(r.to(device), term=t.to(device)) for r, t in zip(rows, terms, strict=True)]
        on_cpu = [Contribution(r, term=t) for r, t in zip(rows, terms, strict=True)]
        total, _ = mechanism.sum_on_lattice(on_device, xis, lattice)
        expected, _ = mechanism.sum_on_lattice(on_cpu, xis, lattice)
        assert total.device.type == device and torch.equal(total.cpu(), expected)


# --- a whole round: the same cohort, ε and noise on the device as on the CPU ------------------------------------------

def _run_round(device: str, folder: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[dict, list, list]:
    """Two rounds of a seeded HOG run on the vectorized engine: metrics, each round's cohort, each round's noise."""
    from fedhog.client_app import app as client_app
    from fedhog.engines.vectorized import VectorizedRunner, run_vectorized
    from fedhog.server_app import app as server_app

    cohorts: list[list[tuple[int, int]]] = []
    noises: list[torch.Tensor] = []
    reduce, add_noise = VectorizedRunner.reduce, GaussianMechanism.add_noise

    def recording_reduce(self, request, plan):
        cohorts.append(sorted(request.cohort.items()))
        return reduce(self, request, plan)

    def recording_noise(self, lattice_sum, lattice, bits, contributors):
        released, std = add_noise(self, lattice_sum, lattice, bits, contributors)
        noises.append(torch.round(released.cpu() / lattice.granularity).to(torch.int64) - lattice_sum.cpu())
        return released, std

    config = RunConfig().with_overrides({
        "dataset": "synthetic-large", "population": 200, "sampling-rate": 0.05, "model": "mlp", "rounds": 2,
        "mechanism": "hog", "noise-multiplier": 1.0, "delta": 1e-4, "privacy-seed": 12, "device": device,
        "results-dir": str(folder)})
    with monkeypatch.context() as patch:
        patch.setattr(VectorizedRunner, "reduce", recording_reduce)
        patch.setattr(GaussianMechanism, "add_noise", recording_noise)
        run_vectorized(server_app, client_app, config)
    metrics = json.loads((folder / "metrics.json").read_text())
    return metrics, cohorts, noises


@pytest.mark.parametrize("device", DEVICES_SLOW_ON_CPU)
def test_a_seeded_round_on_the_device_releases_what_the_cpu_does(device: str, tmp_path: Path, fresh_cache: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The same privacy-seed on ``device`` and on the CPU: the same cohorts, ε after every round exactly, the same
    integer noise bit for bit, and a final model within float32 rounding of the CPU's."""
    metrics, cohorts, noises = _run_round(device, tmp_path / device, monkeypatch)
    reference, reference_cohorts, reference_noises = _run_round("cpu", tmp_path / "reference", monkeypatch)
    assert metrics["config"]["device"] == device and metrics["status"] == "finished"
    assert cohorts == reference_cohorts and all(cohorts)
    assert [r["epsilon"] for r in metrics["rounds"]] == [r["epsilon"] for r in reference["rounds"]]
    assert len(noises) == 2 and all(torch.equal(a, b) for a, b in zip(noises, reference_noises, strict=True))
    model = torch.load(tmp_path / device / "final_model.pt")
    reference_model = torch.load(tmp_path / "reference" / "final_model.pt")
    assert _relative_error(model, reference_model) < 1e-4


# --- what the GPU machine needs: partitions without flwr-datasets -----------------------------------------------------

def test_a_cached_partition_is_the_partitioners_bits_and_needs_no_flwr_datasets(
        fresh_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Dirichlet partition is cached under $FEDHOG_CACHE; read back where datasets and flwr-datasets cannot be
    imported (as on the GPU machine, whose wheelhouse has neither), it is the same parts, bit for bit."""
    pytest.importorskip("flwr_datasets", reason="the partition is flwr-datasets' to compute")
    labels = np.random.default_rng(4).integers(0, 10, 600)
    spec = DataSpec(population=20, partitioner="dirichlet", dirichlet_alpha=0.5)
    parts = _partition(labels, spec)
    assert len(list(fresh_cache.glob("partition-*.npz"))) == 1
    for name in ("datasets", "flwr_datasets", "flwr_datasets.partitioner"):
        monkeypatch.setitem(sys.modules, name, None)  # importing them now raises ImportError
    monkeypatch.setattr("fedhog.data._flwr_datasets_version", lambda: None)
    cached = _partition(labels, spec)
    assert len(cached) == len(parts) and all(a.dtype == np.int64 and np.array_equal(a, b)
                                             for a, b in zip(cached, parts, strict=True))
    with pytest.raises(ImportError):  # another partition is not in the cache: it needs the partitioner
        _partition(labels, DataSpec(population=20, partitioner="dirichlet", dirichlet_alpha=0.3))


def test_a_partition_cached_by_another_flwr_datasets_is_partitioned_again(fresh_cache: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Parts written by another flwr-datasets version than the installed one are not trusted: partitioned anew."""
    pytest.importorskip("flwr_datasets", reason="the partition is flwr-datasets' to compute")
    labels = np.random.default_rng(5).integers(0, 10, 300)
    spec = DataSpec(population=10, partitioner="iid")
    monkeypatch.setattr("fedhog.data._flwr_datasets_version", lambda: "0.0.1")
    _partition(labels, spec)
    monkeypatch.undo()
    monkeypatch.setenv("FEDHOG_CACHE", str(fresh_cache))
    calls: list[tuple] = []
    import fedhog.data as data_module

    original = data_module._partition_with_flwr_datasets

    def counted(*args):
        calls.append(args)
        return original(*args)

    monkeypatch.setattr(data_module, "_partition_with_flwr_datasets", counted)
    _partition(labels, spec)
    assert len(calls) == 1
    _partition(labels, spec)  # now cached by the installed version
    assert len(calls) == 1


# --- the check's verdicts (simulations/gpu/summarize.py) --------------------------------------------------------------

def test_the_checks_summary_flags_a_device_that_spends_another_epsilon_or_learns_another_model() -> None:
    """The seeded quickstart on the device against the CPU: the same ε after every round and an accuracy within
    the tolerance pass; an ε that differs anywhere, or accuracy beyond the tolerance, is flagged."""
    from helpers import load_simulation

    summarize = load_simulation("gpu/summarize")
    cpu = {"accuracy": 0.70, "epsilons": [1.0, 2.0], "clients_sampled": [480, 510], "command_seconds": 60.0}
    same = {**cpu, "accuracy": 0.70 + summarize.ACCURACY_TOLERANCE / 2, "command_seconds": 20.0}
    verdict = summarize.compare_quickstarts(same, cpu)
    assert verdict["same_epsilon_exactly"] and verdict["same_cohort_sizes"] and verdict["accuracy_within_tolerance"]
    assert verdict["speedup_whole_command"] == 3.0
    assert not summarize.compare_quickstarts({**same, "epsilons": [1.0, 2.0000000001]}, cpu)["same_epsilon_exactly"]
    drifted = {**same, "accuracy": 0.70 - 2 * summarize.ACCURACY_TOLERANCE}
    assert not summarize.compare_quickstarts(drifted, cpu)["accuracy_within_tolerance"]
    rows = [{"device": d, "population": 1_000_000, "model": "mlp", "mechanism": "gaussian", "seconds_per_round": s,
             "peak_gpu_mib": m} for d, s, m in (("cuda", 1.425, 900.0), ("cpu", 14.25, None))]
    rounds = summarize.rounds_figures({"rows": [*rows, {"device": "cpu", "population": 1000, "model": "cnn1d",
                                                        "mechanism": "hog", "skipped": "no budget left"}]}, "cuda")
    assert rounds["speedups"] == [{"population": 1_000_000, "model": "mlp", "mechanism": "gaussian",
                                   "speedup_over_cpu": 10.0}]
    assert rounds["million_mlp_gaussian"]["speedup_over_the_2_core_cpu"] == summarize.TWO_CORE_MILLION_SECONDS / 1.425
    assert len(rounds["skipped"]) == 1
