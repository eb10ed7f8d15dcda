"""The client's release ledger: a malicious server replays rounds, asks beyond the run, restarts SecAgg+ sessions.

Each attack is played against fedhog's real ClientApp with hand-built
messages (in-process, the digits data and a logistic regression); each
succeeded on the code before the ledger (issue 36).
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import MessageType
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from test_secure_aggregation import DroppingGrid

from fedhog import protocol
from fedhog.client_app import app as client_app
from fedhog.client_state import state_dir
from fedhog.config import RunConfig
from fedhog.data import dataset_info
from fedhog.engines.inprocess import InProcessGrid
from fedhog.models import build_model
from fedhog.protocol import Rejection
from fedhog.replies import MessageRunner, TrainRequest
from fedhog.secure_aggregation.ledger import LedgerUntrusted, Release, ReleaseLedger, RoundRefused, ledger_path
from fedhog.secure_aggregation.server import SecAggSettings, SecureAggregationFailed, secure_sum

pytestmark = pytest.mark.usefixtures("shared_cache")
JOB = uuid.uuid4().hex
CONFIG = RunConfig().with_overrides({
    "dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 0.5, "partitioner": "iid",
    "mechanism": "gaussian", "rounds": 2, "local-epochs": 1, "batch-size": 32, "noise-multiplier": 1.0})
SECURE = CONFIG.with_overrides({"population": 4, "sampling": "fixed", "sampling-rate": 1.0,
                                "secure-aggregation": "secagg+", "noise": "distributed", "noise-multiplier": 0.5})


def _model(config: RunConfig) -> ArrayRecord:
    torch.manual_seed(0)
    return ArrayRecord(build_model(config.model, *dataset_info(config.data_spec)).state_dict())


def _instruction(server_round: int, job_id: str = JOB) -> ConfigRecord:
    return ConfigRecord({protocol.SERVER_ROUND: server_round, protocol.JOB_ID: job_id})


def _train(grid: InProcessGrid, node: int, server_round: int) -> Message:
    """One train instruction as fedhog's server sends it, answered by ``node``'s ClientApp."""
    message = Message(RecordDict({"arrays": _model(CONFIG), "config": _instruction(server_round)}),
                      dst_node_id=node, message_type=MessageType.TRAIN)
    return next(iter(grid.send_and_receive([message])))


def _refusal(reply: Message) -> str:
    assert reply.has_error(), "the client contributed"
    reason = reply.error.reason
    assert "\n" not in reason and "Traceback" not in reason and "File \"" not in reason, reason  # one line
    assert reason.startswith(("RoundRefused: ", "LedgerUntrusted: ")), reason
    return reason


def _grid(tmp_path, config: RunConfig = CONFIG, kind: type[InProcessGrid] = InProcessGrid) -> InProcessGrid:
    """Real ClientApps whose state dir (their ledgers) is this test's own (node config ``state-dir``)."""
    grid = kind(client_app, config.population, config.to_mapping())
    for node in grid.contexts:
        grid.contexts[node].node_config["state-dir"] = str(tmp_path / "state")
    return grid


@pytest.fixture
def grid(tmp_path) -> InProcessGrid:
    return _grid(tmp_path)


def _restart(grid: InProcessGrid, node: int) -> None:
    """Forget the node's in-memory state, as a restarted SuperNode or ClientApp process would (same run)."""
    grid.contexts[node] = type(grid.contexts[node])(
        run_id=grid.contexts[node].run_id, node_id=node, node_config=dict(grid.contexts[node].node_config),
        state=RecordDict(), run_config=dict(grid.contexts[node].run_config))


# --- trusted-server rounds ------------------------------------------------------------------------------
def test_a_replayed_round_is_refused_in_one_line(grid):
    node = next(iter(grid.contexts))
    assert not _train(grid, node, 1).has_error()
    assert "round 1 asked for again" in _refusal(_train(grid, node, 1))
    assert not _train(grid, node, 2).has_error()


def test_rounds_only_increase(grid):
    node = next(iter(grid.contexts))
    assert not _train(grid, node, 2).has_error()
    assert "contributed to round 2" in _refusal(_train(grid, node, 1))


@pytest.mark.parametrize("server_round", [3, 999])
def test_a_round_beyond_the_runs_rounds_is_refused(grid, server_round):
    assert f"round {server_round} is beyond this run's rounds=2" in _refusal(
        _train(grid, next(iter(grid.contexts)), server_round))


@pytest.mark.parametrize("server_round", [0, -1])
def test_a_round_that_is_no_round_number_is_refused(grid, server_round):
    assert "is not a round number" in _refusal(_train(grid, next(iter(grid.contexts)), server_round))


def test_the_ledger_survives_a_restarted_client_and_a_new_run_serves_its_own_rounds(grid, tmp_path):
    node = next(iter(grid.contexts))
    assert not _train(grid, node, 1).has_error()
    _restart(grid, node)  # the in-memory state is gone; the ledger on disk is not
    assert "round 1 asked for again" in _refusal(_train(grid, node, 1))
    another_run = _grid(tmp_path)  # the same node ids and state dir, a new run id
    assert not _train(another_run, node, 1).has_error()


def test_the_ledger_holds_round_numbers_and_public_noise_parameters_only(grid):
    node = next(iter(grid.contexts))
    context = grid.contexts[node]
    _train(grid, node, 1)
    _train(grid, node, 2)
    path = ledger_path(state_dir(context.node_config), context.node_config["partition-id"])
    document = json.loads(path.read_text())
    assert set(document) == {"version", "runs", "releases"}
    assert document["runs"] == {str(context.run_id): {"served": 2, "unmasked": 0}}
    # under Poisson sampling (add/remove) the accountant's σ is the config's; counted twice; nothing else
    assert document["releases"] == [{"mechanism": "gaussian", "noise_multiplier": 1.0, "local_std": 0.0,
                                     "shares": 0, "l2": 0.0, "dimension": 0, "draws": 0, "count": 2}]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # written atomically: no temporary left


@pytest.mark.parametrize("damage", ["truncated", "wrong version", "negative round", "a directory"])
def test_a_client_that_cannot_trust_its_ledger_refuses(grid, damage):
    node = next(iter(grid.contexts))
    context = grid.contexts[node]
    assert not _train(grid, node, 1).has_error()
    path = ledger_path(state_dir(context.node_config), context.node_config["partition-id"])
    document = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:20])
    elif damage == "wrong version":
        path.write_text(json.dumps({**document, "version": 99}))
    elif damage == "negative round":
        path.write_text(json.dumps({**document, "runs": {str(context.run_id): {"served": -5, "unmasked": 0}}}))
    else:
        path.unlink()
        path.mkdir()
    reason = _refusal(_train(grid, node, 2))
    assert reason.startswith("LedgerUntrusted: ") and str(path.parent) not in reason  # no path reaches the server


def test_the_ledger_refuses_before_anything_is_written(tmp_path):
    """check_round alone writes nothing: only a recorded contribution moves the ledger."""
    ledger = ReleaseLedger.load(tmp_path / "x.json")
    ledger.check_round(7, 1, 2)
    assert not ledger.path.exists()
    ledger.record(7, 1, Release("gaussian", noise_multiplier=1.0))
    with pytest.raises(RoundRefused, match="asked for again"):
        ReleaseLedger.load(ledger.path).check_round(7, 1, 2)
    ledger.path.write_text("[]")
    with pytest.raises(LedgerUntrusted):
        ReleaseLedger.load(ledger.path)


# --- SecAgg+: replayed sessions ------------------------------------------------------------------------
def _secure_round(grid: InProcessGrid, server_round: int) -> np.ndarray:
    """One secure sum of every node's contribution for ``server_round``, as fedhog's strategy runs it."""
    model = _model(SECURE)
    dimension = sum(int(np.prod(a.shape)) for a in model.values())
    lattice, noise = SECURE.secure_plan(dimension)
    settings = SecAggSettings(SECURE.secagg_num_shares, SECURE.secagg_threshold, lattice, SECURE.clipping_norm, noise)
    content = RecordDict({"arrays": model, "config": _instruction(server_round)})
    return secure_sum(grid, sorted(grid.contexts), content, dimension, settings, 10, str(server_round)).levels.numpy()


def test_a_replayed_secure_round_gets_no_second_noised_sum(tmp_path):
    """The issue's attack: the same round's secure sum run again unmasked a fresh noise draw each time."""
    grid = _grid(tmp_path, SECURE, DroppingGrid)
    _secure_round(grid, 1)
    grid.replies.clear()
    with pytest.raises(SecureAggregationFailed, match="setup"):
        _secure_round(grid, 1)
    reasons = [_refusal(r) for r in grid.replies]
    assert len(reasons) == SECURE.population and all("round 1 asked for again" in r for r in reasons)
    assert not any(protocol.MASKED in r.content.array_records for r in grid.replies if not r.has_error())
    _secure_round(grid, 2)  # the next round is served


def _stage(grid: InProcessGrid, node: int, stage: str, server_round: int | None, **configs) -> Message:
    content = RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({Key.STAGE: stage, **configs})})
    if server_round is not None:
        content["config"] = _instruction(server_round)
    return next(iter(grid.send_and_receive([Message(content, dst_node_id=node, message_type=MessageType.TRAIN)])))


def test_a_replayed_unmask_request_is_refused_by_the_ledger(tmp_path):
    grid = _grid(tmp_path, SECURE, DroppingGrid)
    _secure_round(grid, 1)
    node = sorted(grid.contexts)[0]
    reason = _refusal(_stage(grid, node, Stage.UNMASK, 1, **{Key.ACTIVE_NODE_ID_LIST: sorted(grid.contexts),
                                                             Key.DEAD_NODE_ID_LIST: []}))
    assert "unmask request for round 1 asked for again" in reason


def test_a_setup_that_names_no_round_is_refused(tmp_path):
    grid = _grid(tmp_path, SECURE)
    node = sorted(grid.contexts)[0]
    setup = {Key.SAMPLE_NUMBER: 4, Key.SHARE_NUMBER: 4, Key.THRESHOLD: 3, Key.CLIPPING_RANGE: 1.0,
             Key.TARGET_RANGE: 2**20, Key.MOD_RANGE: 2**32, Key.MAX_WEIGHT: 1.0}
    assert "names no round" in _refusal(_stage(grid, node, Stage.SETUP, None, **setup))
    assert "beyond this run's rounds=2" in _refusal(_stage(grid, node, Stage.SETUP, 5, **setup))


def test_a_secure_aggregation_client_refuses_a_train_message_in_the_clear(tmp_path):
    """The server asks a secagg+ client for its update in a plain train message: it answered before the ledger."""
    grid = _grid(tmp_path, SECURE)
    node = sorted(grid.contexts)[0]
    message = Message(RecordDict({"arrays": _model(SECURE), "config": _instruction(1)}), dst_node_id=node,
                      message_type=MessageType.TRAIN)
    reply = next(iter(grid.send_and_receive([message])))
    assert "through SecAgg+ only, never in the clear" in _refusal(reply)


# --- replies matched to the round's instruction ----------------------------------------------------------
class StaleGrid(InProcessGrid):
    """A Grid (or a relay in front of one) that hands round 1's replies back as round 2's."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.first: list[Message] | None = None

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(super().send_and_receive(messages, timeout=timeout))
        if self.first is None:
            self.first = replies
        return self.first


def test_a_reply_to_another_rounds_instruction_is_refused(tmp_path):
    grid = _grid(tmp_path, kind=StaleGrid)
    cohort = {node: slot for slot, node in enumerate(sorted(grid.contexts)[:2])}

    def request(server_round: int) -> TrainRequest:
        return TrainRequest(server_round, _model(CONFIG), _instruction(server_round), cohort, False, 10)

    first = MessageRunner(grid).train(request(1))
    assert len(first.results) == 2 and not first.refused
    second = MessageRunner(grid).train(request(2))  # the clients answered round 2; round 1's replies came back
    assert not second.results
    assert [error.kind for _, error in second.refused] == [Rejection.WRONG_ROUND] * 2


def test_a_collect_stage_for_another_round_than_the_setups_is_refused(tmp_path):
    """The setup named round 1; the server then sends the model of round 2 to be masked: the client refuses, so its
    contribution to a round is only ever the one its setup admitted."""
    grid = _grid(tmp_path, SECURE, DroppingGrid)
    model = _model(SECURE)
    dimension = sum(int(np.prod(a.shape)) for a in model.values())
    lattice, noise = SECURE.secure_plan(dimension)
    settings = SecAggSettings(SECURE.secagg_num_shares, SECURE.secagg_threshold, lattice, SECURE.clipping_norm, noise)

    class Switching:  # forwards the stages, but the collect stage carries another round's instruction
        def send_and_receive(self, messages, *, timeout=None):
            for message in messages:
                if message.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] == Stage.COLLECT_MASKED_VECTORS:
                    message.content["config"] = _instruction(2)
            return grid.send_and_receive(messages, timeout=timeout)

    content = RecordDict({"arrays": model, "config": _instruction(1)})
    with pytest.raises(SecureAggregationFailed, match="collect-masked-vectors"):
        secure_sum(Switching(), sorted(grid.contexts), content, dimension, settings, 10, "1")
    reasons = [_refusal(r) for r in grid.replies if r.has_error()]
    assert len(reasons) == SECURE.population
    assert all("the stage asks for round 2; this client's SecAgg+ setup was for round 1" in r for r in reasons)
