"""The contract of every private Flower / Opacus name fedhog uses (:mod:`fedhog.compat`): an upgrade that
moves or changes one fails here, and no other fedhog module imports one."""

from __future__ import annotations

import ast
import inspect
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.serde import message_from_proto, message_to_proto
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent, NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant
from flwr.supercore.task_identity import TaskIdentity

import fedhog
from fedhog import compat
from fedhog.privacy.pld import PldAccountant

PACKAGE = Path(fedhog.__file__).parent
CONFIG = PrivacyConfig(target_delta=1e-5, population_size=1000,
                       neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                       sampling_method=SamplingMethod.POISSON, max_epsilon=8.0)
EVENT = GaussianPrivacyEvent(noise_multiplier=1.5, sample_size=100, population_size=1000)


@pytest.mark.parametrize("stage", [compat.secaggplus_setup, compat.secaggplus_share_keys, compat.secaggplus_unmask])
def test_secaggplus_stages_take_state_and_configs(stage) -> None:
    """fedhog's client calls each stage as ``stage(state, configs)`` and replies with the dict it returns."""
    signature = inspect.signature(stage)
    assert list(signature.parameters) == ["state", "configs"]
    assert "SecAggPlusState" in str(signature.parameters["state"].annotation)
    assert "ConfigRecord" in str(signature.parameters["configs"].annotation)
    assert str(signature.return_annotation).startswith("dict[str")


def test_secaggplus_setup_answers_with_public_keys() -> None:
    """The setup stage of a 3-node round returns the node's two public keys (what the server forwards)."""
    from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState
    from flwr.common.secure_aggregation.secaggplus_constants import Key

    state = SecAggPlusState(nid=7)
    configs = ConfigRecord({Key.SAMPLE_NUMBER: 3, Key.SHARE_NUMBER: 3, Key.THRESHOLD: 2, Key.CLIPPING_RANGE: 8.0,
                            Key.TARGET_RANGE: 1 << 16, Key.MOD_RANGE: 1 << 20, Key.MAX_WEIGHT: 1.0})
    reply = compat.secaggplus_setup(state, configs)
    assert set(reply) == {Key.PUBLIC_KEY_1, Key.PUBLIC_KEY_2}
    assert all(isinstance(key, bytes) and key for key in reply.values())
    assert (state.sample_num, state.share_num, state.threshold, state.mod_range) == (3, 3, 2, 1 << 20)


@pytest.mark.parametrize("make", [RdpAccountant, PldAccountant])
def test_the_state_parsers_read_what_the_accountants_write(make) -> None:
    accountant = make(CONFIG)
    accountant.compose(EVENT, count=3)
    state = accountant.state_dict()
    assert compat.parse_config(state["config"]) == CONFIG
    assert compat.parse_compositions(state["compositions"]) == [(EVENT, 3)]
    with pytest.raises(ValueError, match="Invalid privacy configuration in accountant state"):
        compat.parse_config({**state["config"], "population_size": "many"})
    with pytest.raises(ValueError, match="Invalid composition in accountant state"):
        compat.parse_compositions([{"event": {"noise_multiplier": 1.0}, "count": 1}])


@pytest.mark.parametrize("validate,good,bad,named", [
    (compat.validate_count, [1, 500], [0, -1, True, 1.5], "count"),
    (compat.validate_delta, [1e-5, 0.5], [0.0, 1.0, -1e-5, math.nan], "delta"),
    (compat.validate_epsilon, [0.0, 3.0], [-1.0, math.inf, math.nan], "epsilon"),
    (lambda e: compat.validate_positive_epsilon("max_epsilon", e), [0.1, 8.0], [0.0, -1.0, math.inf, True],
     "max_epsilon"),
])
def test_the_validators_accept_good_values_and_refuse_bad_ones(validate, good, bad, named) -> None:
    for value in good:
        validate(value)
    for value in bad:
        with pytest.raises(ValueError, match=f"^{named} must be"):
            validate(value)


def test_validator_signatures() -> None:
    for name in ("validate_count", "validate_delta", "validate_epsilon"):
        assert len(inspect.signature(getattr(compat, name)).parameters) == 1, name
    assert list(inspect.signature(compat.validate_positive_epsilon).parameters) == ["name", "epsilon"]
    for name in ("parse_config", "parse_compositions"):
        assert list(inspect.signature(getattr(compat, name)).parameters) == ["value"], name


def test_a_stamped_message_reads_back_its_id_and_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the in-process engine needs: the stamp survives the protobuf a message travels as, and a reply
    made to it points back at it."""
    for name, value in (("_task_id", 1), ("_run_id", 42), ("_node_id", 0)):  # a ServerApp's task, as the engine sets
        monkeypatch.setattr(TaskIdentity, name, value)
    message = Message(RecordDict({"config": ConfigRecord({"x": 1})}), dst_node_id=3, message_type="train")
    compat.stamp_message(message, "abc123", 7)
    travelled = message_from_proto(message_to_proto(message))
    for copy in (message, travelled):
        assert (copy.metadata.message_id, copy.metadata.run_id) == ("abc123", 7)
    reply = Message(RecordDict(), reply_to=travelled)
    assert reply.metadata.reply_to_message_id == "abc123" and reply.metadata.run_id == 7


def test_opacus_refuses_a_marked_gradient() -> None:
    check, mark = compat.opacus_processed_flags()
    gradient = torch.ones(3)
    check(gradient)  # fresh: accepted
    mark(gradient)
    with pytest.raises(ValueError, match="Gradients haven't been cleared"):
        check(gradient)
    assert [list(inspect.signature(f).parameters) for f in (check, mark)] == [["obj"], ["obj"]]



@pytest.mark.parametrize("kind", ["dirichlet", "pathological", "iid"])
def test_partition_indices_are_what_load_partition_selects(kind: str) -> None:
    from datasets import Dataset
    from flwr_datasets.partitioner import DirichletPartitioner, IidPartitioner, PathologicalPartitioner

    labels = np.random.default_rng(0).integers(0, 10, 3000)
    partitioner = {"dirichlet": lambda: DirichletPartitioner(50, "label", 0.5, min_partition_size=0, seed=3),
                   "pathological": lambda: PathologicalPartitioner(50, "label", 2, seed=3),
                   "iid": lambda: IidPartitioner(50)}[kind]()
    partitioner.dataset = Dataset.from_dict({"label": labels, "idx": np.arange(len(labels))})
    assert compat.partition_indices(partitioner) is None  # nothing assigned before the first load
    selected = [list(partitioner.load_partition(i)["idx"]) for i in range(50)]
    indices = compat.partition_indices(partitioner)
    if kind == "iid":
        assert indices is None  # keeps no assignment: fedhog loads each partition
    else:
        assert [list(map(int, part)) for part in indices] == selected
        assert sorted(i for part in selected for i in part) == list(range(len(labels)))

def private_uses(path: Path) -> list[str]:
    """Private Flower / Opacus names ``path`` imports, and ``__dict__[...]`` writes it makes."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("flwr", "opacus"):
            private = [alias.name for alias in node.names if alias.name.startswith("_")]
            if private or any(part.startswith("_") for part in node.module.split(".")):
                found.append(f"{path.name}:{node.lineno} from {node.module} import {', '.join(private)}")
        elif isinstance(node, ast.Import):
            found += [f"{path.name}:{node.lineno} import {alias.name}" for alias in node.names
                      if alias.name.split(".")[0] in ("flwr", "opacus")
                      and any(part.startswith("_") for part in alias.name.split("."))]
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute)
              and node.value.attr == "__dict__"):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_other_module_uses_a_private_name() -> None:
    uses = {str(path.relative_to(PACKAGE)): private_uses(path) for path in sorted(PACKAGE.rglob("*.py"))}
    assert len(uses["compat.py"]) >= 11  # the scan sees what compat holds
    assert {name: found for name, found in uses.items() if found and name != "compat.py"} == {}


def test_the_scan_finds_private_uses(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("from flwr.serverapp import Grid\nfrom opacus.optimizers.optimizer import _check_processed_flag\n"
                      "import flwr._internal\nx.metadata.__dict__['_run_id'] = 1\n")
    assert private_uses(module) == ["m.py:2 from opacus.optimizers.optimizer import _check_processed_flag",
                                    "m.py:3 import flwr._internal", "m.py:4 x.metadata.__dict__['_run_id']"]


def test_flowers_clipping_still_divides_by_a_zero_norm_and_the_guard_passes_zero_updates_only():
    """Flower's fixed clipping raises on an update of norm 0 (flwrlabs/flower PR #7631): when an upgrade fixes it,
    this fails and compat.zero_updates_pass_flowers_clipping can go. Inside the guard a zero update passes as it
    is, any other is clipped by Flower's own function (the same bits), and the guard restores Flower's function."""
    from flwr.serverapp.strategy import dp_fixed_clipping

    flowers = dp_fixed_clipping.compute_clip_model_update
    old = [np.ones((3, 2), np.float32), np.full(4, -2.0, np.float32)]
    with pytest.raises(ZeroDivisionError):
        flowers([a.copy() for a in old], old, 0.5)
    expected = [a + np.float32(3.0) for a in old]
    flowers(expected, old, 0.5)
    with compat.zero_updates_pass_flowers_clipping():
        unchanged = [a.copy() for a in old]
        dp_fixed_clipping.compute_clip_model_update(unchanged, old, 0.5)
        moved = [a + np.float32(3.0) for a in old]
        dp_fixed_clipping.compute_clip_model_update(moved, old, 0.5)
    assert dp_fixed_clipping.compute_clip_model_update is flowers
    for got, want in zip(unchanged, old, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(moved, expected, strict=True):
        np.testing.assert_array_equal(got, want)
    assert math.isclose(float(np.sqrt(sum(np.sum((m - o) ** 2) for m, o in zip(moved, old, strict=True)))), 0.5,
                        rel_tol=1e-5)


def _pmf_bits(pmf) -> tuple:
    return pmf._lower_loss, pmf._infinity_mass, pmf._discretization, pmf._pessimistic_estimate, pmf._probs.tobytes()


@pytest.mark.parametrize("sigma, q, relation, interval", [
    (1.675, 0.1, "ADD_OR_REMOVE_ONE", 1e-3),  # the convergence federation's round
    (0.7, 0.5, "ADD_OR_REMOVE_ONE", 1e-3),
    (4.0, 0.01, "REPLACE_ONE", 1e-4),
    (1.0, 1.0, "ADD_OR_REMOVE_ONE", 1e-3),  # no sampling: one symmetric PMF
])
def test_the_memoised_self_composition_is_dp_accountings_bit_for_bit(sigma, q, relation, interval) -> None:
    """SelfComposition replays dp_accounting's self_compose (Chernoff bounds, FFT power) with the parts that do
    not depend on n kept: every PMF it returns must be the same bits, for growing n and for n out of order
    (the FFT length changes between them), and a PLD that is not dense goes to dp_accounting itself."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from dp_accounting.privacy_accountant import NeighboringRelation as DpRelation

    from fedhog.privacy.self_composition import SelfComposition

    pld = pld_lib.from_gaussian_mechanism(sigma, value_discretization_interval=interval, sampling_prob=q,
                                          neighboring_relation=DpRelation[relation])
    compose = SelfComposition(pld)
    assert compat.dense_pmfs(pld) is not None
    for n in [1, 2, 3, 17, 100, 101, 1000, 5, 250]:
        mine, theirs = compose(n), pld.self_compose(n)
        assert mine._symmetric == theirs._symmetric
        assert _pmf_bits(mine._pmf_remove) == _pmf_bits(theirs._pmf_remove)
        assert _pmf_bits(mine._pmf_add) == _pmf_bits(theirs._pmf_add)
        assert mine.get_epsilon_for_delta(1e-5) == theirs.get_epsilon_for_delta(1e-5)
    with pytest.raises(ValueError, match="num_times"):
        compose(0)
    sparse = pld_lib.PrivacyLossDistribution.create_from_rounded_probability({0: 0.5, 3: 0.5}, 0.0, 1e-3)
    assert compat.dense_pmfs(sparse) is None
    assert _pmf_bits(SelfComposition(sparse)(4)._pmf_remove.to_dense_pmf()) == _pmf_bits(
        sparse.self_compose(4)._pmf_remove.to_dense_pmf())


def test_the_memoised_self_composition_gives_the_same_bits_from_several_threads() -> None:
    """The ε schedule's worker and the round's thread can compose at once: the shared FFT cache must not break."""
    from concurrent.futures import ThreadPoolExecutor

    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from fedhog.privacy.self_composition import SelfComposition

    pld = pld_lib.from_gaussian_mechanism(1.675, value_discretization_interval=1e-3, sampling_prob=0.1)
    compose = SelfComposition(pld)
    counts = [1, 400, 7, 900, 33, 2000, 100, 1500] * 3
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda n: _pmf_bits(compose(n)._pmf_add), counts))
    assert got == [_pmf_bits(pld.self_compose(n)._pmf_add) for n in counts]
