"""Server optimizers: the very updates of Flower's FedAvgM, FedAdam and FedYogi, and their state across resumes."""

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdam, FedAvgM, FedYogi
from helpers import read_run

from fedhog.engines.inprocess import InProcessGrid
from fedhog.server_optimizer import ServerOptimizer, ServerOptimizerSettings

pytestmark = pytest.mark.usefixtures("server_identity")
SHAPE = (3, 4)


def _flower(kind: str, eta: float, beta1: float, beta2: float, tau: float):
    if kind == "momentum":
        return FedAvgM(server_learning_rate=eta, server_momentum=beta1)
    cls = FedAdam if kind == "adam" else FedYogi
    return cls(eta=eta, beta_1=beta1, beta_2=beta2, tau=tau)


def _flower_round(strategy, server_round: int, model: np.ndarray, release: np.ndarray) -> np.ndarray:
    """Flower's strategy given one client whose weights are θ + ū (FedAvg of one: exactly θ + ū)."""
    current = ArrayRecord({"w": torch.from_numpy(model.copy())})  # what configure_train would keep
    strategy.current_arrays = current if isinstance(strategy, FedAvgM) else {"w": model.copy()}
    instruction = Message(RecordDict(), dst_node_id=7, message_type=MessageType.TRAIN)
    content = RecordDict({"arrays": ArrayRecord({"w": torch.from_numpy((model + release).astype(np.float32))}),
                          "metrics": MetricRecord({"num-examples": 1})})
    reply = InProcessGrid._transport(Message(content, reply_to=instruction))  # pylint: disable=protected-access
    arrays, _ = strategy.aggregate_train(server_round, [reply])
    return arrays["w"].numpy()


@pytest.mark.parametrize("kind", ["momentum", "adam", "yogi"])
def test_each_round_matches_flowers_strategy(kind):
    eta, beta1, beta2, tau = 0.3, 0.8, 0.95, 1e-2
    rng = np.random.default_rng(5)
    ours = ServerOptimizer(ServerOptimizerSettings(kind, eta, beta1, beta2, tau))
    flower = _flower(kind, eta, beta1, beta2, tau)
    model = rng.normal(size=SHAPE).astype(np.float32)
    for server_round in range(1, 8):
        release = (rng.normal(size=SHAPE) * 0.1).astype(np.float32)
        expected = _flower_round(flower, server_round, model, release)
        # ours works on the server's float32 model: the (θ + ū) − θ of Flower's FedAvg reply differs from ū by
        # float32 rounding only, which is the tolerance
        got = ours.step(torch.from_numpy(model.reshape(-1)), torch.from_numpy(release.reshape(-1)), server_round)
        np.testing.assert_allclose(got.numpy().reshape(SHAPE), expected, rtol=2e-5, atol=2e-6)
        model = expected.astype(np.float32)


def test_sgd_is_the_plain_server_step():
    ours = ServerOptimizer(ServerOptimizerSettings("sgd", learning_rate=2.5))
    model, release = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.25])
    assert torch.equal(ours.step(model, release, 1), torch.tensor([2.25, -1.375]))
    assert ours.state_dict() == {"first_moment": None, "second_moment": None}


def test_adam_hand_computed_first_step():
    # m = (1 − β₁)ū, v = (1 − β₂)ū², η_t = η·√(1 − β₂²)/(1 − β₁²) (Flower's exponent t + 1 = 2)
    eta, b1, b2, tau = 0.1, 0.9, 0.99, 1e-3
    ours = ServerOptimizer(ServerOptimizerSettings("adam", eta, b1, b2, tau))
    release = torch.tensor([0.2], dtype=torch.float64)
    got = ours.step(torch.zeros(1, dtype=torch.float64), release, 1)
    m, v = (1 - b1) * 0.2, (1 - b2) * 0.04
    expected = eta * np.sqrt(1 - b2**2) / (1 - b1**2) * m / (np.sqrt(v) + tau)
    assert float(got[0]) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("kind", ["momentum", "adam", "yogi"])
def test_state_round_trip_continues_identically(kind):
    settings = ServerOptimizerSettings(kind, 0.2, 0.7, 0.9, 1e-3)
    rng = np.random.default_rng(1)
    releases = [torch.from_numpy(rng.normal(size=6)) for _ in range(6)]
    whole, model = ServerOptimizer(settings), torch.zeros(6, dtype=torch.float64)
    for t, release in enumerate(releases, 1):
        model = whole.step(model, release, t)
    first, resumed_model = ServerOptimizer(settings), torch.zeros(6, dtype=torch.float64)
    for t, release in enumerate(releases[:3], 1):
        resumed_model = first.step(resumed_model, release, t)
    resumed = ServerOptimizer(settings)
    resumed.load_state_dict(first.state_dict())
    for t, release in enumerate(releases[3:], 4):
        resumed_model = resumed.step(resumed_model, release, t)
    assert torch.equal(resumed_model, model)


@pytest.mark.parametrize("field, value", [("kind", "lamb"), ("learning_rate", 0.0), ("momentum", 1.0),
                                          ("beta2", -0.1), ("tau", 0.0), ("learning_rate", float("inf"))])
def test_settings_reject_bad_values_by_name(field, value):
    with pytest.raises(ValueError, match=f"^{field}="):
        ServerOptimizerSettings(**{field: value})


@pytest.mark.slow
def test_a_run_with_fedadam_resumes_to_the_never_stopped_model(tmp_path, fresh_cache):
    """The optimizer's moments travel in the checkpoint: a resumed run ends with the never-stopped run's model."""

    from fedhog.client_app import app as client_app
    from fedhog.config import RunConfig
    from fedhog.engines.vectorized import run_vectorized
    from fedhog.server_app import app as server_app

    base = {"dataset": "digits", "model": "logreg", "population": 10, "sampling-rate": 0.5, "partitioner": "iid",
            "mechanism": "gaussian", "noise-multiplier": 0.5, "privacy-seed": 3, "server-optimizer": "adam",
            "server-learning-rate": 0.05}

    def run(folder, **overrides):
        config = RunConfig().with_overrides({**base, **overrides, "results-dir": str(tmp_path / folder)})
        run_vectorized(server_app, client_app, config)
        return read_run(tmp_path / folder)

    whole, model_whole = run("whole", rounds=4)
    run("stopped", rounds=2)
    resumed, model_resumed = run("stopped", rounds=4, resume=True)
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in whole["rounds"]]
    for key in model_whole:
        assert torch.equal(model_resumed[key], model_whole[key])
    _plain, model_plain = run("sgd", rounds=4, **{"server-optimizer": "sgd", "server-learning-rate": 1.0})
    assert any(not torch.equal(model_plain[k], model_whole[k]) for k in model_whole)  # adam really ran
