"""The vectorized engine trains a cohort as one batch and gives the in-process engine's results.

Tolerance: the two engines run the same arithmetic in a different order inside
torch's kernels (a batched matmul against one per client), so updates agree to
float32 reassociation (1e-6 absolute on these models), every round's ε and
cohort exactly, and every round's test accuracy to within one test example.
"""

from __future__ import annotations

import logging

import pytest
import torch
from helpers import read_run

from fedhog.client_app import app as client_app
from fedhog.client_app import third_order_term
from fedhog.config import RunConfig
from fedhog.data import dataset_info, load_client_data, load_test_set, population_training_data
from fedhog.engines.cohort import CohortTrainer, HogSettings
from fedhog.engines.inprocess import InProcessGrid, run_in_process
from fedhog.engines.vectorized import VectorizedGrid, run_vectorized, unbatchable_reason
from fedhog.models import build_model
from fedhog.replies import MessageRunner, runner_for
from fedhog.server_app import app as server_app
from fedhog.training import direction_seed, train_locally

SMALL = {"dataset": "digits", "model": "mlp", "population": 10, "sampling-rate": 0.5, "rounds": 3,
         "partitioner": "dirichlet", "local-epochs": 2, "batch-size": 8, "learning-rate": 0.1, "momentum": 0.5,
         "clipping-norm": 1.0, "noise-multiplier": 0.5, "mechanism": "gaussian", "privacy-seed": 7}


pytestmark = pytest.mark.usefixtures("shared_cache")


def _config(**overrides) -> RunConfig:
    return RunConfig().with_overrides({**SMALL, **overrides})


# --- the cohort's local work equals each client's own -----------------------------------------


def _trainer(config: RunConfig) -> CohortTrainer:
    x, y, indices = population_training_data(config.data_spec)
    return CohortTrainer(_model(config), x, y, indices,
                         torch.device("cpu"))


def _model(config: RunConfig) -> torch.nn.Module:
    return build_model(config.model, *dataset_info(config.data_spec), config.activation, config.normalization)


def _global_state(config: RunConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    return _model(config).state_dict()


@pytest.mark.parametrize("model, momentum, epochs, normalization", [
    ("mlp", 0.9, 2, "none"), ("cnn2d", 0.0, 1, "none"), ("logreg", 0.5, 3, "none"), ("mlp", 0.5, 1, "group"),
    ("cnn2d", 0.0, 1, "group-ws")])
def test_a_cohort_trains_each_client_exactly_as_the_client_loop(model, momentum, epochs, normalization):
    """Uneven clients (Dirichlet): every client takes its own steps, momentum included, nothing more."""
    config = _config(model=model, momentum=momentum, normalization=normalization, **{"local-epochs": epochs})
    trainer, start = _trainer(config), _global_state(config)
    partitions = [0, 3, 4, 7, 9]
    seeds = [direction_seed(config.seed, 2, p) for p in partitions]
    work = trainer.train(start, partitions, seeds, epochs, config.batch_size, config.learning_rate, momentum)
    sizes = [len(load_client_data(config.data_spec, p)[0]) for p in partitions]
    assert len(set(sizes)) > 1  # the cohort really is uneven
    for k, (partition, seed) in enumerate(zip(partitions, seeds, strict=True)):
        alone = _model(config)
        alone.load_state_dict(start)
        local = train_locally(alone, load_client_data(config.data_spec, partition)[0], epochs, config.batch_size,
                              config.learning_rate, momentum, seed)
        expected = torch.cat([(alone.state_dict()[key] - start[key]).reshape(-1) for key in start])
        # GroupNorm divides by a group's std: the batched and the single float32 forward round apart by ~3e-6
        atol = 1e-6 if normalization == "none" else 1e-5
        torch.testing.assert_close(work.updates[k], expected, rtol=1e-5, atol=atol)
        assert work.steps[k] == local.steps
        assert work.mean_losses[k] == pytest.approx(local.mean_loss, rel=1e-5)


@pytest.mark.parametrize("direction, term, normalization", [
    ("random", "third-order", "none"), ("update", "third-order", "none"), ("random", "random", "none"),
    ("random", "third-order", "group-ws"), ("update", "third-order", "ws")])
def test_a_cohorts_third_order_terms_are_each_clients(direction, term, normalization):
    """The cohort's batched Taylor mode (vmap over clients) against the client's own derivative engine."""
    config = _config(mechanism="hog", normalization=normalization,
                     **{"hog-direction": direction, "hog-term": term, "hog-batch-size": 16})
    trainer, start = _trainer(config), _global_state(config)
    partitions, seeds = [1, 2, 8], [11, 12, 13]
    work = trainer.train(start, partitions, seeds, config.local_epochs, config.batch_size, config.learning_rate,
                         config.momentum, HogSettings(direction, term, config.hog_batch_size))
    assert work.terms is not None and all(work.term_finite)
    for k, (partition, seed) in enumerate(zip(partitions, seeds, strict=True)):
        model = _model(config)
        model.load_state_dict(start)
        update = dict(zip(start, torch.split(work.updates[k], [v.numel() for v in start.values()]), strict=True))
        update = {key: value.reshape(start[key].shape) for key, value in update.items()}
        expected, finite, _ = third_order_term(model, load_client_data(config.data_spec, partition)[0], update,
                                               config, seed)
        flat = torch.cat([expected[key].reshape(-1) for key in start])
        assert finite
        scale = float(flat.abs().max())
        torch.testing.assert_close(work.terms[k], flat, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("model, samples, term", [
    ("mlp", 1, "third-order"), ("mlp", 3, "third-order"), ("mlp", 2, "random"),
    pytest.param("cnn2d", 2, "third-order", marks=pytest.mark.slow)])
def test_a_cohorts_noise_aware_terms_are_each_clients(model, samples, term):
    """Noise-aware mixing: each client's λ_i ĝ_i, its Hutchinson estimate of ∇tr∇²L over its own Rademacher
    directions (vmapped inside the vmap over clients) scaled by its local steps, as the ClientApp computes it."""
    from fedhog.privacy.noise_aware import local_step_scale

    config = _config(model=model, mechanism="hog", momentum=0.5,
                     **{"hog-mixing": "noise-aware", "noise-aware-samples": samples, "hog-term": term,
                        "hog-batch-size": 16})
    trainer, start = _trainer(config), _global_state(config)
    partitions, seeds = [1, 2, 8], [11, 12, 13]
    work = trainer.train(start, partitions, seeds, config.local_epochs, config.batch_size, config.learning_rate,
                         config.momentum, HogSettings("random", term, config.hog_batch_size, "noise-aware", samples))
    assert work.terms is not None and all(work.term_finite)
    for k, (partition, seed) in enumerate(zip(partitions, seeds, strict=True)):
        alone = _model(config)
        alone.load_state_dict(start)
        estimate, finite, _ = third_order_term(alone, load_client_data(config.data_spec, partition)[0], {}, config,
                                               seed)
        scale = local_step_scale(config.learning_rate, work.steps[k], config.momentum)
        flat = torch.cat([estimate[key].reshape(-1) for key in start]) * scale
        assert finite and scale > 0
        torch.testing.assert_close(work.terms[k], flat, rtol=1e-4, atol=1e-5 * float(flat.abs().max()))


# --- whole runs: the vectorized and in-process engines agree ---------------------------------


def _run(engine: str, tmp_path, **overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    config = _config(**overrides, **{"results-dir": str(tmp_path / engine)})
    if engine == "vectorized":
        run_vectorized(server_app, client_app, config)
    else:
        run_in_process(server_app, client_app, config.population, config.to_mapping())
    return read_run(tmp_path / engine)


CONFIGS = {
    "none": {"mechanism": "none"},
    "gaussian-poisson": {},
    "gaussian-fixed": {"sampling": "fixed"},
    "hog-random": {"mechanism": "hog"},
    "hog-update": {"mechanism": "hog", "hog-direction": "update"},
    "hog-control": {"mechanism": "hog", "hog-term": "random"},
    "hog-noise-aware": {"mechanism": "hog", "hog-mixing": "noise-aware", "noise-aware-samples": 2,
                        "server-optimizer": "momentum"},
    "adaptive-clipping": {"adaptive-clipping": True, "count-noise-std": 1.0},
    # the CNN rows train one local epoch: the batched convolutions and their Taylor mode are the point, not the steps
    "cnn-silu-hog-fixed": {"model": "cnn2d", "activation": "silu", "mechanism": "hog", "sampling": "fixed",
                           "momentum": 0.0, "local-epochs": 1},
    "tanh-as-before": {"activation": "tanh"},  # the rows above run the default activation (gelu)
    "cnn-group-ws-hog": {"model": "cnn2d", "normalization": "group-ws", "mechanism": "hog", "momentum": 0.0,
                         "local-epochs": 1},
    "ws": {"normalization": "ws"},
    "softplus-hog-update": {"activation": "softplus", "mechanism": "hog", "hog-direction": "update"},
    "flower-dp": {"aggregator": "flower-dp", "sampling": "fixed", "accountant": "rdp", "server-learning-rate": 2.0},
}


SMOKE = "hog-random"  # the fast tier's whole run of both engines; CI compares every row


@pytest.mark.parametrize("name", [pytest.param(name, marks=() if name == SMOKE else pytest.mark.slow)
                                  for name in CONFIGS])
def test_vectorized_and_in_process_runs_agree(tmp_path, name):
    # two rounds: the second starts from the first's release (server optimizer, adaptive C, accountant)
    overrides = {"rounds": 2, **CONFIGS[name]}
    vectorized, model_v = _run("vectorized", tmp_path, **overrides)
    in_process, model_i = _run("inprocess", tmp_path, **overrides)
    assert len(in_process["rounds"]) == 2
    one_example = 1 / len(load_test_set(_config().data_spec))
    assert vectorized["status"] == in_process["status"] == "finished"
    for v, i in zip(vectorized["rounds"], in_process["rounds"], strict=True):
        for key in ("clients_sampled", "clients_accepted", "clients_rejected", "bytes_received"):
            assert v[key] == i[key], key
        assert v["epsilon"] == i["epsilon"]
        assert v["accuracy"] == pytest.approx(i["accuracy"], abs=one_example + 1e-12)
        for key in ("mean_norm_before_clip", "train_loss", "clipping_norm", "noisy_unclipped_fraction"):
            if isinstance(i[key], float):
                assert v[key] == pytest.approx(i[key], rel=1e-5, abs=1e-6), key
        assert v["fraction_clipped"] == i["fraction_clipped"]
        assert (v["mean_mixing_ratio"] is None) == (i["mean_mixing_ratio"] is None)
    for key in model_i:
        torch.testing.assert_close(model_v[key], model_i[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_what_cannot_be_batched_runs_client_by_client(tmp_path, caplog):
    config = {"client-dp": "dpsgd", "rounds": 2, "local-epochs": 1}
    assert "Opacus" in unbatchable_reason(_config(**config))
    assert unbatchable_reason(_config()) is None
    assert unbatchable_reason(_config(**CONFIGS["flower-dp"])) is None  # its train messages train as one batch
    with caplog.at_level(logging.WARNING):
        vectorized, model_v = _run("vectorized", tmp_path, **config)
    assert "run one by one" in caplog.text
    in_process, model_i = _run("inprocess", tmp_path, **config)
    assert [r["accuracy"] for r in vectorized["rounds"]] == [r["accuracy"] for r in in_process["rounds"]]
    for key in model_i:
        assert torch.equal(model_v[key], model_i[key])  # the very same per-client path


def test_the_vectorized_grid_offers_its_own_cohort_runner_and_answers_discovery():
    config = _config()
    grid = VectorizedGrid(client_app, config)
    assert runner_for(grid) is grid.cohort_runner
    assert isinstance(runner_for(InProcessGrid(client_app, 2, config.to_mapping())), MessageRunner)
    assert sorted(grid.partition_of_node.values()) == list(range(config.population))


@pytest.mark.slow
def test_a_round_that_samples_nobody_releases_the_same_noise_on_both_engines(tmp_path):
    # N = 10 at q = 0.1: a round samples nobody with probability 0.35. C = 0.1 keeps the noise std σC/K small:
    # a model drowned in noise (σC/K = 0.5 a coordinate) amplifies float32 reassociation past any tolerance
    overrides = {"sampling-rate": 0.1, "rounds": 6, "clipping-norm": 0.1}
    (vectorized, v_model), (in_process, p_model) = (_run(engine, tmp_path, **overrides)
                                                    for engine in ("vectorized", "inprocess"))
    assert 0 in [r["clients_sampled"] for r in vectorized["rounds"]]
    assert [r["epsilon"] for r in vectorized["rounds"]] == [r["epsilon"] for r in in_process["rounds"]]
    for key, value in p_model.items():
        torch.testing.assert_close(v_model[key], value, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_vectorized_run_resumes_to_the_never_stopped_result(tmp_path):
    whole, model_whole = _run("vectorized", tmp_path / "whole", rounds=2)
    _run("vectorized", tmp_path / "stopped", rounds=1)
    resumed, model_resumed = _run("vectorized", tmp_path / "stopped", rounds=2, resume=True)
    assert resumed["resumed_after_round"] == 1 and len(resumed["rounds"]) == 2
    assert [r["epsilon"] for r in resumed["rounds"]] == [r["epsilon"] for r in whole["rounds"]]
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in whole["rounds"]]
    for key in model_whole:
        assert torch.equal(model_resumed[key], model_whole[key])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_and_cpu_agree(tmp_path):
    cuda, model_cuda = _run("vectorized", tmp_path / "cuda", device="cuda", mechanism="hog")
    cpu, model_cpu = _run("vectorized", tmp_path / "cpu", device="cpu", mechanism="hog")
    assert [r["epsilon"] for r in cuda["rounds"]] == [r["epsilon"] for r in cpu["rounds"]]
    for key in model_cpu:
        torch.testing.assert_close(model_cuda[key], model_cpu[key], rtol=1e-4, atol=1e-5)


def test_sweeps_use_the_vectorized_engine_unless_told_otherwise(tmp_path):
    from fedhog.sweep.spec import SweepError, load_sweep

    path = tmp_path / "sweep.toml"
    body = 'output = "out"\n[base]\ndataset = "digits"\npopulation = 10\nsampling-rate = 0.5\n[grid]\nseed = [0]\n'
    path.write_text(body)
    assert load_sweep(path).engine == "vectorized"
    path.write_text('engine = "inprocess"\n' + body)
    assert load_sweep(path).engine == "inprocess"
    path.write_text('engine = "warp"\n' + body)
    with pytest.raises(SweepError, match="engine='warp' is not allowed; expected one of vectorized, inprocess"):
        load_sweep(path)


def test_a_term_is_keyed_like_the_update_so_models_with_buffers_keep_theirs():
    """The update is keyed by state_dict (buffers included), the term by named_parameters: the reply
    must carry the term under the update's keys, or the server rejects every term of such a model."""
    from fedhog.replies import term_keyed_like

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    update = {k: torch.ones_like(v, dtype=torch.float32) for k, v in model.state_dict().items()}
    term = {k: torch.full_like(p, 2.0) for k, p in model.named_parameters()}
    keyed = term_keyed_like(term, update)
    assert list(keyed) == list(update)  # the server compares key lists in order
    assert set(update) - set(term) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert all(torch.equal(keyed[k], term[k]) for k in term)
    assert all(not keyed[k].any() and keyed[k].shape == update[k].shape for k in set(update) - set(term))
