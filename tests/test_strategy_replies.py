"""SecureAggregator: malformed or unexpected replies are refused and counted; good ones are aggregated exactly."""

import math
import random

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode

from fedhog.engines.inprocess import InProcessGrid
from fedhog.privacy.accounting import ClientLevelAccountant
from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import build_mechanism
from fedhog.privacy.randomness import PrivacyRandomness, SeededBits, discrete_gaussian, standard_normal
from fedhog.protocol import Rejection
from fedhog.server_optimizer import ServerOptimizerSettings
from fedhog.strategy import SecureAggregator

pytestmark = pytest.mark.usefixtures("server_identity")
# node ids are deliberately not in partition order
NODES = [905, 12, 777, 40, 3001, 88, 560, 2]
OUTSIDER = 424242  # not a node of this federation
SHAPES = {"w": (2, 3), "b": (3,)}
NUMEL = 9
GLOBAL_FLAT = np.linspace(-1.0, 1.0, NUMEL).astype(np.float32)


def as_record(flat, shapes=None, dtype=np.float32):
    shapes = shapes or SHAPES
    arrays, offset = {}, 0
    for name, shape in shapes.items():
        size = int(np.prod(shape))
        arrays[name] = torch.from_numpy(np.asarray(flat[offset:offset + size], dtype=dtype).reshape(shape).copy())
        offset += size
    return ArrayRecord(arrays)


def flat_of(record):
    return np.concatenate([record[k].numpy().reshape(-1) for k in SHAPES])


def make_aggregator(kind="gaussian", sigma=0.0, clip=1.0, gamma=0.0, population=4, rate=1.0,
                    sampling="fixed", eta=1.0, seed=0):
    mechanism = build_mechanism(kind, clip, sigma, gamma)
    accountant = ClientLevelAccountant(sigma, sampling, rate, population, 1e-5 / population,
                                       has_guarantee=mechanism.has_guarantee)
    aggregator = SecureAggregator(mechanism, accountant, PrivacyRandomness(seed), sampling, rate,
                                  ServerOptimizerSettings("sgd", eta))
    aggregator.slot_of_node = {node: partition for partition, node in enumerate(NODES[:population])}
    messages = list(aggregator.configure_train(1, as_record(GLOBAL_FLAT), ConfigRecord(), grid=None))
    return aggregator, {m.metadata.dst_node_id: m for m in messages}


def transported(message):
    """Serialise and parse, as a real transport would."""
    return InProcessGrid._transport(message)  # pylint: disable=protected-access


def reply(instruction, update=None, term=None, num_examples=10, metrics=None, records=None):
    """A reply to ``instruction``; ``records`` replaces the default content entirely."""
    if records is None:
        records = {"update": as_record(update)}
        if term is not None:
            records["third-order-term"] = as_record(term)
        records["metrics"] = MetricRecord(
            {"num-examples": num_examples, "train-loss": 0.5, **(metrics or {})})
    return transported(Message(RecordDict(records), reply_to=instruction))


def clipped(u, clip):
    u = np.asarray(u, dtype=np.float64)
    return u * min(1.0, clip / np.linalg.norm(u))


U0 = 0.1 * np.arange(NUMEL)                  # ‖·‖ ≈ 1.43 > C = 1: clipped
U1 = np.full(NUMEL, -0.05)                   # ‖·‖ = 0.15 < C: unchanged
U2 = np.array([2.0, 0, 0, 0, 0, 0, 0, 0, -1])  # ‖·‖ = √5: clipped


def expected_global(updates, clip, k, eta):
    return GLOBAL_FLAT.astype(np.float64) + eta * sum(clipped(u, clip) for u in updates) / k


def bad_record(case):
    good = {"update": as_record(U2), "metrics": MetricRecord({"num-examples": 5, "train-loss": 0.1})}
    if case == "no update":
        return {"metrics": good["metrics"]}
    if case == "no metrics":
        return {"update": good["update"]}
    if case == "negative num-examples":
        return {**good, "metrics": MetricRecord({"num-examples": -1, "train-loss": 0.1})}
    if case == "float num-examples":
        return {**good, "metrics": MetricRecord({"num-examples": 2.5, "train-loss": 0.1})}
    if case == "update under another key":
        return {"delta": good["update"], "metrics": good["metrics"]}
    if case == "renamed key":
        return {**good, "update": as_record(U2, {"w": (2, 3), "bias": (3,)})}
    if case == "extra key":
        return {**good, "update": as_record(np.zeros(10), {"w": (2, 3), "b": (3,), "x": (1,)})}
    if case == "missing key":
        return {**good, "update": as_record(U2[:6], {"w": (2, 3)})}
    if case == "keys reordered":
        return {**good, "update": as_record(U2[[6, 7, 8, 0, 1, 2, 3, 4, 5]], {"b": (3,), "w": (2, 3)})}
    if case == "transposed (same numel)":
        return {**good, "update": as_record(U2, {"w": (3, 2), "b": (3,)})}
    if case == "wrong size":
        return {**good, "update": as_record(np.zeros(10), {"w": (2, 3), "b": (4,)})}
    if case == "float64":
        return {**good, "update": as_record(U2, dtype=np.float64)}
    if case == "float16":
        return {**good, "update": as_record(U2, dtype=np.float16)}
    if case == "nan":
        return {**good, "update": as_record(np.where(np.arange(NUMEL) == 4, np.nan, U2))}
    if case == "inf":
        return {**good, "update": as_record(np.where(np.arange(NUMEL) == 8, -np.inf, U2))}
    raise AssertionError(case)


BAD_CASES = [
    ("no update", "malformed"),
    ("no metrics", "malformed"),
    ("negative num-examples", "malformed"),
    ("float num-examples", "malformed"),
    ("update under another key", "malformed"),
    ("renamed key", "wrong keys"),
    ("extra key", "wrong keys"),
    ("missing key", "wrong keys"),
    ("keys reordered", "wrong keys"),
    ("transposed (same numel)", "wrong shape"),
    ("wrong size", "wrong shape"),
    ("float64", "wrong dtype"),
    ("float16", "wrong dtype"),
    ("nan", "non-finite values"),
    ("inf", "non-finite values"),
]


def assert_round(aggregator, result, accepted, rejections, expected_flat):
    arrays, metrics = result
    record = aggregator.current
    assert record.clients_accepted == accepted
    assert record.clients_rejected == sum(rejections.values())
    assert record.rejections == rejections
    assert metrics["clients-accepted"] == accepted
    assert metrics["clients-rejected"] == sum(rejections.values())
    assert list(arrays.keys()) == list(SHAPES)
    assert all(tuple(arrays[k].shape) == SHAPES[k] and arrays[k].dtype == "float32" for k in SHAPES)
    np.testing.assert_allclose(flat_of(arrays), expected_flat, rtol=0, atol=2e-7)


@pytest.mark.parametrize("case, kind", BAD_CASES)
def test_malformed_reply_is_rejected_and_good_ones_aggregated(case, kind):
    aggregator, sent = make_aggregator()
    assert set(sent) == set(NODES[:4])
    bad = reply(sent[NODES[2]], records=bad_record(case))
    replies = [reply(sent[NODES[0]], U0), bad, reply(sent[NODES[1]], U1)]
    assert aggregator.read_contribution(replies[0]).update.numel() == NUMEL
    with pytest.raises(ValueError, match=f"^{kind}"):  # BadReply is a ValueError
        aggregator.read_contribution(bad)
    result = aggregator.aggregate_train(1, replies)
    # K = 4 although only two replies count
    assert_round(aggregator, result, 2, {kind: 1}, expected_global([U0, U1], 1.0, 4, 1.0))


def test_client_error_reply_is_rejected():
    aggregator, sent = make_aggregator()
    error = transported(Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=sent[NODES[3]]))
    result = aggregator.aggregate_train(1, [error, reply(sent[NODES[0]], U0), reply(sent[NODES[1]], U1)])
    assert_round(aggregator, result, 2, {"client error": 1}, expected_global([U0, U1], 1.0, 4, 1.0))


def test_reply_from_unknown_node_is_rejected():
    aggregator, sent = make_aggregator()
    stranger = Message(RecordDict(), dst_node_id=OUTSIDER, message_type=MessageType.TRAIN)
    result = aggregator.aggregate_train(
        1, [reply(sent[NODES[0]], U0), reply(stranger, U2), reply(sent[NODES[1]], U1)])
    assert_round(aggregator, result, 2, {"not sampled": 1}, expected_global([U0, U1], 1.0, 4, 1.0))


def test_reply_from_a_node_sampled_out_this_round_is_rejected():
    aggregator, sent = make_aggregator(population=6, rate=0.5)  # 3 of 6 nodes
    assert len(sent) == 3
    left_out = next(n for n in NODES[:6] if n not in sent)
    forged = Message(RecordDict(), dst_node_id=left_out, message_type=MessageType.TRAIN)
    cohort = sorted(sent, key=aggregator.slot_of_node.get)
    replies = [reply(sent[cohort[0]], U0), reply(forged, U2), reply(sent[cohort[1]], U1)]
    result = aggregator.aggregate_train(1, replies)
    assert_round(aggregator, result, 2, {"not sampled": 1}, expected_global([U0, U1], 1.0, 3, 1.0))


def test_duplicate_reply_is_rejected_and_the_first_kept():
    aggregator, sent = make_aggregator()
    replies = [reply(sent[NODES[0]], U0), reply(sent[NODES[1]], U1), reply(sent[NODES[0]], U2)]
    result = aggregator.aggregate_train(1, replies)
    assert_round(aggregator, result, 2, {"duplicate": 1}, expected_global([U0, U1], 1.0, 4, 1.0))


def test_many_bad_replies_in_one_round_are_each_counted():
    aggregator, sent = make_aggregator(population=8)
    good = [reply(sent[NODES[i]], u) for i, u in enumerate([U0, U1, U2])]
    bad = [reply(sent[NODES[3]], records=bad_record("nan")),
           reply(sent[NODES[4]], records=bad_record("float64")),
           reply(sent[NODES[5]], records=bad_record("transposed (same numel)")),
           reply(sent[NODES[6]], records=bad_record("no update")),
           transported(Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "x"), reply_to=sent[NODES[7]])),
           reply(Message(RecordDict(), dst_node_id=OUTSIDER, message_type=MessageType.TRAIN), U0),
           reply(sent[NODES[1]], U0)]
    replies = good + bad
    random.Random(0).shuffle(replies)
    first_of_node1 = replies.index(good[1]) < replies.index(bad[-1])
    kept = [U0, U1 if first_of_node1 else U0, U2]
    result = aggregator.aggregate_train(1, replies)
    assert_round(aggregator, result, 3,
                 {"non-finite values": 1, "wrong dtype": 1, "wrong shape": 1, "malformed": 1,
                  "client error": 1, "not sampled": 1, "duplicate": 1},
                 expected_global(kept, 1.0, 8, 1.0))


@pytest.mark.parametrize("eta, clip", [(1.0, 1.0), (0.5, 0.3), (2.0, 10.0)])
def test_global_moves_by_eta_times_clipped_sum_over_k(eta, clip):
    aggregator, sent = make_aggregator(clip=clip, eta=eta)
    result = aggregator.aggregate_train(1, [reply(sent[NODES[i]], u) for i, u in enumerate([U0, U1, U2])])
    assert_round(aggregator, result, 3, {}, expected_global([U0, U1, U2], clip, 4, eta))
    assert aggregator.accountant.releases == 1
    assert result[1]["epsilon"] == math.inf  # σ = 0: no guarantee


def test_poisson_round_divides_by_expected_cohort():
    aggregator, sent = make_aggregator(population=8, rate=0.5, sampling="poisson", seed=3)
    updates = [U0, U1, U2, -U0, 2 * U1, 0.5 * U2, U0 + U1, U2 - U1]
    replies = [reply(message, updates[aggregator.slot_of_node[node]]) for node, message in sent.items()]
    result = aggregator.aggregate_train(1, replies)
    used = [updates[aggregator.slot_of_node[node]] for node in sent]
    assert_round(aggregator, result, len(sent), {}, expected_global(used, 1.0, 4, 1.0))


def round_noise(seed, server_round, sigma, clip):
    """The noise round ``server_round`` adds to the sum with this fixed privacy seed (stream 2: noise)."""
    settings_ = build_mechanism("gaussian", clip, sigma)
    lattice = NoiseLattice.for_settings(settings_, NUMEL)
    steps = discrete_gaussian(SeededBits(seed, (server_round, 2)), NUMEL,
                              lattice.sum_std(settings_) / lattice.granularity)
    return steps * lattice.granularity


def test_noise_is_sigma_c_over_k_from_the_rounds_stream():
    sigma, clip, eta, seed = 0.7, 0.5, 0.8, 11
    aggregator, sent = make_aggregator(sigma=sigma, clip=clip, eta=eta, seed=seed)
    torch.manual_seed(0)
    result = aggregator.aggregate_train(1, [reply(sent[NODES[0]], U0), reply(sent[NODES[1]], U1)])
    # the round's seeded noise stream gives the very noise that was added, once, with std σC/K
    noise = round_noise(seed, 1, sigma, clip)
    assert np.std(noise) > 0.1 * sigma * clip
    expected = GLOBAL_FLAT + eta * ((clipped(U0, clip) + clipped(U1, clip) + noise) / 4).astype(np.float32)
    assert_round(aggregator, result, 2, {}, expected)
    assert aggregator.current.noise_std == pytest.approx(sigma * clip / 4, rel=1e-9)
    assert 0 < result[1]["epsilon"] < math.inf


def hog_reply(message, update, term, finite=1):
    return reply(message, update, term=term, metrics={"third-order-finite": finite, "third-order-seconds": 0.1})


T0 = np.array([0, 1.0, 0, 0, 0, 0, 0, 0, 0])
T1 = np.linspace(1, 2, NUMEL)
T2 = np.zeros(NUMEL)


def slot_xis(seed, population, server_round=1):
    """ξ of every slot of the population in a round (stream 1: mixing)."""
    return standard_normal(SeededBits(seed, (server_round, 1)), population)


def test_hog_round_uses_xi_of_each_slot_whatever_the_arrival_order():
    gamma, clip, seed = 0.5, 1.0, 5
    xis = slot_xis(seed, 4)[:3]  # slots 0, 1, 2
    expected_updates = []
    for u, t, xi in zip([U0, U1, U2], [T0, T1, T2], xis, strict=True):
        tn = np.linalg.norm(t)
        expected_updates.append(u + (gamma * xi * np.linalg.norm(u) / tn * t if tn > 0 else 0))
    outcomes = []
    for order in ([0, 1, 2], [2, 0, 1], [1, 2, 0]):
        aggregator, sent = make_aggregator(kind="hog", gamma=gamma, clip=clip, seed=seed)
        triples = [(U0, T0, NODES[0]), (U1, T1, NODES[1]), (U2, T2, NODES[2])]
        replies = [hog_reply(sent[triples[i][2]], triples[i][0], triples[i][1]) for i in order]
        result = aggregator.aggregate_train(1, replies)
        assert_round(aggregator, result, 3, {}, expected_global(expected_updates, clip, 4, 1.0))
        outcomes.append(flat_of(result[0]))
        assert aggregator.current.third_order_seconds_max == pytest.approx(0.1)
    assert all(np.array_equal(outcomes[0], o) for o in outcomes)


def test_hog_rejects_missing_failed_or_malformed_terms():
    aggregator, sent = make_aggregator(kind="hog", gamma=0.5, population=6)
    replies = [
        hog_reply(sent[NODES[0]], U0, T0),
        reply(sent[NODES[1]], U1, metrics={"third-order-finite": 1}),           # no term
        reply(sent[NODES[2]], U2, metrics={"third-order-finite": 0}),           # client says: failed
        hog_reply(sent[NODES[3]], U1, np.where(np.arange(NUMEL) == 0, np.nan, T1)),
        reply(sent[NODES[4]], U2, records={"update": as_record(U2), "third-order-term": as_record(T1, dtype=np.float64),
                                           "metrics": MetricRecord({"num-examples": 1, "train-loss": 0.2})}),
    ]
    result = aggregator.aggregate_train(1, replies)
    xi = slot_xis(0, 6)[0]
    mixed = U0 + 0.5 * xi * np.linalg.norm(U0) / np.linalg.norm(T0) * T0
    assert_round(aggregator, result, 1,
                 {"malformed": 1, Rejection.NON_FINITE_THIRD_ORDER_TERM: 1, "non-finite values": 1, "wrong dtype": 1},
                 expected_global([mixed], 1.0, 6, 1.0))
    assert aggregator.current.third_order_failures == 1


def test_gaussian_ignores_terms():
    aggregator, sent = make_aggregator()
    result = aggregator.aggregate_train(1, [reply(sent[NODES[0]], U0, term=np.full(NUMEL, np.nan))])
    assert_round(aggregator, result, 1, {}, expected_global([U0], 1.0, 4, 1.0))


def test_round_with_only_bad_replies():
    aggregator, sent = make_aggregator()
    result = aggregator.aggregate_train(1, [reply(sent[NODES[0]], records=bad_record("nan"))])
    # a DP mechanism still releases (pure noise, here σ = 0) and accounts the round
    assert_round(aggregator, result, 0, {"non-finite values": 1}, GLOBAL_FLAT)
    assert aggregator.accountant.releases == 1
    none, sent = make_aggregator(kind="none")
    assert none.aggregate_train(1, [reply(sent[NODES[0]], records=bad_record("nan"))]) == (None, None)
    assert none.accountant.releases == 0
    assert none.current.clients_rejected == 1


def test_none_is_example_weighted_fedavg():
    aggregator, sent = make_aggregator(kind="none", clip=0.01, eta=0.5)
    result = aggregator.aggregate_train(1, [reply(sent[NODES[0]], U0, num_examples=30),
                                            reply(sent[NODES[1]], U2, num_examples=10)])
    assert_round(aggregator, result, 2, {}, GLOBAL_FLAT + 0.5 * (30 * U0 + 10 * U2) / 40)


def test_reply_without_train_loss_does_not_crash_the_round():
    aggregator, sent = make_aggregator()
    no_loss = reply(sent[NODES[2]], records={"update": as_record(U2),
                                             "metrics": MetricRecord({"num-examples": 3})})
    arrays, _ = aggregator.aggregate_train(1, [reply(sent[NODES[0]], U0), no_loss])
    assert arrays is not None  # train-loss is informational: the reply is used, not rejected
    assert aggregator.current.clients_accepted == 2 and aggregator.current.clients_rejected == 0


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

CORRUPTIONS = ("none", "nan", "inf", "shape", "dtype", "missing-update", "missing-metrics", "renamed",
               "extra-key", "negative-examples", "float-examples", "error")


def corrupted_reply(instruction, update, corruption):
    if corruption == "error":
        return transported(Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "boom"), reply_to=instruction))
    if corruption == "nan" or corruption == "inf":
        bad = update.copy()
        bad[len(bad) // 2] = np.nan if corruption == "nan" else np.inf
        return reply(instruction, bad)
    if corruption == "shape":
        return reply(instruction, records={"update": as_record(update, {"w": (3, 2), "b": (3,)}),
                                           "metrics": MetricRecord({"num-examples": 3})})
    if corruption == "dtype":
        return reply(instruction, records={"update": as_record(update, dtype=np.float64),
                                           "metrics": MetricRecord({"num-examples": 3})})
    if corruption == "missing-update":
        return reply(instruction, records={"metrics": MetricRecord({"num-examples": 3})})
    if corruption == "missing-metrics":
        return reply(instruction, records={"update": as_record(update)})
    if corruption == "renamed":
        return reply(instruction, records={"update": as_record(update, {"W": (2, 3), "b": (3,)}),
                                           "metrics": MetricRecord({"num-examples": 3})})
    if corruption == "extra-key":
        arrays = {**as_record(update).to_torch_state_dict(), "extra": torch.zeros(1)}
        return reply(instruction, records={"update": ArrayRecord(arrays), "metrics": MetricRecord({"num-examples": 3})})
    if corruption == "negative-examples":
        return reply(instruction, update, num_examples=-1)
    if corruption == "float-examples":
        return reply(instruction, records={"update": as_record(update),
                                           "metrics": MetricRecord({"num-examples": 2.5})})
    return reply(instruction, update)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(corruptions=st.lists(st.sampled_from(CORRUPTIONS), min_size=4, max_size=4),
       scale=st.floats(min_value=0.01, max_value=100.0),
       order=st.permutations(range(4)))
def test_any_mix_of_malformed_replies_never_breaks_a_round(corruptions, scale, order):
    """Whatever the replies hold, the round completes, every reply is counted once, and the
    aggregate is exactly that of the well-formed replies alone (σ = 0)."""
    aggregator, sent = make_aggregator(clip=1.0)
    nodes = NODES[:4]
    updates = {node: scale * np.sin(np.arange(NUMEL) + i).astype(np.float32) for i, node in enumerate(nodes)}
    replies = [corrupted_reply(sent[nodes[i]], updates[nodes[i]], corruptions[i]) for i in order]
    arrays, _ = aggregator.aggregate_train(1, replies)
    good = [node for node, corruption in zip(nodes, corruptions, strict=True) if corruption == "none"]
    assert aggregator.current.clients_accepted == len(good)
    assert aggregator.current.clients_rejected == 4 - len(good)
    assert sum(aggregator.current.rejections.values()) == 4 - len(good)
    expected = GLOBAL_FLAT.astype(np.float64).copy()
    for node in good:
        u = updates[node].astype(np.float64)
        expected += u * min(1.0, 1.0 / np.linalg.norm(u)) / 4  # clipped, summed, divided by K = 4
    np.testing.assert_allclose(flat_of(arrays), expected, rtol=1e-5, atol=1e-6)


def test_an_update_beyond_max_update_norm_is_rejected_as_too_large():
    aggregator, sent = make_aggregator(clip=1.0)
    aggregator.max_update_norm = 10.0
    huge = np.full(NUMEL, 1e6, dtype=np.float32)
    ok = np.full(NUMEL, 0.1, dtype=np.float32)
    arrays, _ = aggregator.aggregate_train(1, [reply(sent[NODES[0]], huge), reply(sent[NODES[1]], ok)])
    assert aggregator.current.rejections == {"too large": 1}
    assert aggregator.current.clients_accepted == 1
    np.testing.assert_allclose(flat_of(arrays), GLOBAL_FLAT + ok * min(1.0, 1 / np.linalg.norm(ok)) / 4, rtol=1e-6)


@pytest.mark.parametrize("key", ["train-loss", "third-order-seconds", "dpsgd-epsilon", "third-order-finite"])
def test_a_metric_the_server_reads_as_a_number_refuses_a_list(key):
    """MetricRecords may hold lists: one where the server reads a number is malformed, not a crash of the round."""
    aggregator, sent = make_aggregator()
    odd = reply(sent[NODES[1]], U1, metrics={key: [0.5, 1.5]})
    arrays, _ = aggregator.aggregate_train(1, [reply(sent[NODES[0]], U0), odd])
    assert_round(aggregator, (arrays, _), 1, {"malformed": 1}, expected_global([U0], 1.0, 4, 1.0))
    assert aggregator.current.train_loss == 0.5  # the accepted reply's


def test_a_train_instruction_is_read_typed():
    """What a client reads of a train instruction: the round as an integer (another type is refused) and the model."""
    from fedhog.replies import global_model_of, server_round_of

    _, sent = make_aggregator()
    instruction = sent[NODES[0]]
    assert server_round_of(instruction) == 1
    assert global_model_of(instruction) == as_record(GLOBAL_FLAT)
    for odd in (2.0, "2", True):
        message = Message(RecordDict({"arrays": as_record(GLOBAL_FLAT), "config": ConfigRecord({"server-round": odd})}),
                          dst_node_id=NODES[0], message_type=MessageType.TRAIN)
        with pytest.raises(ValueError, match=f"server-round={odd!r} is not allowed; expected an integer"):
            server_round_of(message)
