"""Short federated runs through the in-process engine (the same Flower apps as `flwr run`)."""

from __future__ import annotations

import contextlib
import json
import math

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message
from flwr.clientapp import ClientApp
from helpers import read_metrics

from fedhog.client_app import app as fedhog_client_app
from fedhog.config import RunConfig
from fedhog.data import dataset_info, load_server_validation_set, load_test_set
from fedhog.engines.inprocess import run_in_process
from fedhog.models import build_model
from fedhog.server_app import app as server_app
from fedhog.training import evaluate

SMALL = {
    "dataset": "digits", "model": "logreg", "population": 10, "sampling-rate": 0.5,
    "rounds": 6, "local-epochs": 2, "learning-rate": 0.1, "clipping-norm": 2.0,
    "noise-multiplier": 0.3, "mechanism": "hog", "privacy-seed": 7, "partitioner": "iid",
}


pytestmark = pytest.mark.usefixtures("shared_cache")


def _run(tmp_path, client_app=fedhog_client_app, **overrides) -> dict:
    config = RunConfig().with_overrides({**SMALL, **overrides, "results-dir": str(tmp_path / "run")})
    run_in_process(server_app, client_app, config.population, config.to_mapping())
    return read_metrics(tmp_path / "run")


@pytest.mark.slow
def test_hog_run_learns_and_reports_epsilon(tmp_path):
    metrics = _run(tmp_path)
    rounds = metrics["rounds"]
    assert metrics["status"] == "finished"
    assert len(rounds) == SMALL["rounds"]
    assert rounds[-1]["accuracy"] > metrics["initial"]["accuracy"] + 0.2
    epsilons = [r["epsilon"] for r in rounds]
    assert all(0 < e < math.inf for e in epsilons)
    assert epsilons == sorted(epsilons)  # ε only grows
    assert all(r["third_order_failures"] == 0 and r["third_order_seconds_max"] > 0 for r in rounds)
    assert all(r["mean_mixing_ratio"] > 0 for r in rounds if r["clients_accepted"])
    # the saved model is the one evaluated in the last round
    config = RunConfig().with_overrides(SMALL)
    model = build_model(config.model, *dataset_info(config.data_spec))
    model.load_state_dict(torch.load(tmp_path / "run" / "final_model.pt"))
    assert evaluate(model, load_test_set(config.data_spec))[1] == pytest.approx(rounds[-1]["accuracy"])


@pytest.mark.slow
def test_server_validation_set_is_evaluated_every_round_apart_from_the_test_set(tmp_path):
    metrics = _run(tmp_path, rounds=2, **{"server-validation-fraction": 0.2})
    config = RunConfig().with_overrides({**SMALL, "server-validation-fraction": 0.2})
    model = build_model(config.model, *dataset_info(config.data_spec))
    model.load_state_dict(torch.load(tmp_path / "run" / "final_model.pt"))
    loss, accuracy = evaluate(model, load_server_validation_set(config.data_spec))
    last = metrics["rounds"][-1]
    assert (last["validation_loss"], last["validation_accuracy"]) == pytest.approx((loss, accuracy))
    assert last["accuracy"] == pytest.approx(evaluate(model, load_test_set(config.data_spec))[1])
    assert all(r["validation_accuracy"] is None for r in _run(tmp_path / "off", rounds=1)["rounds"])  # NaN -> null


@pytest.mark.slow
def test_server_step_scales_the_optimizer_step_within_its_bound(tmp_path):
    settings = {"proxy-fraction": 0.1, "server-step": "cubic", "server-step-max": 3.0}
    rounds = _run(tmp_path, rounds=2, **settings)["rounds"]
    assert all(0 <= r["server_step_scale"] <= 3.0 for r in rounds)
    assert any(r["server_step_scale"] not in (0.0, 1.0, 3.0) for r in rounds)  # an interior minimiser was taken
    assert all(r["server_step_scale"] is None for r in _run(tmp_path / "off", rounds=1)["rounds"])


@pytest.mark.slow
def test_fixed_privacy_seed_reproduces_the_run(tmp_path):
    first = _run(tmp_path / "a", rounds=2)
    second = _run(tmp_path / "b", rounds=2)
    assert [r["accuracy"] for r in first["rounds"]] == [r["accuracy"] for r in second["rounds"]]


@pytest.mark.slow
def test_a_seeded_runs_epsilon_is_labelled_void_and_its_seed_is_not_published(tmp_path):
    seed = 918_273_645_546_372_819
    metrics = _run(tmp_path, rounds=1, **{"privacy-seed": seed})
    assert metrics["config"]["privacy-seed"] == "withheld"
    assert "holds the config" in metrics["privacy"]["epsilon_void_against"]
    published = [path for path in (tmp_path / "run").iterdir() if path.name != "config.toml"]  # --resume's input
    for path in published:
        assert str(seed).encode() not in path.read_bytes(), path.name
    assert f"privacy-seed = {seed}" in (tmp_path / "run" / "config.toml").read_text()
    unseeded = _run(tmp_path / "os", rounds=1, **{"privacy-seed": -1})
    assert unseeded["config"]["privacy-seed"] == -1 and "epsilon_void_against" not in unseeded["privacy"]


def test_no_mechanism_reports_infinite_epsilon(tmp_path):
    metrics = _run(tmp_path, mechanism="none", rounds=2)
    assert metrics["summary"]["epsilon"] == "inf"
    assert metrics["privacy"]["has_guarantee"] is False


def test_zero_noise_with_clipping_reports_infinite_epsilon(tmp_path):
    metrics = _run(tmp_path, mechanism="gaussian", **{"noise-multiplier": 0.0}, rounds=1)
    assert metrics["summary"]["epsilon"] == "inf"


def _corrupting_client_app(bad_partitions: dict[int, str]) -> ClientApp:
    """fedhog's ClientApp, except that some partitions send a broken reply."""
    app = ClientApp()

    @app.query()
    def identify(msg: Message, context: Context) -> Message:
        return fedhog_client_app(msg, context)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        fault = bad_partitions.get(int(context.node_config["partition-id"]))
        if fault == "raise":
            raise RuntimeError("client crashed")
        reply = fedhog_client_app(msg, context)
        if fault == "nan":
            update = reply.content["update"].to_torch_state_dict()
            next(iter(update.values()))[0] = float("nan")
            reply.content["update"] = ArrayRecord(update)
        elif fault == "shape":
            update = reply.content["update"].to_torch_state_dict()
            key = next(iter(update))
            update[key] = torch.zeros(3)
            reply.content["update"] = ArrayRecord(update)
        elif fault == "missing":
            del reply.content["update"]
        return reply

    return app


def test_malformed_replies_are_dropped_and_the_run_completes(tmp_path):
    faults = {0: "nan", 1: "shape", 2: "missing", 3: "raise"}
    metrics = _run(tmp_path, client_app=_corrupting_client_app(faults), **{"sampling-rate": 1.0}, rounds=2)
    assert metrics["status"] == "finished"
    for record in metrics["rounds"]:
        assert record["clients_sampled"] == 10
        assert record["clients_rejected"] == 4
        assert record["clients_accepted"] == 6
        assert sum(record["rejections"].values()) == 4
    assert metrics["summary"]["epsilon"] != "inf"


@pytest.mark.slow
def test_max_epsilon_stops_before_the_release_that_would_exceed_it(tmp_path):
    reference = _run(tmp_path / "ref", rounds=4)
    budget = (reference["rounds"][1]["epsilon"] + reference["rounds"][2]["epsilon"]) / 2
    metrics = _run(tmp_path / "capped", rounds=4, **{"max-epsilon": budget})
    assert len(metrics["rounds"]) == 2
    assert metrics["summary"]["stopped_by_budget"] is True
    assert metrics["summary"]["epsilon"] <= budget


@pytest.mark.parametrize("privacy_seed", [-1, 3])  # without and with partition identification
def test_a_federation_smaller_than_the_population_is_a_clear_error(tmp_path, privacy_seed):
    config = RunConfig().with_overrides({**SMALL, "privacy-seed": privacy_seed, "results-dir": str(tmp_path / "run")})
    with pytest.raises(RuntimeError, match=r"population=10 but .*num-supernodes"):
        run_in_process(server_app, fedhog_client_app, 8, config.to_mapping())
    assert read_metrics(tmp_path / "run")["status"] == "failed"


def test_identification_keys_sampling_by_partition_id(tmp_path):
    """With a fixed privacy seed, the cohort is the same whatever node ids the engine assigns."""
    from fedhog.engines.inprocess import InProcessGrid
    from fedhog.server_app import build_strategy

    config = RunConfig().with_overrides({**SMALL, "privacy-seed": 5})
    cohorts = []
    for node_id_seed in (1, 2):
        grid = InProcessGrid(fedhog_client_app, config.population, config.to_mapping(), node_id_seed=node_id_seed)
        strategy = build_strategy(config)
        strategy.discover(grid, config.population, timeout=60, identify=True)
        assert sorted(strategy.slot_of_node.values()) == list(range(config.population))
        for node, slot in strategy.slot_of_node.items():
            assert grid.contexts[node].node_config["partition-id"] == slot
        messages = strategy.configure_train(1, ArrayRecord(), ConfigRecord(), grid)
        cohorts.append(sorted(strategy.slot_of_node[m.metadata.dst_node_id] for m in messages))
    assert cohorts[0] == cohorts[1]


def test_prometheus_endpoint_moves_during_a_run(tmp_path):
    """Scrape the server's endpoint while rounds run: counters climb, ε and accuracy appear."""
    import threading
    import time
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    config = RunConfig().with_overrides({**SMALL, "rounds": 4, "metrics-port": 0,
                                         "results-dir": str(tmp_path / "run")})
    runner = threading.Thread(target=run_in_process,
                              args=(server_app, fedhog_client_app, config.population, config.to_mapping()))
    runner.start()
    seen_rounds, url = [], None
    while runner.is_alive():
        if url is None:
            with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
                url = read_metrics(tmp_path / "run").get("metrics_url")
        if url:
            try:
                text = urllib.request.urlopen(url, timeout=5).read().decode()
            except OSError:  # the endpoint closes when the run ends
                break
            samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
            seen_rounds.append(samples["fedhog_rounds_total"])
            if samples["fedhog_rounds_total"] > 0:
                assert 0 < samples["fedhog_epsilon"] < math.inf
                assert 0 <= samples["fedhog_test_accuracy"] <= 1
                assert samples["fedhog_bytes_received_total"] > 0
                assert samples["fedhog_third_order_seconds_count"] >= samples["fedhog_rounds_total"]
        time.sleep(0.02)
    runner.join()
    assert seen_rounds == sorted(seen_rounds) and len(set(seen_rounds)) >= 2
    snapshot = (tmp_path / "run" / "metrics.prom").read_text()
    final = {s.name: s.value for f in text_string_to_metric_families(snapshot) for s in f.samples}
    assert final["fedhog_rounds_total"] == 4


@pytest.mark.slow
def test_adaptive_clipping_tracks_the_norms_and_keeps_the_accounted_sigma(tmp_path):
    fixed = _run(tmp_path / "fixed", rounds=6, **{"clipping-norm": 50.0})
    adaptive = _run(tmp_path / "adaptive", rounds=6, **{"clipping-norm": 50.0, "adaptive-clipping": True,
                                                         "count-noise-std": 1.0, "clipping-learning-rate": 0.5})
    norms = [r["clipping_norm"] for r in adaptive["rounds"]]
    assert norms[0] == 50.0 and norms[-1] < 50.0 * 0.5  # C far above every norm: b̃ ≈ 1 shrinks it
    assert all(math.isfinite(r["noisy_unclipped_fraction"]) for r in adaptive["rounds"])  # noisy: may leave [0, 1]
    # the accountant composes the overall σ, so ε is the same with or without adaptive clipping
    assert [r["epsilon"] for r in adaptive["rounds"]] == pytest.approx([r["epsilon"] for r in fixed["rounds"]])


@pytest.mark.slow
def test_dpsgd_clients_report_a_growing_record_level_epsilon(tmp_path):
    metrics = _run(tmp_path, rounds=2, mechanism="gaussian", **{"client-dp": "dpsgd", "sampling-rate": 1.0,
                                                                "dpsgd-noise-multiplier": 1.0})
    record_level = [r["sample_level_epsilon_max"] for r in metrics["rounds"]]
    assert all(0 < e < math.inf for e in record_level)
    assert record_level == sorted(record_level) and record_level[0] < record_level[-1]  # state carried per node
    assert metrics["rounds"][-1]["accuracy"] > metrics["initial"]["accuracy"]


@pytest.mark.slow
def test_target_epsilon_calibrates_sigma_and_is_met(tmp_path):
    metrics = _run(tmp_path, rounds=4, mechanism="gaussian", **{"target-epsilon": 3.0})
    assert metrics["privacy"]["target_epsilon"] == 3.0
    sigma = metrics["privacy"]["noise_multiplier"]
    assert 0 < sigma != RunConfig().noise_multiplier
    assert 2.9 < metrics["summary"]["epsilon"] <= 3.0  # the smallest σ that meets the target
    # the saved config reads back and calibrates to the same σ (what --resume does)
    from fedhog.config import load_config
    reloaded = load_config(tmp_path / "run" / "config.toml")
    assert reloaded.target_epsilon == 3.0 and reloaded.calibrated().noise_multiplier == pytest.approx(sigma)


def test_random_term_control_mixes_an_isotropic_direction(tmp_path):
    """hog-term = random: same mixing strength, no derivatives, a different (seeded) direction."""
    from fedhog.client_app import third_order_term
    from fedhog.data import load_client_data

    config = RunConfig().with_overrides({**SMALL, "hog-term": "random"})
    model = build_model(config.model, *dataset_info(config.data_spec))
    data, _ = load_client_data(config.data_spec, 0)
    update = {k: torch.zeros_like(p) for k, p in model.named_parameters()}
    term, finite, _ = third_order_term(model, data, update, config, seed=5)
    again, _, _ = third_order_term(model, data, update, config, seed=5)
    true_term, _, _ = third_order_term(model, data, update, config.with_overrides({"hog-term": "third-order"}), 5)
    flat = torch.cat([t.reshape(-1) for t in term.values()])
    assert finite and flat.norm().item() == pytest.approx(1.0, abs=1e-5)
    assert all(torch.equal(term[k], again[k]) for k in term)
    assert not all(torch.allclose(term[k], true_term[k]) for k in term)
    metrics = _run(tmp_path, rounds=2, **{"hog-term": "random"})
    assert metrics["status"] == "finished" and all(r["mean_mixing_ratio"] > 0 for r in metrics["rounds"])
