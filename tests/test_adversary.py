"""Attacks on the guarantee, run the way an adversary who can read the run would run them.

Each test names the attack; each failed on the first wave's main (32-bit noise
keys, generator states in checkpoints, NaN from one client's reply).
"""

from __future__ import annotations

import base64
import io
import json
import math
import pickle
import secrets
import shutil

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from helpers import read_metrics
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedhog import protocol
from fedhog.checkpoint import CHECKPOINT
from fedhog.client_app import app as client_app
from fedhog.config import RunConfig
from fedhog.engines.inprocess import InProcessGrid, run_in_process
from fedhog.privacy import randomness
from fedhog.privacy.accounting import ClientLevelAccountant
from fedhog.privacy.adaptive_clipping import AdaptiveClipping, AdaptiveClippingSettings
from fedhog.privacy.lattice import NoiseLattice
from fedhog.privacy.mechanism import build_mechanism
from fedhog.privacy.randomness import PrivacyRandomness, SecureBits, SeededBits, standard_normal
from fedhog.server_app import app as server_app
from fedhog.strategy import SecureAggregator

SMALL = {"dataset": "digits", "model": "logreg", "population": 6, "sampling-rate": 0.5, "rounds": 3,
         "partitioner": "iid", "mechanism": "hog", "noise-multiplier": 1.0, "clipping-norm": 1.0}
pytestmark = pytest.mark.usefixtures("shared_cache")


# --- finding 1: the key of the noise --------------------------------------------------------


def test_os_randomness_draws_256_bit_keys_from_the_os(monkeypatch):
    requested = []
    real = secrets.token_bytes

    def spy(n):
        requested.append(n)
        return real(n)

    monkeypatch.setattr(randomness.secrets, "token_bytes", spy)
    streams = PrivacyRandomness(None).for_round(1)
    assert requested.count(randomness.KEY_BYTES) == 3 and randomness.KEY_BYTES * 8 >= 256  # one key a stream
    words = [s.words(4) for s in (streams.sampling, streams.mixing, streams.noise)]
    assert len({w.tobytes() for w in words}) == 3


def test_every_bit_of_a_fixed_privacy_seed_matters():
    """torch.Generator kept 32 bits of a 64-bit seed: s and s + 2^32 gave the same noise."""
    base = 123456789
    draws = {seed: SeededBits(seed, (1, 2)).words(8).tobytes() for seed in (base, base + 2**32, base + 2**64,
                                                                            base + 2**127)}
    assert len(set(draws.values())) == len(draws)
    assert SeededBits(base, (1, 2)).words(8).tobytes() == draws[base]


def test_secure_streams_cannot_be_saved():
    bits = SecureBits()
    with pytest.raises(TypeError, match="secret"):
        pickle.dumps(bits)
    with pytest.raises(TypeError, match="secret"):
        torch.save({"noise": bits}, io.BytesIO())
    assert "key" not in repr(bits).lower().replace("256-bit key from the os", "")


# --- finding 2: secrets at rest ------------------------------------------------------------


def _run(tmp_path, **overrides) -> tuple[RunConfig, dict]:
    config = RunConfig().with_overrides({**SMALL, **overrides, "results-dir": str(tmp_path)})
    run_in_process(server_app, client_app, config.population, config.to_mapping())
    return config, read_metrics(tmp_path)


@pytest.mark.slow
def test_no_key_reaches_any_file_of_the_results_folder(tmp_path, monkeypatch, caplog):
    """Run with OS randomness, adaptive clipping and mixing; record every key drawn; scrape every file."""
    keys = []
    real = secrets.token_bytes

    def recording(n):
        value = real(n)
        keys.append(value)
        return value

    monkeypatch.setattr(randomness.secrets, "token_bytes", recording)
    caplog.set_level("DEBUG")
    _, metrics = _run(tmp_path, **{"adaptive-clipping": True, "count-noise-std": 2.0})
    assert metrics["status"] == "finished" and metrics["privacy"]["randomness"].startswith("OS entropy")
    secrets_drawn = [k for k in keys if len(k) == randomness.KEY_BYTES]
    assert len(secrets_drawn) >= 3 * SMALL["rounds"]  # fresh keys every round
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"metrics.json", "checkpoint.pt", "config.toml", "metrics.prom",
                                        "final_model.pt"}
    haystacks = [p.read_bytes() for p in files] + [caplog.text.encode()]
    for key in secrets_drawn:
        for needle in (key, key.hex().encode(), base64.b64encode(key), key[:16], key[16:]):
            assert not any(needle in hay for hay in haystacks)


@pytest.mark.slow
def test_a_checkpoint_holds_the_model_the_accountant_and_diagnostics_only(tmp_path):
    _run(tmp_path, **{"adaptive-clipping": True, "count-noise-std": 2.0})
    state = torch.load(tmp_path / CHECKPOINT, weights_only=True)
    assert set(state) == {"round", "model", "accountant", "rounds", "rounds_logged", "adaptive_clipping", "job_id",
                          "server_optimizer"}
    assert state["rounds_logged"] == state["round"] - 1 and len(state["rounds"]) == 1  # a count, and its own round
    assert set(state["adaptive_clipping"]) == {"clipping_norm", "steps"}
    assert state["server_optimizer"] == {"first_moment": None, "second_moment": None}  # sgd keeps no moments
    def tensors(value):  # every tensor anywhere in the checkpoint
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dict):
            for v in value.values():
                yield from tensors(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v)
    model_tensors = list(tensors(state["model"]))
    assert sum(1 for _ in tensors(state)) == len(model_tensors)  # no generator state hides as a tensor
    assert all(t.is_floating_point() for t in model_tensors)
    assert "rng" not in json.dumps(state["accountant"], default=str)


def test_resuming_one_checkpoint_twice_draws_fresh_noise_each_time(tmp_path):
    """Nothing to replay: two resumes of the same checkpoint release different models at the same ε."""
    _run(tmp_path / "first", rounds=2)
    for copy in ("a", "b"):
        shutil.copytree(tmp_path / "first", tmp_path / copy)
    resumed = {copy: _run(tmp_path / copy, rounds=3, resume=True)[1] for copy in ("a", "b")}
    assert [r["round"] for r in resumed["a"]["rounds"]] == [1, 2, 3]
    assert resumed["a"]["rounds"][-1]["epsilon"] == pytest.approx(resumed["b"]["rounds"][-1]["epsilon"], rel=1e-12)
    a = torch.load(tmp_path / "a" / "final_model.pt")
    b = torch.load(tmp_path / "b" / "final_model.pt")
    assert any(not torch.equal(a[k], b[k]) for k in a)  # same model and accountant restored, new noise


# --- finding 5: one reply must not move the release by more than C --------------------------

NODES = [17, 4, 903, 56]
SHAPES = {"w": (3, 4), "b": (4,)}
NUMEL = 16


def _record(flat: np.ndarray) -> ArrayRecord:
    flat = np.asarray(flat, dtype=np.float32)
    return ArrayRecord({"w": torch.from_numpy(flat[:12].reshape(3, 4).copy()),
                        "b": torch.from_numpy(flat[12:].copy())})


def _aggregator(kind: str, adaptive: bool, clip: float) -> SecureAggregator:
    mechanism = build_mechanism(kind, clip, 0.0, 0.5 if kind == "hog" else 0.0)
    accountant = ClientLevelAccountant(0.0, "fixed", 1.0, 4, 1e-6, has_guarantee=False)
    clipping = AdaptiveClipping(AdaptiveClippingSettings(clip, count_noise_std=1.0), 0.0) if adaptive else None
    aggregator = SecureAggregator(mechanism, accountant, PrivacyRandomness(3), "fixed", 1.0,  # q = 1
                                  adaptive_clipping=clipping)
    aggregator.slot_of_node = {node: slot for slot, node in enumerate(NODES)}
    return aggregator


def _release(kind, adaptive, clip, contents: dict[int, tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """The released model (global = 0, σ = 0, η = 1) when the nodes in ``contents`` reply."""
    aggregator = _aggregator(kind, adaptive, clip)
    sent = {m.metadata.dst_node_id: m for m in
            aggregator.configure_train(1, _record(np.zeros(NUMEL)), ConfigRecord(), grid=None)}
    replies = []
    for node, (update, term) in contents.items():
        records = {protocol.UPDATE: _record(update), protocol.TERM: _record(term),
                   protocol.METRICS: MetricRecord({protocol.NUM_EXAMPLES: 5})}
        replies.append(InProcessGrid._transport(Message(RecordDict(records), reply_to=sent[node])))
    arrays, _ = aggregator.aggregate_train(1, replies)
    return np.concatenate([arrays[k].numpy().reshape(-1) for k in SHAPES]).astype(np.float64)


ENTRY = st.one_of(
    st.floats(-1.0, 1.0, width=32),
    st.sampled_from([3.4e38, -3.4e38, 1e19, -1e19, 1e30, 1.4e-45, -1.4e-45, 1e-40, 0.0, math.inf, -math.inf,
                     math.nan]))
VECTOR = st.lists(ENTRY, min_size=NUMEL, max_size=NUMEL).map(lambda v: np.array(v, dtype=np.float32))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(updates=st.lists(VECTOR, min_size=4, max_size=4), terms=st.lists(VECTOR, min_size=4, max_size=4),
       kind=st.sampled_from(["gaussian", "hog"]), adaptive=st.booleans(), clip=st.sampled_from([0.5, 2.0]))
def test_any_reply_moves_the_noiseless_release_by_at_most_c(server_identity, updates, terms, kind, adaptive, clip):
    """Huge finite, subnormal, inf and NaN entries, mixed with good replies: the release is finite, and
    adding or removing any one reply moves the sum (K × the release) by at most C plus the lattice's rounding."""
    contents = {node: (updates[i], terms[i]) for i, node in enumerate(NODES)}
    full = _release(kind, adaptive, clip, contents)
    assert np.isfinite(full).all()
    slack = NoiseLattice.for_settings(build_mechanism(kind, clip, 0.0), NUMEL).rounding_slack
    float32_rounding = 1e-6 * clip  # the release is cast to the model's float32
    for node in NODES:
        without = _release(kind, adaptive, clip, {n: c for n, c in contents.items() if n != node})
        assert np.isfinite(without).all()
        moved = len(NODES) * np.linalg.norm(full - without)  # K = 4
        assert moved <= clip + slack + float32_rounding, (node, moved)


def test_float32_entries_near_1e19_no_longer_turn_the_release_into_nan(server_identity):
    """Finding 5: ‖Δ‖ overflowed float32 to inf, passed max-update-norm = inf, and mixing made NaN."""
    huge = np.full(NUMEL, 1e19, dtype=np.float32)
    assert not np.isfinite(np.linalg.norm(huge))  # the overflow the attack used
    small = np.linspace(-0.1, 0.1, NUMEL)
    release = _release("hog", False, 1.0, {NODES[0]: (huge, small), NODES[1]: (small, small)})
    alone = _release("hog", False, 1.0, {NODES[1]: (small, small)})
    assert np.isfinite(release).all()
    assert 4 * np.linalg.norm(release - alone) == pytest.approx(1.0, abs=1e-6)  # clipped onto the sphere: C


def test_one_slot_keeps_its_xi_whoever_else_replies(server_identity):
    """ξ is drawn per slot of the population, so removing a reply leaves the others' mixing unchanged."""
    xis = standard_normal(SeededBits(3, (1, 1)), len(NODES))
    update, term = np.eye(NUMEL)[0] * 0.1, np.eye(NUMEL)[1]
    release = _release("hog", False, 100.0, {NODES[2]: (update, term)})
    expected = (update + 0.5 * xis[2] * 0.1 * term) / 4
    np.testing.assert_allclose(release, expected, atol=1e-7)
