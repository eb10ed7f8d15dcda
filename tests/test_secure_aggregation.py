"""Secure aggregation (SecAgg+): the server learns only the sum, survives dropouts up to the threshold.

Tests assert on what reaches the server (every reply the Grid hands back),
against exact integer sums, and against the trusted mode's release.
"""

from __future__ import annotations

import base64
import math
import re

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Key, Stage
from helpers import read_metrics

from fedhog import protocol
from fedhog.client_app import app as fedhog_client_app
from fedhog.config import ConfigError, RunConfig
from fedhog.engines.inprocess import InProcessGrid
from fedhog.engines.vectorized import unbatchable_reason
from fedhog.privacy.mechanism import GaussianMechanism
from fedhog.privacy.randomness import SeededBits
from fedhog.secure_aggregation.client import ClientGuard, SecAggPlusState, handle_stage
from fedhog.secure_aggregation.quantization import ModularLattice
from fedhog.secure_aggregation.server import SecAggSettings, SecureAggregationFailed, secure_sum, small_cohort_delta
from fedhog.server_app import app as server_app

pytestmark = pytest.mark.usefixtures("shared_cache")
DIMENSION = 3000
CLIP = 2.0


class DroppingGrid(InProcessGrid):
    """An in-process Grid whose nodes stop answering from stage ``drop_at`` on; it keeps every reply.

    The nodes of partitions ``drop`` drop out, or the first ``drop_count`` nodes the stage goes to.
    """

    def __init__(self, *args, drop_at: str | None = None, drop: tuple[int, ...] = (), drop_count: int = 0,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.drop_at, self.drop_partitions, self.drop_count, self.replies = drop_at, set(drop), drop_count, []
        self._dropped: set[int] = set()

    def push_messages(self, messages):
        kept = []
        for message in messages:
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            partition = self.contexts[message.metadata.dst_node_id].node_config["partition-id"]
            if configs is not None and configs[Key.STAGE] == self.drop_at and (
                    partition in self.drop_partitions or len(self._dropped) < self.drop_count):
                self._dropped.add(message.metadata.dst_node_id)
            if message.metadata.dst_node_id not in self._dropped:
                kept.append(message)
        return super().push_messages(kept)

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.replies += replies
        return replies


def _contributions(n: int) -> dict[int, np.ndarray]:
    """Partition -> a clipped contribution's integers on the lattice of a cohort of n (the worst case: ±C)."""
    lattice = ModularLattice.for_cohort(CLIP, n, 32)
    bits = SeededBits(5)
    rows = torch.from_numpy(np.stack([np.random.default_rng(i).standard_normal(DIMENSION) for i in range(n)]))
    clipped, _ = GaussianMechanism(CLIP, 0.0).constrain_sensitivity(rows * 100, None, torch.zeros(n))
    levels = {i: lattice.stochastic_round(clipped[i], bits) for i in range(n)}
    levels[0] = np.full(DIMENSION, lattice.max_level)  # a coordinate at the top of the range, in every position
    return levels


def _secure_app(levels: dict[int, np.ndarray], guard: ClientGuard | None = None) -> ClientApp:
    app = ClientApp()
    guard = guard or ClientGuard(threshold=0.0, num_shares=0, cohort=None)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        mine = levels[int(context.node_config["partition-id"])]
        return handle_stage(msg, context, lambda bits: ModularLattice.for_cohort(CLIP, len(levels), bits).encode(mine),
                            guard)

    return app


def _run_sum(n: int, drop_at: str | None = None, drop: tuple[int, ...] = (), num_shares: int = 0,
             threshold: float = 0.66, guard: ClientGuard | None = None):
    """A secure sum of n contributions; the clients require what the server runs unless ``guard`` says otherwise."""
    levels = _contributions(n)
    guard = guard or ClientGuard(threshold, num_shares, cohort=n)
    grid = DroppingGrid(_secure_app(levels, guard), n, {}, drop_at=drop_at, drop=drop)
    content = RecordDict({"config": ConfigRecord({protocol.SERVER_ROUND: 1})})
    settings = SecAggSettings(num_shares, threshold, ModularLattice.for_cohort(CLIP, n, 32), CLIP)
    return grid, levels, lambda: secure_sum(grid, sorted(grid.contexts), content, DIMENSION, settings, 10, "1")


# --- a server that lies: clients enforce their own config ------------------------------------------------------
@pytest.mark.parametrize("server, reason", [
    ({"threshold": 0.01}, "threshold of 2 shares; this client's config .* requires ≥ 4"),
    ({"num_shares": 3}, "shares secrets with 3 nodes; this client's config .* implies 6"),
])
def test_clients_refuse_a_setup_weaker_than_their_own_config(server, reason):
    n = 6
    settings = {"num_shares": 0, "threshold": 0.66, **server}
    grid, _, run = _run_sum(n, **settings, guard=ClientGuard(0.66, 0, cohort=n))
    with pytest.raises(SecureAggregationFailed):
        run()
    errors = [r.error.reason for r in grid.replies if r.has_error()]
    assert len(errors) == n and all(re.search(reason, e) for e in errors), errors
    assert not any(protocol.MASKED in r.content.array_records for r in grid.replies if not r.has_error())


def test_clients_refuse_a_setup_for_another_cohort_size():
    grid, _, run = _run_sum(5, guard=ClientGuard(0.66, 0, cohort=8))
    with pytest.raises(SecureAggregationFailed):
        run()
    assert all("a cohort of 5; this client's config fixes 8" in r.error.reason for r in grid.replies if r.has_error())


def test_clients_refuse_to_unmask_a_sum_of_fewer_than_their_noise_shares():
    """A server that unmasks the survivors of a dropout although the clients' σ_l assumed sums of m = 6."""
    n = 6
    grid, _, run = _run_sum(n, drop_at=Stage.COLLECT_MASKED_VECTORS, drop=(2,),
                            guard=ClientGuard(0.66, 0, cohort=n, min_survivors=n))
    with pytest.raises(SecureAggregationFailed):
        run()
    refusals = [r.error.reason for r in grid.replies if r.has_error()]
    assert refusals and all("unmask a sum of 5 contributions" in e for e in refusals)
    _honest, _, honest_run = _run_sum(n, drop_at=Stage.COLLECT_MASKED_VECTORS, drop=(2,),
                                     guard=ClientGuard(0.66, 0, cohort=n, min_survivors=5))
    assert honest_run().contributors == 5  # m = 5 survivors: released


def test_modular_lattice_leaves_room_for_the_whole_cohort():
    for n in (2, 10, 100, 1000):
        lattice = ModularLattice.for_cohort(CLIP, n, 32)
        assert n * (lattice.max_level) < lattice.modulus // 2  # the sum of n extreme contributions cannot wrap
        assert CLIP / lattice.granularity + 1 <= lattice.max_level  # a clipped coordinate's level fits
        assert lattice.granularity <= 4 * n * CLIP / lattice.modulus  # and g is as fine as the modulus allows
        extreme = np.full(5, -lattice.max_level)
        total = sum(lattice.encode(extreme) for _ in range(n)) & np.uint64(lattice.modulus - 1)
        assert lattice.decode_sum(total).tolist() == [-n * lattice.max_level] * 5
    with pytest.raises(ValueError, match="levels"):
        ModularLattice.for_cohort(CLIP, 2**15, 16)


def test_stochastic_rounding_is_unbiased_and_within_one_step():
    lattice = ModularLattice.for_cohort(1.0, 2**20, 32)  # a coarse g, so that the rounding shows
    value = torch.full((200_000,), 0.3 * lattice.granularity + 5 * lattice.granularity)
    levels = lattice.stochastic_round(value, SeededBits(1))
    assert set(np.unique(levels).tolist()) == {5, 6}
    assert levels.mean() == pytest.approx(5.3, abs=5 * math.sqrt(0.21 / 200_000))  # 5 standard errors
    with pytest.raises(ValueError, match="clip"):
        lattice.stochastic_round(torch.full((3,), 2.0), SeededBits(1))


def test_the_server_unmasks_exactly_the_sum_and_holds_no_single_contribution():
    n = 6
    grid, levels, run = _run_sum(n)
    result = run()
    assert result.contributors == n and not result.dropped
    assert torch.equal(result.levels, torch.from_numpy(sum(levels.values())))
    lattice = result.lattice
    masked = [r.content[protocol.MASKED][protocol.MASKED].numpy() for r in grid.replies
              if protocol.MASKED in r.content.array_records]
    assert len(masked) == n
    for reply in grid.replies:  # no reply carries an update, a term, metrics or a float array
        assert set(reply.content.array_records) <= {protocol.MASKED}
        assert not reply.content.metric_records
        assert all(a.numpy().dtype == lattice.wire_dtype for r in reply.content.array_records.values()
                   for a in r.values())
    for vector in masked:
        centred = lattice.decode_sum(vector.astype(np.uint64)).numpy()
        # an unmasked contribution lies within ±max_level of 0; a masked one is uniform mod M
        assert np.mean(np.abs(centred) <= lattice.max_level) < 2 / n
        assert not any(np.array_equal(lattice.encode(mine), vector) for mine in levels.values())
        assert abs(np.mean(vector.astype(np.float64)) / lattice.modulus - 0.5) < 0.03


@pytest.mark.parametrize("stage", [Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK])
def test_dropouts_up_to_the_threshold_still_release_the_survivors_sum(stage):
    n = 7  # k = 7, t = ⌈0.66·7⌉ = 5: two may drop
    grid, levels, run = _run_sum(n, drop_at=stage, drop=(2, 5))
    result = run()
    dropped_nodes = {node for node, c in grid.contexts.items() if c.node_config["partition-id"] in (2, 5)}
    assert set(result.dropped) == {f"node {node}" for node in dropped_nodes}
    survivors = [0, 1, 3, 4, 6] if stage == Stage.COLLECT_MASKED_VECTORS else range(n)  # unmask: vectors all in
    assert result.contributors == len(survivors)
    assert torch.equal(result.levels, torch.from_numpy(sum(levels[i] for i in survivors)))


def test_sparse_secaggplus_graph_releases_the_sum_with_dropouts():
    n = 9  # k = 5 neighbours, t = 3: each neighbourhood tolerates 2 dropouts
    _grid, levels, run = _run_sum(n, drop_at=Stage.COLLECT_MASKED_VECTORS, drop=(4,), num_shares=5, threshold=0.6)
    result = run()
    assert torch.equal(result.levels, torch.from_numpy(sum(levels[i] for i in range(n) if i != 4)))


@pytest.mark.parametrize("stage", [Stage.SHARE_KEYS, Stage.COLLECT_MASKED_VECTORS, Stage.UNMASK])
def test_more_dropouts_than_the_threshold_allows_fail_without_unmasking(stage):
    _grid, _, run = _run_sum(7, drop_at=stage, drop=(1, 2, 3))
    with pytest.raises(SecureAggregationFailed, match=r"threshold is 5|5 are needed") as failure:
        run()
    assert len(failure.value.dropped) == 3


def _corrupted(msg: Message, reply: Message, stage: str) -> Message:
    """``reply`` to ``msg`` with its stage's config record broken as a misbehaving client might break it."""
    record = ConfigRecord(dict(reply.content.config_records[RECORD_KEY_CONFIGS]))
    if stage == Stage.SETUP:
        del record[Key.PUBLIC_KEY_2]  # a key missing
    elif stage == Stage.SHARE_KEYS:
        record[Key.DESTINATION_LIST] = record[Key.DESTINATION_LIST][:-1]  # one destination fewer than ciphertexts
    else:
        record[Key.SHARE_LIST] = list(range(len(record[Key.SHARE_LIST])))  # integers, not shares
    return Message(RecordDict({RECORD_KEY_CONFIGS: record}), reply_to=msg)


@pytest.mark.parametrize("stage", [Stage.SETUP, Stage.SHARE_KEYS, Stage.UNMASK])
def test_a_malformed_stage_reply_drops_its_node_and_the_others_still_sum(stage):
    """One node's reply to a stage lacks a key, pairs lists of unequal length or holds the wrong type: that node is
    dropped as malformed (no crash of the server), and the survivors' sum is unmasked as with a dropout."""
    n, liar = 7, 6
    levels = _contributions(n)
    honest = _secure_app(levels, ClientGuard(0.66, 0, cohort=n))
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        asked = msg.content.config_records[RECORD_KEY_CONFIGS][Key.STAGE]  # before the stage reads its record
        reply = honest(msg, context)
        return _corrupted(msg, reply, stage) if int(context.node_config["partition-id"]) == liar and \
            asked == stage else reply

    grid = DroppingGrid(app, n, {})
    settings = SecAggSettings(0, 0.66, ModularLattice.for_cohort(CLIP, n, 32), CLIP)
    content = RecordDict({"config": ConfigRecord({protocol.SERVER_ROUND: 1})})
    result = secure_sum(grid, sorted(grid.contexts), content, DIMENSION, settings, 10, "1")
    assert [reason.kind.value for reason in result.dropped.values()] == ["malformed"]
    summed = range(n) if stage == Stage.UNMASK else [i for i in range(n) if i != liar]  # it sent its vector
    assert torch.equal(result.levels, torch.from_numpy(sum(levels[i] for i in summed)))


def _run(tmp_path, name: str, grid_kwargs: dict | None = None, grids: list | None = None,
         client_overrides: dict | None = None, **overrides) -> tuple[dict, dict]:
    """One run of the real apps; ``client_overrides`` give the clients a config of their own (a lying server)."""
    settings = {"dataset": "digits", "model": "logreg", "population": 8, "sampling": "fixed",
                "sampling-rate": 0.75, "rounds": 1, "local-epochs": 1, "learning-rate": 0.1,
                "clipping-norm": 0.5, "noise-multiplier": 0.0, "mechanism": "hog", "privacy-seed": 7,
                "partitioner": "iid", "results-dir": str(tmp_path / name), **overrides}
    config = RunConfig().with_overrides(settings)
    client_config = config.with_overrides(client_overrides or {})
    grid = DroppingGrid(fedhog_client_app, config.population, client_config.to_mapping(), **(grid_kwargs or {}))
    if grids is not None:
        grids.append(grid)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=config.to_mapping())
    server_app(grid, context)
    metrics = read_metrics(tmp_path / name)
    return metrics, torch.load(tmp_path / name / "final_model.pt")


@pytest.mark.parametrize("sigma", [0.0, 0.5])
@pytest.mark.slow
def test_the_secure_release_equals_the_trusted_one_within_the_quantisation_bound(tmp_path, sigma):
    trusted, trusted_model = _run(tmp_path, "trusted", **{"noise-multiplier": sigma})
    secure, secure_model = _run(tmp_path, "secure", **{"noise-multiplier": sigma, "secure-aggregation": "secagg+"})
    n = secure["rounds"][0]["clients_accepted"]
    # the same accountant; only the sampler's slack differs (17/σ_ℤ² on the coarser secure lattice: ~1e-12)
    assert n == trusted["rounds"][0]["clients_accepted"] == 6
    epsilons = secure["rounds"][0]["epsilon"], trusted["rounds"][0]["epsilon"]
    assert epsilons[0] == (epsilons[1] if sigma == 0 else pytest.approx(epsilons[1], rel=1e-9))
    if sigma > 0:  # each mode draws its own discrete Gaussian on its own lattice: the noise is not coupled
        return
    g = secure["privacy"]["secagg_granularity"]  # g of the largest cohort: K = 6 under fixed-size sampling
    assert g == ModularLattice.for_cohort(0.5, 6, 32).granularity
    # per coordinate: n stochastic roundings (< g each) against n roundings to nearest on a 2^-40·C lattice,
    # then float32 rounds ū and θ + ū: half a unit in the last place each, in both modes
    _, initial = _run(tmp_path, "initial", **{"max-epsilon": 1e-9, "noise-multiplier": 1.0})  # stops before round 1
    bound = (n * g + g + 2.0**-30) / 6
    for key in secure_model:
        difference = (secure_model[key] - trusted_model[key]).abs()
        ulps = 2.0**-23 * (trusted_model[key].abs() + (trusted_model[key] - initial[key]).abs())
        assert bool((difference <= bound + ulps).all()), key
    assert any(not torch.equal(secure_model[k], trusted_model[k]) for k in secure_model)  # not the same code path


def test_a_server_that_lowers_the_threshold_gets_no_round_from_clients_that_did_not(tmp_path):
    """The server runs secagg-threshold = 0.01 (t = 2); the clients' own config says 0.66 (t = 4): they refuse."""
    secure = {"noise-multiplier": 0.5, "secure-aggregation": "secagg+", "noise": "distributed"}
    grids: list = []
    with pytest.raises(RuntimeError, match=r"every sampled client failed \(6 of 6\): RoundRefused: the server's "
                                           r"setup asks for a threshold of 2 shares.*requires ≥ 4.*ε = 0"):
        _run(tmp_path, "lying", grids=grids, client_overrides={"secagg-threshold": 0.66},
             **secure, **{"secagg-threshold": 0.01})
    metrics = read_metrics(tmp_path / "lying")
    record = metrics["rounds"][0]
    assert record["failure"].startswith("secure aggregation failed: setup")
    assert record["epsilon"] == 0.0 and record["clients_accepted"] == 0
    assert not any(r.has_content() and protocol.MASKED in r.content.array_records for r in grids[0].replies)


def test_a_round_with_too_many_dropouts_releases_nothing_and_spends_no_epsilon(tmp_path):
    # 6 of 8 sampled, t = ⌈0.66·6⌉ = 4: three dropouts after key sharing are one too many
    secure = {"noise-multiplier": 0.5, "secure-aggregation": "secagg+"}
    metrics, model = _run(tmp_path, "failing", {"drop_at": Stage.COLLECT_MASKED_VECTORS, "drop_count": 3}, **secure)
    record = metrics["rounds"][0]
    assert record["failure"].startswith("secure aggregation failed: collect-masked-vectors")
    assert record["epsilon"] == 0.0 and metrics["summary"]["epsilon"] == 0.0
    assert record["clients_accepted"] == 0 and record["rejections"] == {"dropped out": 3}
    _, initial = _run(tmp_path, "no-rounds", **{**secure, "rounds": 1, "max-epsilon": 1e-9})  # stops before round 1
    assert all(torch.equal(model[k], initial[k]) for k in initial)  # nothing was released: the model did not move
    # two dropouts are within the threshold: the round releases the other four's sum
    metrics, _ = _run(tmp_path, "surviving", {"drop_at": Stage.COLLECT_MASKED_VECTORS, "drop_count": 2}, **secure)
    assert metrics["rounds"][0]["clients_accepted"] == 4 and metrics["rounds"][0]["epsilon"] > 0


@pytest.mark.parametrize("overrides, names", [
    ({"adaptive-clipping": True}, "adaptive-clipping"),
    ({"max-update-norm": 10.0}, "max-update-norm"),
    ({"aggregator": "flower-dp", "mechanism": "gaussian", "sampling": "fixed", "accountant": "rdp"}, "aggregator"),
    ({"client-dp": "dpsgd", "mechanism": "gaussian"}, "client-dp"),
    ({"mechanism": "none"}, "mechanism"),
    ({"secagg-modulus-bits": 12}, "secagg-modulus-bits"),
    ({"secagg-modulus-bits": 16, "population": 20000, "num-samples": 40000}, "secagg-modulus-bits"),
    ({"secagg-num-shares": 2}, "secagg-num-shares"),
    ({"secagg-threshold": 0.0}, "secagg-threshold"),
    ({"secure-aggregation": "secagg"}, "secure-aggregation"),
])
def test_what_secure_mode_cannot_do_is_refused_naming_the_key(overrides, names):
    with pytest.raises(ConfigError, match=names):
        RunConfig().with_overrides({"secure-aggregation": "secagg+", **overrides})


def test_the_vectorized_engine_runs_secure_mode_client_by_client():
    assert "secure-aggregation" in unbatchable_reason(RunConfig().with_overrides({"secure-aggregation": "secagg+"}))


def test_small_cohort_delta_is_the_probability_that_poisson_sampling_leaves_fewer_than_two():
    assert small_cohort_delta("fixed", 0.1, 100, 30) == 0.0
    q, n = 0.2, 40
    one_round = (1 - q) ** (n - 1) + (n - 1) * q * (1 - q) ** (n - 2)
    assert small_cohort_delta("poisson", q, n, 3) == pytest.approx(3 * one_round, rel=1e-12)


def test_no_secret_of_the_protocol_reaches_the_results_folder_or_the_log(tmp_path, caplog):
    """The clients' private keys, self-mask seeds and pairwise keys stay in their contexts' memory."""
    caplog.set_level("DEBUG")
    grids: list = []
    metrics, _ = _run(tmp_path, "secrets", grids=grids, **{"secure-aggregation": "secagg+", "privacy-seed": -1,
                                                         "noise-multiplier": 1.0})
    assert metrics["status"] == "finished" and metrics["rounds"][0]["clients_accepted"] == 6
    states = [SecAggPlusState(**c.state.config_records[RECORD_KEY_STATE]) for c in grids[0].contexts.values()
              if RECORD_KEY_STATE in c.state.config_records]
    secrets_held = [secret for state in states for secret in (state.sk1, state.sk2, state.rd_seed,
                                                               *state.ss2_dict.values())]
    assert len(states) == 6 and all(secrets_held)
    haystacks = [p.read_bytes() for p in (tmp_path / "secrets").rglob("*") if p.is_file()] + [caplog.text.encode()]
    for secret in secrets_held:
        for needle in (secret, secret.hex().encode(), base64.b64encode(secret), secret[-16:]):
            assert not any(needle in hay for hay in haystacks)
