"""Run a config's mechanism with canary clients, through fedhog's own code, and record what an attacker sees.

Each run has ``canaries`` clients, each independently *in* with probability
½, each owning two coordinates of a model vector of dimension 2·canaries.
An in-canary replies with the gradient-space update ``norm``·c,
c = (e₁ − e₂)/√2 on its block, whatever the model (a worst-case client:
Nasr et al. 2021); an out-canary is absent (add/remove: Poisson sampling,
Flower's wrapper) or replies −``norm``·c (replace-one: fixed-size sampling,
whose accountant composes σ/2 for a sensitivity of 2C). The other clients of
the population are absent (they would only add known contributions). Every
slot is sampled by the strategy as any client. A HOG canary also sends a
third-order term along the block's other direction (⊥ c), as an honest
client's term, nearly orthogonal to its update in high dimension, would be.

Where the code runs (:data:`HARNESSES`):

- ``vectorized`` (trusted server, the default): the trusted server's round
  batched over all canaries (:func:`run_batched`): the strategy's mechanism
  (its ``constrain_sensitivity`` and ``add_noise``), sampler, randomness,
  lattice, adaptive clipping and accountant, without per-reply bookkeeping. Mechanism
  level, O(canaries) a round: a million trials in seconds.
- ``strategy`` (trusted server): fedhog's :class:`~fedhog.strategy.SecureAggregator`, built by
  the ServerApp's own ``build_strategy``, its round loop ``start`` with a
  :class:`~fedhog.replies.CohortRunner` that answers each cohort with the
  canaries' results (as the vectorized engine's runner does): sampling,
  reply validation, mixing, clipping, the lattice sum, ``add_noise``,
  adaptive clipping, accounting and the server step are the run's. End-to-end
  but for the clients' training.
- ``secure``: the same strategy's ``begin_round`` and ``finish_secure_round``
  (the server's noise, or none with distributed noise); each sampled client's
  contribution is made by the steps of the ClientApp's
  ``secure_contribution`` (the mechanism's ``constrain_sensitivity``, the run's
  lattice ``stochastic_round``, distributed noise's ``sample``, ``encode``), and the
  residues are summed mod M as unmasking leaves them (the masks, which cancel,
  are not drawn). Mechanism level. With distributed noise the attacker also
  knows the noise shares of the K − m clients the accountant does not count.
- ``flower-dp``: Flower's ``DifferentialPrivacyServerSideFixedClipping`` over
  ``FedAvg`` (``build_flower_dp_strategy``), its own ``start`` loop, over
  fedhog's in-process Grid whose ClientApp replies the canary's θ + update.
- ``dpsgd``: record-level canaries in one client's data, trained by
  :func:`fedhog.dpsgd.train_dpsgd` (Opacus, fedhog's lattice noise) on a
  linear model whose per-record gradients are the canaries; every step's
  model is observed.

The releases are read as the global model's movement, so the server
optimizer is forced to plain SGD with η = 1 (any other is post-processing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, MetricRecord

from .. import protocol
from ..aggregators import aggregator_of
from ..config import RunConfig
from ..dpsgd import DpSgdSettings
from ..privacy.audit.attacks import Observation, Relation
from ..privacy.lattice import NoiseLattice
from ..privacy.mechanism import CLIP_GUARD, GaussianMechanism
from ..privacy.randomness import PrivacyRandomness, client_bits
from ..privacy.sampling import sample_cohort
from ..protocol import ClientResult
from ..replies import CohortReplies, TrainRequest
from ..strategy import RoundRecord, SecureAggregator

ARRAY_KEY = "canaries"
SQRT_HALF = math.sqrt(0.5)
IDLE_SHARE = 1e-4  # × C: what an absent client sends Flower's wrapper, which cannot clip an update of norm 0
StrategyHook = Callable[[SecureAggregator], None]


@dataclass(frozen=True)
class CanarySet:
    """Which of ``count`` canaries are in, their update's length, and (HOG) their terms' signs."""

    labels: np.ndarray  # bool [count]
    norm: float
    term_signs: np.ndarray  # ±1 [count]

    @classmethod
    def draw(cls, count: int, norm: float, rng: np.random.Generator) -> CanarySet:
        """Each canary in with probability ½ (the audit's own randomness, not the mechanism's)."""
        return cls(rng.random(count) < 0.5, norm, np.where(rng.random(count) < 0.5, 1.0, -1.0))

    @property
    def dimension(self) -> int:
        """2 per canary."""
        return 2 * len(self.labels)

    def sign(self, slot: int, relation: Relation) -> float:
        """+1 in, −1 out under replace-one, 0 absent."""
        if slot >= len(self.labels):
            return 0.0
        return 1.0 if self.labels[slot] else (-1.0 if relation == "replace-one" else 0.0)

    def update(self, slot: int, sign: float) -> torch.Tensor:
        """sign·norm·c on the slot's block (float32, as a model update)."""
        vector = torch.zeros(self.dimension, dtype=torch.float32)
        vector[2 * slot], vector[2 * slot + 1] = sign * self.norm * SQRT_HALF, -sign * self.norm * SQRT_HALF
        return vector

    def term(self, slot: int) -> torch.Tensor:
        """A third-order term ⊥ c on the slot's block: ±(e₁ + e₂)/√2."""
        vector = torch.zeros(self.dimension, dtype=torch.float32)
        vector[2 * slot] = vector[2 * slot + 1] = float(self.term_signs[slot]) * SQRT_HALF
        return vector


class _Recorder:
    """Reads each round's release off the model and keeps its components along and across every canary (float32)."""

    def __init__(self, count: int, start: np.ndarray) -> None:
        self.count, self.previous = count, start
        self.along: list[np.ndarray] = []
        self.across: list[np.ndarray] = []
        self.signal: list[float] = []

    def observe(self, model: np.ndarray, sum_std: float, clipped_norm: float, cohort: float,
                known: np.ndarray | None = None) -> None:
        """``model`` after the round; the release is its movement times K, minus what the attacker knows."""
        release = (model - self.previous) * cohort
        self.previous = model
        if known is not None:
            release = release - known
        blocks = release.reshape(self.count, 2)
        scale = sum_std if sum_std > 0 else 1.0  # no noise: any unit will do, the scores are exact
        self.along.append(((blocks[:, 0] - blocks[:, 1]) * SQRT_HALF / scale).astype(np.float32))  # millions
        self.across.append(((blocks[:, 0] + blocks[:, 1]) * SQRT_HALF / scale).astype(np.float32))
        self.signal.append(clipped_norm / scale)

    def observation(self, canaries: CanarySet, inclusion_rate: float, relation: Relation) -> Observation:
        return Observation(np.array(self.along, dtype=np.float32), np.array(self.across, dtype=np.float32),
                           np.array(self.signal), canaries.labels.copy(), inclusion_rate, relation)


@dataclass(frozen=True)
class RunOutcome:
    """One run's observation and the ε its accountant reports after it."""

    observation: Observation
    epsilon: float


def relation_of(config: RunConfig) -> Relation:
    """What an absent canary is under the config's accountant: add/remove (Poisson, Flower) or replace-one (fixed)."""
    if config.client_dp == "dpsgd":
        return "add-remove"
    return aggregator_of(config).audit_relation or ("replace-one" if config.sampling == "fixed" else "add-remove")


def harness_of(config: RunConfig, trusted: str = "vectorized") -> str:
    """Which harness runs this config (see the module docstring); ``trusted`` picks the trusted server's."""
    if config.client_dp == "dpsgd":
        return "dpsgd"
    if (harness := aggregator_of(config).audit_harness) is not None:
        return harness
    if config.secure_aggregation != "off":
        return "secure"
    return trusted


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.asarray(arrays[ARRAY_KEY].numpy(), dtype=np.float64).reshape(-1)


def _strategy(config: RunConfig, dimension: int, hook: StrategyHook | None) -> SecureAggregator:
    from ..server_app import build_strategy  # the ServerApp's own construction

    strategy = build_strategy(config, dimension)
    strategy.slot_of_node = {slot: slot for slot in range(config.population)}  # node id = slot
    if hook is not None:
        hook(strategy)
    return strategy


class _CanaryCohorts:
    """A :class:`~fedhog.replies.CohortRunner` whose clients are the canaries (as the vectorized engine's runner)."""

    def __init__(self, canaries: CanarySet, relation: Relation, hog: bool) -> None:
        self.canaries, self.relation, self.hog = canaries, relation, hog

    def train(self, request: TrainRequest) -> CohortReplies:
        """Each sampled canary's result (an out-canary under add/remove sends none)."""
        results = []
        for slot in sorted(request.cohort.values()):
            sign = self.canaries.sign(slot, self.relation)
            if sign:
                results.append(ClientResult(slot, self.canaries.update(slot, sign),
                                            self.canaries.term(slot) if self.hog else None,
                                            {protocol.NUM_EXAMPLES: 1}))
        return CohortReplies(results)


def run_trusted(config: RunConfig, canaries: CanarySet, hook: StrategyHook | None = None) -> RunOutcome:
    """One run of the SecureAggregator's round loop with canary clients (trusted server)."""
    relation = relation_of(config)
    strategy = _strategy(config, canaries.dimension, hook)
    initial = ArrayRecord({ARRAY_KEY: torch.zeros(canaries.dimension, dtype=torch.float32)})
    recorder = _Recorder(len(canaries.labels), _flat(initial))
    cohort = config.expected_cohort

    def on_round(record: RoundRecord, arrays: ArrayRecord) -> None:
        clipped = min(canaries.norm, record.clipping_norm * CLIP_GUARD)
        recorder.observe(_flat(arrays), record.noise_std * cohort, clipped, cohort)

    strategy.start(None, initial, num_rounds=config.rounds, on_round=on_round,
                   runner=_CanaryCohorts(canaries, relation, strategy.mechanism.wants_term))
    return RunOutcome(recorder.observation(canaries, config.sampling_rate, relation), strategy.accountant.epsilon())


def run_batched(config: RunConfig, canaries: CanarySet, hook: StrategyHook | None = None) -> RunOutcome:
    """One run of the trusted server's round, batched over all canaries: the vectorized audit.

    Each round does what :meth:`SecureAggregator.finish_round` does with the
    contributions, with the same strategy's mechanism, randomness, adaptive
    clipping and accountant: ``sample_cohort`` (Poisson over all canaries;
    fixed-size within each population-sized group of canaries), ξ from the
    mixing stream (:meth:`~fedhog.privacy.mechanism.Mechanism.xis`),
    :meth:`~fedhog.privacy.mechanism.Mechanism.constrain_sensitivity` on every
    sampled canary's block (a row whose other coordinates are zero has the
    same norm, so clipping its block is clipping the row), the lattice sum of
    their quantised blocks (disjoint: a scatter), and
    :meth:`~fedhog.privacy.mechanism.Mechanism.add_noise` over all 2·canaries
    coordinates. What it skips is per-reply bookkeeping (validation, weights)
    and the server step, so a run costs O(canaries) a round instead of
    O(canaries²) and a million trials take seconds.
    """
    relation = relation_of(config)
    count, dimension = len(canaries.labels), canaries.dimension
    strategy = _strategy(config, dimension, hook)
    group = config.population if config.sampling == "fixed" else count
    if count % group:
        raise ValueError(f"fixed-size sampling audits whole populations: canaries={count} is not a multiple of "
                         f"population={group}")
    cohort = config.expected_cohort
    recorder = _Recorder(count, np.zeros(dimension))
    base = np.stack([np.full(count, SQRT_HALF), np.full(count, -SQRT_HALF)], axis=1) * canaries.norm
    terms = np.stack([canaries.term_signs, canaries.term_signs], axis=1) * SQRT_HALF
    signs = np.where(canaries.labels, 1.0, -1.0 if relation == "replace-one" else 0.0)
    total = np.zeros(dimension)
    for server_round in range(1, config.rounds + 1):
        randomness = strategy.randomness.for_round(server_round)
        sampled = np.concatenate([np.asarray(sample_cohort(range(start, start + group), config.sampling,
                                                           config.sampling_rate, randomness.sampling), dtype=np.int64)
                                  for start in range(0, count, group)])
        present = sampled[signs[sampled] != 0]
        mechanism = strategy.mechanism
        if strategy.adaptive_clipping is not None:
            mechanism = mechanism.with_clipping(strategy.adaptive_clipping.clipping_norm,
                                                strategy.adaptive_clipping.update_noise_multiplier)
        xis = mechanism.xis(randomness.mixing, count, present)  # one ξ per slot, as the strategy draws them
        lattice = NoiseLattice.for_settings(mechanism, dimension)
        levels = torch.zeros(dimension, dtype=torch.int64)
        norms: tuple[float, ...] = ()
        if len(present):
            rows, stats = mechanism.constrain_sensitivity(
                torch.from_numpy(base[present] * signs[present, None]),
                torch.from_numpy(terms[present]) if mechanism.wants_term else None, torch.from_numpy(xis))
            blocks = levels.view(count, 2)
            blocks[torch.from_numpy(present)] = lattice.quantize(rows)
            norms = stats.norms_before_clip
        noisy, sum_std = mechanism.add_noise(levels, lattice, randomness.noise, len(present))
        if strategy.adaptive_clipping is not None:
            strategy.adaptive_clipping.step(list(norms), cohort, randomness.noise)
        strategy.accountant.compose_round()
        total += noisy.numpy() / cohort
        recorder.observe(total.copy(), sum_std, min(canaries.norm, mechanism.clipping_norm * CLIP_GUARD), cohort)
    return RunOutcome(recorder.observation(canaries, config.sampling_rate, relation), strategy.accountant.epsilon())


def run_secure(config: RunConfig, canaries: CanarySet, hook: StrategyHook | None = None) -> RunOutcome:
    """One run of secure aggregation's rounds: the clients' steps, the sum mod M, the server's release."""
    from ..secure_aggregation.server import SecureSum

    relation = relation_of(config)
    dimension = canaries.dimension
    strategy = _strategy(config, dimension, hook)
    mechanism, secure = strategy.mechanism, strategy.secure_aggregation
    if secure is None:
        raise ValueError("run_secure needs a config with secure-aggregation on")
    lattice, noise = secure.lattice, secure.noise
    arrays = ArrayRecord({ARRAY_KEY: torch.zeros(dimension, dtype=torch.float32)})
    recorder = _Recorder(len(canaries.labels), _flat(arrays))
    seed = None if config.privacy_seed < 0 else config.privacy_seed
    cohort_size = config.expected_cohort
    for server_round in range(1, config.rounds + 1):
        cohort = strategy.begin_round(server_round, arrays)
        residues = np.zeros(dimension, dtype=np.uint64)
        known = np.zeros(dimension, dtype=np.int64)  # noise shares of the clients the accountant does not count
        present = [slot for slot in sorted(cohort.values()) if canaries.sign(slot, relation)]
        uncounted = 0 if noise is None else max(0, len(present) - noise.shares)
        for rank, slot in enumerate(present):
            sign = canaries.sign(slot, relation)
            bits = client_bits(seed, server_round, slot, stream=1)
            terms = canaries.term(slot)[None] if mechanism.wants_term else None
            xis = (mechanism.xis(bits, 1, [0]) if seed is None else  # as the ClientApp's secure_contribution
                   mechanism.xis(PrivacyRandomness(seed).for_round(server_round).mixing, config.population, [slot]))
            rows, _ = mechanism.constrain_sensitivity(canaries.update(slot, sign)[None], terms, torch.from_numpy(xis))
            levels = lattice.stochastic_round(rows[0], bits)
            if noise is not None:
                share = noise.sample(bits)
                levels = levels + share
                if rank < uncounted:
                    known += share
            residues = (residues + lattice.encode(levels)) & np.uint64(lattice.modulus - 1)
        result = SecureSum(lattice.decode_sum(residues), lattice, len(present))
        arrays, _ = strategy.finish_secure_round(server_round, result)
        if noise is None:
            sum_std = strategy.round_record.noise_std * cohort_size
        else:
            sum_std = math.sqrt(len(present) - uncounted) * noise.local_std * lattice.granularity
        recorder.observe(_flat(arrays), sum_std, min(canaries.norm, config.clipping_norm * CLIP_GUARD), cohort_size,
                         known.astype(np.float64) * lattice.granularity)
    return RunOutcome(recorder.observation(canaries, config.sampling_rate, relation), strategy.accountant.epsilon())


def run_flower_dp(config: RunConfig, canaries: CanarySet, hook: StrategyHook | None = None) -> RunOutcome:
    """One run of Flower's accounted DP wrapper over FedAvg, its clients replying θ + canary."""
    from flwr.clientapp import ClientApp

    from ..engines.inprocess import InProcessGrid
    from ..flower_baseline import build_flower_dp_strategy, flower_dp_reply

    relation = relation_of(config)
    client = ClientApp()

    @client.train()
    def reply(msg: Message, context: Context) -> Message:
        slot = int(context.node_config["partition-id"])
        state = msg.content.array_records["arrays"].to_torch_state_dict()
        sign = canaries.sign(slot, relation)
        # Flower's clipping divides by the update's norm: an absent canary sends a negligible one instead of 0
        update = canaries.update(slot, sign) if sign else IDLE_SHARE * config.clipping_norm * canaries.term(
            slot % len(canaries.labels))  # ⊥ every canary's direction
        return flower_dp_reply(msg, state, {ARRAY_KEY: update}, config.server_learning_rate, 0.0)

    grid = InProcessGrid(client, config.population, config.to_mapping())
    strategy = build_flower_dp_strategy(config)
    accountant = strategy.accountant
    if accountant is None:  # build_flower_dp_strategy gives the wrapper one
        raise RuntimeError("the flower-dp baseline's wrapper has no accountant")
    initial = ArrayRecord({ARRAY_KEY: torch.zeros(canaries.dimension, dtype=torch.float32)})
    recorder = _Recorder(len(canaries.labels), _flat(initial))
    cohort = config.expected_cohort
    sum_std = config.noise_multiplier * config.clipping_norm

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round > 0:
            recorder.observe(_flat(arrays), sum_std, min(canaries.norm, config.clipping_norm), cohort)
        return None

    strategy.start(grid, initial, num_rounds=config.rounds, timeout=config.round_timeout, evaluate_fn=evaluate)
    return RunOutcome(recorder.observation(canaries, config.sampling_rate, relation),
                      accountant.get_epsilon(config.delta))


DPSGD_FEATURE = 1000.0  # a canary record's feature: its gradient is far longer than any clipping norm
DPSGD_LEARNING_RATE = 1e-3  # small steps keep the canaries' gradients saturated (p ≈ ½), so their direction is fixed


def run_dpsgd(config: RunConfig, canaries: CanarySet, hook: StrategyHook | None = None) -> RunOutcome:
    """One client's DP-SGD over canary records: record j has feature ``DPSGD_FEATURE``·e_j (or 0 when out), label 0.

    The model is a bias-free linear layer to two classes: record j's gradient
    is (p − e₀)·x_jᵀ, non-zero only in column j, along (−1, 1)/√2 whatever the
    weights, and clipped to C. An out-record has x = 0 and no gradient (it is
    removed; keeping it keeps the batch sampling rate q = batch/records). Every
    step's weights are read by a forward pre-hook; the step's release is
    (W_t − W_t+1)·B/η, the noisy sum of clipped gradients.
    """
    from ..data import ArrayData
    from ..dpsgd import train_dpsgd

    count = len(canaries.labels)
    x = np.zeros((count, count), dtype=np.float32)
    x[np.arange(count), np.arange(count)] = np.where(canaries.labels, DPSGD_FEATURE, 0.0)
    data = ArrayData(x, np.zeros(count, dtype=np.int64))
    model = torch.nn.Linear(count, 2, bias=False)
    torch.nn.init.zeros_(model.weight)
    seen: list[np.ndarray] = []
    handle = model.register_forward_pre_hook(lambda module, inputs: seen.append(
        module.weight.detach().to(torch.float64).numpy().copy()))
    settings = config.dpsgd_settings
    bits = client_bits(None if config.privacy_seed < 0 else config.privacy_seed, 1, 0)
    try:
        _, privacy = train_dpsgd(model, data, config.local_epochs, config.batch_size, DPSGD_LEARNING_RATE, 0.0,
                                 bits, settings)
    finally:
        handle.remove()
    seen.append(model.weight.detach().to(torch.float64).numpy().copy())
    batch = min(config.batch_size, count)
    sum_std = settings.noise_multiplier * (settings.max_grad_norm + 2 * _dpsgd_rounding_slack(settings, 2 * count))
    recorder = _Recorder(count, np.zeros(2 * count))
    # A step moves W by −η·(noisy sum)/B; record j's gradient points along −c in column j (= block j), so
    # W·B/η moves by the noisy sum with the sign that puts the canary along +c.
    for weights in seen[1:]:
        recorder.observe(weights.T.reshape(-1) * batch / DPSGD_LEARNING_RATE, sum_std, settings.max_grad_norm, 1.0)
    return RunOutcome(recorder.observation(canaries, min(1.0, config.batch_size / count), "add-remove"),
                      privacy.epsilon)


def _dpsgd_rounding_slack(settings: DpSgdSettings, dimension: int) -> float:
    """g√d/2 of the lattice DP-SGD's noise lives on (``fedhog.dpsgd.lattice_noisy_sum``'s)."""
    lattice = NoiseLattice.for_settings(GaussianMechanism(settings.max_grad_norm, settings.noise_multiplier), dimension)
    return lattice.rounding_slack


HARNESSES: dict[str, Callable[[RunConfig, CanarySet, StrategyHook | None], RunOutcome]] = {
    "vectorized": run_batched, "strategy": run_trusted, "secure": run_secure, "flower-dp": run_flower_dp,
    "dpsgd": run_dpsgd}
