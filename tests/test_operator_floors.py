"""Operator floors: a SuperNode's ``node_config`` sets what every run must meet, whatever the run config says.

The run config is whoever submitted the run's; these tests submit weaker runs
than a node's floors allow and check that real ClientApps refuse them, naming
the floor and the value asked for (each was obeyed before the floors).
"""

from __future__ import annotations

import math
import uuid

import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import RdpAccountant
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common import MessageType
from test_release_ledger import SECURE, _model, _refusal, _secure_round
from test_secure_aggregation import DroppingGrid

from fedhog import protocol
from fedhog.client_app import app as client_app
from fedhog.client_state import state_dir
from fedhog.config import RunConfig
from fedhog.engines.inprocess import InProcessGrid
from fedhog.privacy.distributed_gaussian import ORDERS
from fedhog.secure_aggregation.floors import NodeConfigError, NodeFloors
from fedhog.secure_aggregation.ledger import ReleaseLedger, ledger_path
from fedhog.secure_aggregation.server import SecureAggregationFailed

pytestmark = pytest.mark.usefixtures("shared_cache")
RUN = RunConfig().with_overrides({
    "dataset": "digits", "model": "logreg", "population": 2, "sampling-rate": 0.5, "partitioner": "iid",
    "mechanism": "gaussian", "rounds": 4, "local-epochs": 1, "batch-size": 32, "noise-multiplier": 1.0})


def _grid(tmp_path, floors: dict, config: RunConfig = RUN, kind: type[InProcessGrid] = InProcessGrid):
    """Real ClientApps whose operator set ``floors``, each with this test's state dir, running ``config``'s run."""
    grid = kind(client_app, config.population, config.to_mapping())
    for node in grid.contexts:
        grid.contexts[node].node_config.update({"state-dir": str(tmp_path / "state"), **floors})
    return grid


def _train(grid: InProcessGrid, server_round: int, node: int | None = None) -> Message:
    node = sorted(grid.contexts)[0] if node is None else node
    config = ConfigRecord({protocol.SERVER_ROUND: server_round, protocol.JOB_ID: uuid.uuid4().hex})
    message = Message(RecordDict({"arrays": _model(RUN), "config": config}), dst_node_id=node,
                      message_type=MessageType.TRAIN)
    return next(iter(grid.send_and_receive([message])))


# --- validation ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("node_config, message", [
    ({"min-noise-multipler": 0.8}, r"unknown node config key 'min-noise-multipler' .*did you mean "
                                   r"'min-noise-multiplier'"),
    ({"max-epsilons": 3.0}, r"unknown node config key 'max-epsilons'.*did you mean 'max-epsilon'"),
    ({"min-clients": 3}, r"unknown node config key 'min-clients'.*fedhog's floors are min-noise-multiplier"),
    ({"min-noise-multiplier": -1.0}, r"min-noise-multiplier=-1.0 is not allowed; expected a finite number ≥ 0"),
    ({"min-noise-multiplier": "0.8"}, r"min-noise-multiplier='0.8' is not allowed"),
    ({"max-epsilon": 0}, r"max-epsilon=0 is not allowed; expected a number > 0"),
    ({"max-epsilon-delta": 1.0}, r"max-epsilon-delta=1.0 is not allowed; expected a number in \(0, 1\)"),
    ({"min-secagg-threshold": 1.5}, r"min-secagg-threshold=1.5 is not allowed; expected a number in \[0, 1\]"),
    ({"require-secure-aggregation": "yes"}, r"require-secure-aggregation='yes' is not allowed; expected true or "),
    ({"max-rounds": 2.5}, r"max-rounds=2.5 is not allowed; expected an integer ≥ 1"),
    ({"max-rounds": True}, r"max-rounds=True is not allowed"),
])
def test_a_bad_floor_is_refused_naming_key_value_and_what_is_allowed(node_config, message):
    with pytest.raises(NodeConfigError, match=message):
        NodeFloors.from_node_config({"partition-id": 0, **node_config})


def test_other_apps_node_config_keys_pass_and_floors_parse():
    floors = NodeFloors.from_node_config({"partition-id": 0, "num-partitions": 2, "dataset-path": "/data",
                                          "min-noise-multiplier": 1, "max-epsilon": math.inf, "max-rounds": 10,
                                          "require-secure-aggregation": True})
    assert floors == NodeFloors(min_noise_multiplier=1.0, max_rounds=10, require_secure_aggregation=True)


def test_a_client_with_a_bad_floor_says_so_in_one_line(tmp_path):
    reason = _refusal_of(_train(_grid(tmp_path, {"min-noise-multipler": 0.8}), 1))
    assert reason.startswith("NodeConfigError: unknown node config key 'min-noise-multipler'")


def _refusal_of(reply: Message) -> str:
    assert reply.has_error() and "\n" not in reply.error.reason and "Traceback" not in reply.error.reason
    return reply.error.reason


# --- each floor against a weaker run -------------------------------------------------------------------
@pytest.mark.parametrize("floors, weaker, refusal, meeting", [
    ({"min-noise-multiplier": 0.8}, {"noise-multiplier": 0.5},
     "min-noise-multiplier=0.8 (this node's floor): the run asks for noise multiplier 0.5", {}),
    ({"min-noise-multiplier": 0.8}, {"mechanism": "none", "noise-multiplier": 0.0},
     "min-noise-multiplier=0.8 (this node's floor): the run asks for noise multiplier 0", {}),
    ({"max-rounds": 3}, {"rounds": 1000000},
     "max-rounds=3 (this node's floor): the run asks for rounds=1000000", {"rounds": 3}),
    ({"require-secure-aggregation": True}, {},
     "require-secure-aggregation=true (this node's floor): the run asks for secure-aggregation=\"off\"", None),
    ({"max-epsilon": 100.0}, {"privacy-seed": 7},
     "the run fixes privacy-seed, so anyone with its config can subtract the noise", {}),
    ({"max-epsilon": 5.0}, {"mechanism": "none", "noise-multiplier": 0.0},
     "max-epsilon=5 (this node's floor): one more contribution would take this node's ε to inf", {}),
])
def test_a_run_below_a_floor_is_refused_naming_the_floor_and_the_value_asked(tmp_path, floors, weaker, refusal,
                                                                             meeting):
    assert refusal in _refusal(_train(_grid(tmp_path, floors, RUN.with_overrides(weaker)), 1))
    if meeting is not None:  # the same node serves a run that meets its floors
        assert not _train(_grid(tmp_path, floors, RUN.with_overrides(meeting)), 1).has_error()


def test_max_epsilon_bounds_everything_the_node_released_across_runs(tmp_path):
    """dp_accounting's RDP of n unamplified Gaussian releases: the node contributes while ε(n) ≤ max-epsilon, then
    refuses, and a new run does not reset what it released."""
    def reference(n: int) -> float:
        accountant = RdpAccountant(list(ORDERS))
        accountant.compose(dp_event.GaussianDpEvent(RUN.noise_multiplier), n)
        return accountant.get_epsilon(1e-5)

    limit = (reference(2) + reference(3)) / 2
    first = _grid(tmp_path, {"max-epsilon": limit})
    node = sorted(first.contexts)[0]
    assert not _train(first, 1, node).has_error() and not _train(first, 2, node).has_error()
    reason = _refusal(_train(first, 3, node))
    assert f"max-epsilon={limit:g} (this node's floor)" in reason
    assert f"take this node's ε to {reference(3):.4g} at δ=1e-05" in reason and "after 2 contributions" in reason
    assert "max-epsilon" in _refusal(_train(_grid(tmp_path, {"max-epsilon": limit}), 1, node))  # a new run


def test_a_secure_run_below_the_threshold_floor_is_refused_at_setup(tmp_path):
    grid = _grid(tmp_path, {"min-secagg-threshold": 0.9}, SECURE, DroppingGrid)
    with pytest.raises(SecureAggregationFailed, match="setup"):
        _secure_round(grid, 1)
    reasons = [_refusal(r) for r in grid.replies]
    assert len(reasons) == SECURE.population
    assert all("min-secagg-threshold=0.9 (this node's floor): the run asks for secagg-threshold=0.66" in r
               for r in reasons)


def test_distributed_noise_below_the_floor_is_refused_before_any_noise_leaves(tmp_path):
    """The clients compute their own σ_l: a floor above the plan's noise multiplier refuses at the collect stage,
    where the model's dimension fixes the plan, before any masked vector is sent."""
    plan = SECURE.distributed_noise(sum(int(a.numel()) for a in _model(SECURE).to_torch_state_dict().values()))
    grid = _grid(tmp_path, {"min-noise-multiplier": 1.5 * plan.noise_multiplier}, SECURE, DroppingGrid)
    with pytest.raises(SecureAggregationFailed, match="collect-masked-vectors"):
        _secure_round(grid, 1)
    refusals = [_refusal(r) for r in grid.replies if r.has_error()]
    assert len(refusals) == SECURE.population
    assert all(f"the run asks for noise multiplier {plan.noise_multiplier:.4g}" in r for r in refusals)
    assert not any(protocol.MASKED in r.content.array_records for r in grid.replies if not r.has_error())
    _secure_round(_grid(tmp_path, {"min-noise-multiplier": 0.5 * plan.noise_multiplier}, SECURE), 1)


def test_a_nodes_own_epsilon_for_distributed_noise_is_the_runs_ddg_accountants(tmp_path):
    """The same releases, counted by the client (its ledger) and by the run's ddg-rdp accountant: the same ε, the
    clients' sampler slack included in both."""
    grid = _grid(tmp_path, {"max-epsilon": 1e6, "max-epsilon-delta": SECURE.delta}, SECURE, DroppingGrid)
    _secure_round(grid, 1)
    _secure_round(grid, 2)
    plan = SECURE.distributed_noise(sum(int(a.numel()) for a in _model(SECURE).to_torch_state_dict().values()))
    accountant = plan.accountant()
    accountant.compose_round()
    accountant.compose_round()
    context = grid.contexts[sorted(grid.contexts)[0]]
    ledger = ReleaseLedger.load(ledger_path(state_dir(context.node_config), context.node_config["partition-id"]))
    assert [count for _, count in ledger.releases()] == [2]
    assert ledger.epsilon(SECURE.delta) == pytest.approx(accountant.epsilon(), rel=1e-12)
    assert accountant.sampler_slack(2).epsilon > 0


def test_a_node_calibrates_a_target_epsilon_run_once_and_accounts_the_calibrated_sigma(tmp_path, monkeypatch):
    """Each ClientApp message of a deployment is a fresh process: the σ a run's target-epsilon calibrates is computed
    once per node, kept in its state dir, and is what the ledger records and the floors compare."""
    from fedhog import client_app as module

    run = RUN.with_overrides({"target-epsilon": 5.0, "accountant": "rdp", "noise-multiplier": 1.0})
    sigma = run.calibrated().noise_multiplier
    grid = _grid(tmp_path, {"min-noise-multiplier": 0.9 * sigma}, run)
    node = sorted(grid.contexts)[0]
    assert not _train(grid, 1, node).has_error()
    module._calibrated_sigma.cache_clear()  # a fresh process
    monkeypatch.setattr(RunConfig, "calibrated", lambda self: pytest.fail("calibrated again"))
    assert not _train(grid, 2, node).has_error()
    context = grid.contexts[node]
    ledger = ReleaseLedger.load(ledger_path(state_dir(context.node_config), context.node_config["partition-id"]))
    [(release, count)] = ledger.releases()
    assert (release.mechanism, release.noise_multiplier, count) == ("gaussian", sigma, 2) and sigma != 1.0
    module._calibrated_sigma.cache_clear()
    stricter = _grid(tmp_path, {"min-noise-multiplier": 1.1 * sigma}, run)
    assert f"the run asks for noise multiplier {sigma:.4g}" in _refusal(_train(stricter, 1, node))
