"""Standard Flower ClientApps (weights under "arrays", "num-examples" in a MetricRecord, as Flower's
quickstart-pytorch writes them) work with SecureAggregator in a trusted-server mode, and are refused under secure
aggregation with a reason that says why."""

from __future__ import annotations

import logging

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fedhog.config import RunConfig
from fedhog.engines.inprocess import run_in_process
from fedhog.server_app import build_strategy
from fedhog.strategy import SECURE_NEEDS_FEDHOG_CLIENTS, WEIGHTS_UNDER_SECURE_AGGREGATION

POPULATION = 4


# --- a ClientApp written the way Flower's examples/quickstart-pytorch writes one ------------------------------
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def load_data(partition_id: int, num_partitions: int, batch_size: int) -> DataLoader:
    generator = torch.Generator().manual_seed(100 + partition_id)
    n = 20 + 10 * partition_id  # unequal partitions: the examples' counts weigh the average
    x = torch.randn(n, 8, generator=generator)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def train_fn(net: nn.Module, trainloader: DataLoader, epochs: int, lr: float, device: torch.device) -> float:
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for x, y in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


quickstart = ClientApp()


@quickstart.train()
def train(msg: Message, context: Context) -> Message:
    """Train the model on local data."""
    model = Net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    device = torch.device("cpu")
    model.to(device)
    partition_id = context.node_config["partition-id"]
    num_partitions = context.node_config["num-partitions"]
    trainloader = load_data(partition_id, num_partitions, batch_size=8)
    train_loss = train_fn(model, trainloader, 2, msg.content["config"]["lr"], device)
    model_record = ArrayRecord(model.state_dict())
    metrics = {"train_loss": train_loss, "num-examples": len(trainloader.dataset)}
    content = RecordDict({"arrays": model_record, "metrics": MetricRecord(metrics)})
    return Message(content=content, reply_to=msg)


# --- ServerApps: Flower's FedAvg, and the same app with SecureAggregator in its place -----------------------------
def _initial() -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(Net().state_dict())


def _fedavg(rounds: int) -> dict[str, torch.Tensor]:
    out: dict = {}
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0)
        result = strategy.start(grid=grid, initial_arrays=_initial(), train_config=ConfigRecord({"lr": 0.05}),
                                num_rounds=rounds)
        out["model"] = result.arrays.to_torch_state_dict()

    run_in_process(app, quickstart, POPULATION, {})
    return out["model"]


def _fedhog(rounds: int, client: ClientApp = quickstart, **keys) -> dict:
    out: dict = {"records": []}
    config = RunConfig.from_mapping({"population": POPULATION, "sampling": "fixed", "sampling-rate": 1.0,
                                     "delta": 1e-3, "privacy-seed": 3, **keys})
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        initial = _initial()
        strategy = build_strategy(config, sum(a.numel() for a in initial.to_torch_state_dict().values()))
        strategy.discover(grid, POPULATION, timeout=60, identify=False)  # no query handler: slots by node id
        result = strategy.start(grid, initial, num_rounds=rounds, train_config=ConfigRecord({"lr": 0.05}),
                                on_round=lambda record, arrays: out["records"].append(record))
        out["model"] = result.arrays.to_torch_state_dict()
        out["strategy"] = strategy

    run_in_process(app, client, POPULATION, {})
    return out


def test_without_noise_secure_aggregator_matches_flowers_fedavg_on_a_standard_clientapp():
    """An independent reference: Flower's own FedAvg over the same unchanged ClientApp."""
    reference = _fedavg(rounds=2)
    ours = _fedhog(2, mechanism="none", **{"noise-multiplier": 0.0})
    assert all(r.clients_accepted == POPULATION and not r.rejections for r in ours["records"])
    initial = _initial().to_torch_state_dict()
    for key, value in reference.items():
        assert not torch.allclose(value, initial[key])  # the clients did train
        torch.testing.assert_close(ours["model"][key], value, rtol=0, atol=1e-6)


def test_the_gaussian_mechanism_clips_standard_clients_updates_and_accounts():
    """σ = 0 and a tiny C: the model moves by exactly the mean of the clipped (weights − global), each of norm C."""
    clip = 1e-3
    ours = _fedhog(1, mechanism="gaussian", **{"noise-multiplier": 0.0, "clipping-norm": clip})
    reference = _fedavg(rounds=1)  # the clients' training does not depend on who aggregates
    initial = _initial().to_torch_state_dict()
    assert ours["records"][0].clients_accepted == POPULATION
    moved = torch.cat([(ours["model"][k] - initial[k]).reshape(-1) for k in initial]).double()
    assert moved.norm().item() <= clip + 1e-7  # the mean of K clipped updates, each of norm ≤ C
    assert moved.norm().item() > 0.5 * clip  # the updates (all long, mostly aligned) were used
    direction = torch.cat([(reference[k] - initial[k]).reshape(-1) for k in initial]).double()
    assert torch.nn.functional.cosine_similarity(moved, direction, dim=0) > 0.9

    noisy = _fedhog(2, mechanism="gaussian", **{"noise-multiplier": 1.0})
    epsilons = [r.epsilon for r in noisy["records"]]
    assert 0 < epsilons[0] < epsilons[1] < float("inf")
    assert all(r.clients_accepted == POPULATION for r in noisy["records"])


def test_hog_says_a_standard_clientapp_sends_no_third_order_term():
    ours = _fedhog(1, mechanism="hog", **{"noise-multiplier": 1.0})
    record = ours["records"][0]
    assert record.clients_accepted == 0 and record.failure  # withheld: nothing released
    assert "needs the third-order term" in ours["strategy"].rejection_reasons["malformed"]


def test_secure_aggregation_says_a_standard_clientapp_cannot_take_part():
    ours = _fedhog(1, mechanism="gaussian", **{"noise-multiplier": 1.0, "secure-aggregation": "secagg+"})
    record = ours["records"][0]
    assert record.clients_accepted == 0 and record.clients_rejected == POPULATION
    assert record.failure.startswith("secure aggregation failed") and SECURE_NEEDS_FEDHOG_CLIENTS in record.failure
    initial = _initial().to_torch_state_dict()
    assert all(torch.equal(ours["model"][k], initial[k]) for k in initial)


def test_a_reason_many_clients_share_is_logged_once_on_one_line(caplog):
    """Every standard client fails SecAgg+'s first stage with the same KeyError and a traceback of the client's
    files: the server's log says it once, on one line, and the round's record counts all of them."""
    with caplog.at_level(logging.WARNING, logger="flwr"):
        ours = _fedhog(1, mechanism="gaussian", **{"noise-multiplier": 1.0, "secure-aggregation": "secagg+"})
    rejected = [r.getMessage() for r in caplog.records if "rejected the result of" in r.getMessage()]
    assert len(rejected) == 1, rejected
    assert "KeyError: 'arrays'" in rejected[0] and "\n" not in rejected[0]
    assert "Traceback" not in caplog.text and "test_flower_clients.py" not in caplog.text
    assert ours["records"][0].clients_rejected == POPULATION


def test_secure_aggregation_refuses_a_reply_that_carries_weights():
    """A client that answers every message with its model (stage messages included) is dropped for that reason."""
    app = ClientApp()

    @app.train()
    def answer_with_weights(msg: Message, context: Context) -> Message:
        torch.manual_seed(int(context.node_config["partition-id"]))
        return Message(RecordDict({"arrays": ArrayRecord(Net().state_dict()),
                                   "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    ours = _fedhog(1, app, mechanism="gaussian", **{"noise-multiplier": 1.0, "secure-aggregation": "secagg+"})
    record = ours["records"][0]
    assert record.clients_accepted == 0 and record.failure.startswith("secure aggregation failed")
    refused = f"weights refused: {WEIGHTS_UNDER_SECURE_AGGREGATION}"
    assert ours["strategy"].rejection_reasons == {"weights refused": refused}


def test_fedhogs_clientapp_refuses_flowers_fedavg_in_one_line_and_the_model_stays(tmp_path):
    """Issue 35: FedAvg averaged fedhog's replies (updates) as weights, shrinking the model (norm 1.87 -> 0.47 in a
    round). Now each client refuses a train message without fedhog's instruction keys, in one line, and FedAvg
    skips aggregation: no model comes out of it."""
    from test_secure_aggregation import DroppingGrid

    from fedhog.client_app import app as fedhog_client_app
    from fedhog.data import dataset_info
    from fedhog.models import build_model

    config = RunConfig.from_mapping({"dataset": "digits", "model": "logreg", "population": 2, "sampling-rate": 0.5,
                                     "partitioner": "iid"})
    torch.manual_seed(0)
    initial = ArrayRecord(build_model(config.model, *dataset_info(config.data_spec)).state_dict())
    grid = DroppingGrid(fedhog_client_app, 2, config.to_mapping())
    for node in grid.contexts:
        grid.contexts[node].node_config["state-dir"] = str(tmp_path / "state")
    app = ServerApp()
    out: dict = {}

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        result = FedAvg(fraction_train=1.0, fraction_evaluate=0.0).start(
            grid=grid, initial_arrays=initial, train_config=ConfigRecord({"lr": 0.05}), num_rounds=1)
        out["model"] = result.arrays.to_torch_state_dict()

    app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    reasons = [reply.error.reason for reply in grid.replies]
    assert len(reasons) == 2 and all(r is not None for r in reasons)
    assert all(r.startswith("RoundRefused: the train message lacks 'job-id': it is not from the ServerApp of "
                            "aggregator='fedhog' (a stock Flower strategy such as FedAvg?)") and "\n" not in r
               for r in reasons)
    assert out["model"] == {}  # FedAvg aggregated nothing (it had averaged the updates into the model)
