"""One typed run configuration, validated once at the edge.

The CLI, the Flower apps and the experiment scripts all turn a flat mapping of
Flower-style kebab-case keys (``noise-multiplier = 1.0``) into a
:class:`RunConfig`; every error names the key, the value and what is allowed.
The defaults here are the ``[tool.flwr.app.config]`` of ``pyproject.toml``.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .aggregators import aggregator_of
from .choices import (
    ACCOUNTANTS,
    ACTIVATIONS,
    AGGREGATORS,
    BINARY_METRICS,
    CLIENT_DP,
    CLIPPING_MECHANISMS,
    DEFAULT_ACTIVATION,
    DEFAULT_NORMALIZATION,
    DEVICES,
    DPSGD_ACCOUNTANTS,
    DPSGD_NOISE,
    HOG_DIRECTIONS,
    HOG_MIXINGS,
    HOG_TERMS,
    MAX_MODULUS_BITS,
    MECHANISMS,
    MIN_MODULUS_BITS,
    MODELS,
    NOISE,
    NORMALIZATIONS,
    OPTIMIZERS,
    PARTITIONERS,
    PRIVACY_LEVEL_KEYS,
    SAMPLING_METHODS,
    SECURE_AGGREGATION,
    SERVER_OPTIMIZERS,
    SERVER_STEPS,
    TABULAR_FORMATS,
    TERM_MECHANISMS,
    TEST_METRICS,
    AccountantName,
    ActivationName,
    AggregatorName,
    ClientDp,
    Device,
    DpSgdAccountant,
    DpSgdNoise,
    HogDirection,
    HogMixing,
    HogTerm,
    LocalOptimizer,
    MechanismName,
    NoiseSource,
    NormalizationName,
    PartitionerName,
    SamplingKind,
    SecureAggregationMode,
    ServerOptimizerKind,
    ServerStepKind,
    is_factory,
)
from .data import DataSpec, validate_spec
from .settings import DpSgdSettings

if TYPE_CHECKING:  # the settings a run builds: their modules load torch, so they are imported when built
    from .privacy.adaptive_clipping import AdaptiveClippingSettings
    from .privacy.mechanism import Mechanism
    from .secure_aggregation.distributed_noise import DistributedNoise
    from .secure_aggregation.quantization import ModularLattice
    from .server_optimizer import ServerOptimizerSettings
    from .server_step import ServerStepSettings


class ConfigError(ValueError):
    """A configuration value that fedhog cannot run with."""


NO_TARGET_EPSILON = -1.0  # target-epsilon's "no calibration": σ is noise-multiplier (a run config holds scalars only)


@dataclass(frozen=True)
class RunConfig:
    """Everything a fedhog run depends on. Field ``x_y`` is config key ``x-y``; a closed choice's field has its
    ``Literal`` type (:mod:`fedhog.choices`), which :meth:`validate` makes true."""

    # data
    dataset: str = "mnist1d"
    num_samples: int = 20000
    partitioner: PartitionerName = "dirichlet"
    dirichlet_alpha: float = 0.5
    classes_per_client: int = 2
    validation_fraction: float = 0.1
    server_validation_fraction: float = 0.0
    proxy_fraction: float = 0.0
    population: int = 1000
    label_column: str = ""
    feature_columns: str = ""
    client_column: str = ""
    metrics: str = "accuracy"
    # model and local training
    model: str = "cnn1d"
    activation: ActivationName = DEFAULT_ACTIVATION  # of the built-in models' hidden layers (fedhog.models.ACTIVATIONS)
    normalization: NormalizationName = DEFAULT_NORMALIZATION  # of the same layers (fedhog.models.NORMALIZATIONS)
    local_epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 0.05
    momentum: float = 0.0
    optimizer: LocalOptimizer = "sgd"
    device: Device = "auto"
    # federation
    rounds: int = 30
    sampling: SamplingKind = "poisson"
    sampling_rate: float = 0.1
    server_learning_rate: float = 1.0
    server_optimizer: ServerOptimizerKind = "sgd"
    server_momentum: float = 0.9
    server_beta2: float = 0.99
    server_tau: float = 1e-3
    server_step: ServerStepKind = "none"
    server_step_max: float = 4.0
    round_timeout: float = 600.0
    max_update_norm: float = math.inf
    shards: int = 1  # the vectorized engine's workers (fedhog.engines.shards): 1 in this process, more on Ray
    # privacy
    aggregator: AggregatorName = "fedhog"
    mechanism: MechanismName = "hog"
    clipping_norm: float = 1.0
    noise_multiplier: float = 1.0
    target_epsilon: float = -1.0  # NO_TARGET_EPSILON: σ is noise-multiplier; > 0: σ calibrated to this ε
    mixing_strength: float = 0.5
    adaptive_clipping: bool = False
    target_quantile: float = 0.5
    clipping_learning_rate: float = 0.2
    count_noise_std: float = -1.0
    hog_direction: HogDirection = "random"
    hog_term: HogTerm = "third-order"
    hog_batch_size: int = 32
    hog_mixing: HogMixing = "random-sign"
    noise_aware_strength: float = 1.0  # κ of hog-mixing = "noise-aware" (fedhog.privacy.noise_aware)
    noise_aware_samples: int = 1  # Hutchinson's directions a client's ∇tr∇²L estimate averages
    accountant: AccountantName = "pld"
    delta: float = 1e-5
    max_epsilon: float = math.inf
    client_dp: ClientDp = "none"
    dpsgd_noise_multiplier: float = 1.0
    dpsgd_max_grad_norm: float = 1.0
    dpsgd_delta: float = 1e-5
    dpsgd_accountant: DpSgdAccountant = "prv"
    dpsgd_noise: DpSgdNoise = "fedhog"
    secure_aggregation: SecureAggregationMode = "off"
    secagg_num_shares: int = 0
    secagg_threshold: float = 0.66
    secagg_modulus_bits: int = 32
    noise: NoiseSource = "central"
    # reproducibility and output
    seed: int = 0
    privacy_seed: int = -1
    results_dir: str = ""
    resume: bool = False
    metrics_port: int = -1

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> RunConfig:
        """Build and validate a config from kebab-case keys (unknown keys are errors)."""
        known = {f.name.replace("_", "-"): f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(unknown_key_message(key, known))
            kwargs[known[key].name] = _coerce(key, value, type(getattr(cls(), known[key].name)))
        config = cls(**kwargs)
        config.validate()
        try:
            validate_spec(config.data_spec)
        except ValueError as error:
            raise ConfigError(str(error)) from None
        return config

    def with_overrides(self, values: Mapping[str, Any]) -> RunConfig:
        """A validated copy with some keys replaced."""
        return RunConfig.from_mapping({**self.to_mapping(), **values})

    def to_mapping(self) -> dict[str, Any]:
        """Kebab-case keys, as Flower's run config and the TOML files hold them."""
        return {f.name.replace("_", "-"): getattr(self, f.name) for f in fields(self)}

    # --- derived views -----------------------------------------------------
    @property
    def data_spec(self) -> DataSpec:
        """The data this run trains and evaluates on: the :class:`~fedhog.data.DataSpec` fields of the same names
        (all but ``test_fraction``, which keeps its default)."""
        return DataSpec(**{name: getattr(self, name) for name in _DATA_FIELDS})

    @property
    def test_metrics(self) -> tuple[str, ...]:
        """The ``metrics`` to evaluate the global model with, in the order given (accuracy always included)."""
        names = tuple(dict.fromkeys(n.strip() for n in self.metrics.split(",")))
        return names if "accuracy" in names else ("accuracy", *names)

    @property
    def privacy_mechanism(self) -> Mechanism:
        """The ``mechanism`` (:data:`~fedhog.privacy.mechanism.MECHANISM_REGISTRY`) with C, σ, γ and central noise:
        what each contribution goes through. A run's rounds apply :meth:`mechanism_for`."""
        from .privacy.mechanism import build_mechanism  # torch
        from .privacy.noise_aware import NoiseAwareMixing

        noise_aware = None
        if self.hog_mixing == "noise-aware":
            momentum = self.server_momentum if self.server_optimizer == "momentum" else 0.0
            noise_aware = NoiseAwareMixing(self.noise_aware_strength, self.server_learning_rate, momentum,
                                           self.expected_cohort)
        return build_mechanism(self.mechanism, self.clipping_norm, self.noise_multiplier, self.mixing_strength,
                               noise_aware)

    def mechanism_for(self, dimension: int) -> Mechanism:
        """The mechanism of this run's rounds: :attr:`privacy_mechanism`, or with ``noise = "distributed"`` that
        mechanism with the clients' noise shares (their plan, :meth:`secure_plan`, needs the model's dimension d)."""
        if self.noise != "distributed":
            return self.privacy_mechanism
        from .secure_aggregation.distributed_noise import DistributedGaussian  # torch

        return DistributedGaussian(self.privacy_mechanism, self.distributed_noise(dimension))

    @property
    def adaptive_clipping_settings(self) -> AdaptiveClippingSettings | None:
        """Adaptive clipping starting at ``clipping-norm``, or None when off."""
        return self._adaptive_clipping() if self.adaptive_clipping else None

    def _adaptive_clipping(self) -> AdaptiveClippingSettings:
        """The adaptive clipping the ``adaptive-clipping`` keys describe, whether it is on or not."""
        from .privacy.adaptive_clipping import AdaptiveClippingSettings, default_count_noise_std  # torch

        count_std = default_count_noise_std(self.expected_cohort) if self.count_noise_std < 0 else self.count_noise_std
        return AdaptiveClippingSettings(initial_clipping_norm=self.clipping_norm, count_noise_std=count_std,
                                        target_quantile=self.target_quantile,
                                        learning_rate=self.clipping_learning_rate)

    @property
    def dpsgd_settings(self) -> DpSgdSettings:
        """Record-level DP-SGD on the clients (used when ``client-dp = "dpsgd"``)."""
        return DpSgdSettings(self.dpsgd_noise_multiplier, self.dpsgd_max_grad_norm,
                             self.dpsgd_delta, self.dpsgd_accountant, self.dpsgd_noise)

    @property
    def server_optimizer_settings(self) -> ServerOptimizerSettings:
        """How the server applies each release (post-processing)."""
        from .server_optimizer import ServerOptimizerSettings  # torch

        return ServerOptimizerSettings(self.server_optimizer, self.server_learning_rate, self.server_momentum,
                                       self.server_beta2, self.server_tau)

    @property
    def server_step_settings(self) -> ServerStepSettings:
        """The step length the server takes along its optimizer's step (``server-step``)."""
        from .server_step import ServerStepSettings

        return ServerStepSettings(self.server_step, self.server_step_max)

    @property
    def expected_cohort(self) -> int:
        """K = q·N."""
        return round(self.sampling_rate * self.population)

    @property
    def largest_cohort(self) -> int:
        """The most clients a round can sample: N under Poisson sampling, K under fixed-size sampling."""
        return self.population if self.sampling == "poisson" else self.expected_cohort

    def secure_plan(self, dimension: int) -> tuple[ModularLattice, DistributedNoise | None]:
        """The lattice of every secure round and, with ``noise = "distributed"``, the noise plan.

        Both follow from public config (and the model's dimension d) only, so the
        server and every client compute the same: g never depends on who was sampled.

        Raises
        ------
        ConfigError
            Naming ``secagg-modulus-bits`` and the bits needed, when no granularity
            leaves 2 levels per contribution for the largest cohort and its noise.
        """
        from .secure_aggregation.quantization import ModularLattice  # torch

        if self.noise != "distributed":
            return ModularLattice.for_cohort(self.clipping_norm, self.largest_cohort, self.secagg_modulus_bits), None
        noise = self.distributed_noise(dimension)
        return noise.lattice, noise

    def distributed_noise(self, dimension: int) -> DistributedNoise:
        """The clients' noise plan of ``noise = "distributed"`` (:meth:`secure_plan`'s second half), with its lattice.

        Raises
        ------
        ConfigError
            As :meth:`secure_plan` says.
        """
        from .secure_aggregation.distributed_noise import plan_distributed_noise  # dp_accounting, scipy

        def plan(bits: int) -> DistributedNoise:
            return plan_distributed_noise(self.clipping_norm, dimension, bits, self.expected_cohort,
                                          self.secagg_threshold, self.rounds, self.delta, self.target_epsilon,
                                          self.noise_multiplier)

        try:
            return plan(self.secagg_modulus_bits)
        except ValueError as error:
            needed = next((b for b in range(self.secagg_modulus_bits + 1, MAX_MODULUS_BITS + 1)
                           if _plans(plan, b)), None)
            raise ConfigError(
                f"secagg-modulus-bits={self.secagg_modulus_bits} is not allowed with noise=\"distributed\" and a model "
                f"of {dimension} parameters: {error}; expected "
                + (f"≥ {needed} bits" if needed else f"at most {MAX_MODULUS_BITS} bits, which do not suffice either")
            ) from None

    # --- validation --------------------------------------------------------
    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first bad key (the dataset is checked by :mod:`fedhog.data`)."""
        _choice("partitioner", self.partitioner, PARTITIONERS)
        if self.model not in MODELS and not is_factory(self.model):
            raise ConfigError(f"model={self.model!r} is not allowed; expected one of {', '.join(MODELS)} or "
                              "'package.module:factory', a callable factory(input_shape, num_classes) returning "
                              "a torch.nn.Module")
        _choice("activation", self.activation, tuple(ACTIVATIONS))
        _choice("normalization", self.normalization, NORMALIZATIONS)
        for name in self.test_metrics:
            _check("metrics", self.metrics, name in TEST_METRICS,
                   f"comma-separated names among {', '.join(TEST_METRICS)} ({name!r} is not one)")
        _choice("aggregator", self.aggregator, AGGREGATORS)
        _choice("mechanism", self.mechanism, MECHANISMS)
        _choice("sampling", self.sampling, SAMPLING_METHODS)
        _choice("hog-direction", self.hog_direction, HOG_DIRECTIONS)
        _choice("hog-term", self.hog_term, HOG_TERMS)
        _choice("hog-mixing", self.hog_mixing, HOG_MIXINGS)
        _choice("accountant", self.accountant, ACCOUNTANTS)
        _choice("device", self.device, DEVICES)
        _choice("optimizer", self.optimizer, OPTIMIZERS)
        _choice("client-dp", self.client_dp, CLIENT_DP)
        _choice("dpsgd-accountant", self.dpsgd_accountant, DPSGD_ACCOUNTANTS)
        _choice("dpsgd-noise", self.dpsgd_noise, DPSGD_NOISE)
        _choice("server-optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        _choice("server-step", self.server_step, SERVER_STEPS)
        if self.server_step != "none" and self.proxy_fraction == 0:
            raise ConfigError(f"server-step={self.server_step!r} needs proxy-fraction > 0: the step length comes "
                              "from derivatives of the loss on proxy data the server holds (proxy-fraction=0)")
        for key in ("server-momentum", "server-beta2"):
            _check(key, self._get(key), 0 <= self._get(key) < 1, "a number in [0, 1)")
        try:
            self.dpsgd_settings  # noqa: B018 -- the property validates the DP-SGD keys
        except ValueError as error:  # "dpsgd: max_grad_norm=0.0 ..." names the field: name the config key
            field = str(error).removeprefix("dpsgd: ").split("=")[0]
            raise ConfigError(str(error).replace(f"dpsgd: {field}", "dpsgd-" + field.replace("_", "-"), 1)) from None
        if self.client_dp == "dpsgd" and (self.mechanism in TERM_MECHANISMS or self.optimizer == "hog-step"):
            raise ConfigError(f"client-dp='dpsgd' cannot be combined with mechanism={self.mechanism!r} / "
                              f"optimizer={self.optimizer!r}: they send or use derivatives of the raw records, "
                              "which the per-record ε does not cover")
        for key in ("num-samples", "population", "local-epochs", "batch-size", "rounds",
                    "hog-batch-size", "noise-aware-samples", "classes-per-client", "shards"):
            _check(key, self._get(key), self._get(key) >= 1, "an integer ≥ 1")
        for key in ("dirichlet-alpha", "learning-rate", "server-learning-rate", "server-tau", "server-step-max",
                    "clipping-norm",
                    "round-timeout"):
            value = self._get(key)
            _check(key, value, math.isfinite(value) and value > 0, "a finite number > 0")
        for key in ("noise-multiplier", "mixing-strength", "noise-aware-strength", "momentum"):
            value = self._get(key)
            _check(key, value, math.isfinite(value) and value >= 0, "a finite number ≥ 0")
        _check("validation-fraction", self.validation_fraction, 0 <= self.validation_fraction < 1, "a number in [0, 1)")
        for key in ("server-validation-fraction", "proxy-fraction"):
            value = self._get(key)
            _check(key, value, 0 <= value < 0.5, "a number in [0, 0.5): the share of all examples the server holds")
            _check(key, value, value == 0 or not self.dataset.startswith("synthetic"),
                   "0 for synthetic data, where every example belongs to a client")
        _check("sampling-rate", self.sampling_rate, 0 < self.sampling_rate <= 1, "a number in (0, 1]")
        cohort = self.sampling_rate * self.population
        _check("sampling-rate", self.sampling_rate, abs(cohort - round(cohort)) < 1e-6 and round(cohort) >= 1,
               f"a rate whose expected cohort sampling-rate × population ({cohort:g} for population={self.population}) "
               "is a whole number ≥ 1")
        if self.adaptive_clipping:
            self._validate_adaptive_clipping()
        if self.hog_mixing == "noise-aware":
            self._validate_noise_aware()
        _check("delta", self.delta, 0 < self.delta < 1, "a number in (0, 1)")
        _check("delta", self.delta, self.delta < 1 / self.population,
               f"δ < 1/population = {1 / self.population:g} (a larger δ allows leaking one client outright)")
        self._validate_target_epsilon()
        _check("max-epsilon", self.max_epsilon, self.max_epsilon > 0 and not math.isnan(self.max_epsilon),
               "a number > 0 or inf")
        _check("max-update-norm", self.max_update_norm,
               self.max_update_norm > 0 and not math.isnan(self.max_update_norm), "a number > 0 or inf")
        if math.isfinite(self.max_epsilon) and not self.privacy_mechanism.has_guarantee and not self.target_epsilon > 0:
            raise ConfigError(
                f"max-epsilon={self.max_epsilon:g} cannot be met: mechanism={self.mechanism!r} with "
                f"noise-multiplier={self.noise_multiplier:g} has no DP guarantee (ε = ∞)"
            )
        _check("metrics-port", self.metrics_port, -1 <= self.metrics_port <= 65535,
               "-1 (no HTTP endpoint), 0 (any free port) or a port 1..65535 (bound to 127.0.0.1)")
        _check("privacy-seed", self.privacy_seed, self.privacy_seed >= -1, "-1 (OS entropy) or a seed ≥ 0")
        self._validate_aggregator()
        _choice("secure-aggregation", self.secure_aggregation, SECURE_AGGREGATION)
        _choice("noise", self.noise, NOISE)
        if self.noise == "distributed" and self.secure_aggregation != "secagg+":
            raise ConfigError(f"noise={toml_value(self.noise)} is not allowed with secure-aggregation="
                              f"{toml_value(self.secure_aggregation)}; expected noise=\"central\", or "
                              "secure-aggregation=\"secagg+\" (the clients' noise shares must be summed under masks)")
        # the SecAgg+ settings' ranges whether or not secure aggregation is on: a bad value is a mistake either way
        _check("secagg-num-shares", self.secagg_num_shares, self.secagg_num_shares == 0 or self.secagg_num_shares >= 3,
               "0 (the whole cohort) or an integer ≥ 3")
        _check("secagg-threshold", self.secagg_threshold, 0 < self.secagg_threshold <= 1, "a number in (0, 1]")
        _check("secagg-modulus-bits", self.secagg_modulus_bits,
               MIN_MODULUS_BITS <= self.secagg_modulus_bits <= MAX_MODULUS_BITS,
               f"an integer in {MIN_MODULUS_BITS}..{MAX_MODULUS_BITS}")
        if self.secure_aggregation != "off":
            self._validate_secure_aggregation()

    def check_metrics(self, num_classes: int) -> None:
        """AUROC and AUPRC rank the examples of a binary label: refuse them for more classes."""
        ranking = [name for name in self.test_metrics if name in BINARY_METRICS]
        if ranking and num_classes != 2:
            raise ConfigError(f"metrics={self.metrics!r} is not allowed for dataset={self.dataset!r}: "
                              f"{', '.join(ranking)} need a binary label and it has {num_classes} classes; "
                              "expected metrics = \"accuracy\"")

    @property
    def calibration_inputs(self) -> tuple[Any, ...]:
        """Everything :meth:`calibrated` reads: configs equal here get the same σ."""
        return (self.aggregator, self.target_epsilon, self.delta, self.rounds, self.sampling, self.sampling_rate,
                self.population, self.accountant, self.expected_cohort)

    def calibrated(self) -> RunConfig:
        """This config with σ calibrated to ``target-epsilon`` (itself when that is off).

        The smallest σ whose ε after ``rounds`` releases at ``delta`` is within
        the target, for this sampling and accountant (a bisection on the accountant);
        as the config's aggregator accounts it (:meth:`fedhog.aggregators.Aggregator.calibrate`; Flower's
        wrapper: RDP, no amplification).
        With ``noise = "distributed"`` itself: the clients' σ_l is calibrated with the lattice
        (:meth:`secure_plan`), which needs the model's dimension.
        """
        if not self.target_epsilon > 0 or self.noise == "distributed":  # distributed: with the lattice (secure_plan)
            return self
        sigma = aggregator_of(self).calibrate(
            target_epsilon=self.target_epsilon, delta=self.delta, rounds=self.rounds, sampling=self.sampling,
            sampling_rate=self.sampling_rate, population=self.population, accountant=self.accountant,
            expected_cohort=self.expected_cohort)
        return dataclasses.replace(self, noise_multiplier=sigma)

    def _validate_target_epsilon(self) -> None:
        """``target-epsilon``: -1 (:data:`NO_TARGET_EPSILON`) or a finite ε > 0 that a noising mechanism can meet."""
        value = self.target_epsilon
        _check("target-epsilon", value, value == NO_TARGET_EPSILON or (math.isfinite(value) and value > 0),
               f"a finite ε > 0 to calibrate σ to, or {NO_TARGET_EPSILON:g} for no calibration (σ = noise-multiplier)"
               + ("; 0 is not 'off': no σ reaches ε = 0" if value == 0 else ""))
        if value > 0 and self.mechanism not in CLIPPING_MECHANISMS:
            raise ConfigError(
                f"target-epsilon={value:g} stands in the way of mechanism={self.mechanism!r}, which adds no noise, so "
                f"no σ meets an ε target; unset it (--set target-epsilon={NO_TARGET_EPSILON:g}, or target-epsilon = "
                f"{NO_TARGET_EPSILON:g} in the file) or choose mechanism {_either(CLIPPING_MECHANISMS)}")

    def _validate_noise_aware(self) -> None:
        """``hog-mixing = "noise-aware"``: τ and λ are derived for SGD or FedAvgM on the server, no server step,
        local heavy-ball momentum < 1, and Hutchinson's random directions (:mod:`fedhog.privacy.noise_aware`)."""
        key = 'with hog-mixing="noise-aware"'
        _check("server-optimizer", self.server_optimizer, self.server_optimizer in ("sgd", "momentum"),
               f"sgd or momentum {key} (τ, the noise the model carries, is derived for them; adam and yogi "
               "rescale every coordinate by its history)")
        _check("server-step", self.server_step, self.server_step == "none",
               f"none {key} (a server step rescales the release, and with it τ)")
        _check("momentum", self.momentum, self.momentum < 1, f"a number in [0, 1) {key} (λ sums its velocity)")
        _check("hog-direction", self.hog_direction, self.hog_direction == "random",
               f"random {key} (Hutchinson's directions must have E[v vᵀ] = I; the update's does not)")

    def _validate_aggregator(self) -> None:
        """The keys the aggregator fixes (Flower's accounted wrapper runs one mechanism, sampling and accountant)."""
        aggregator = aggregator_of(self)
        for key, allowed in aggregator.requires.items():
            if self._get(key) != allowed:
                raise ConfigError(
                    f"aggregator={self.aggregator!r} needs {key}={toml_value(allowed)}, got {key}="
                    f"{toml_value(self._get(key))} ({aggregator.requirement})")
        if aggregator.needs_noise and self.noise_multiplier == 0 and not self.target_epsilon > 0:
            raise ConfigError(f"aggregator={self.aggregator!r} needs noise-multiplier > 0 or a target-epsilon "
                              "(Flower's accountant refuses σ = 0)")

    def _validate_secure_aggregation(self) -> None:
        """Under SecAgg+ the server sees only the sum: what needs individual replies is refused."""
        required = {"aggregator": ("fedhog", "Flower's DP baseline receives every update"),
                    "client-dp": ("none", "DP-SGD clients are not wired to the secure stages yet"),
                    "adaptive-clipping": (False, "it needs every contribution's norm (a secure count is not built)"),
                    "max-update-norm": (math.inf, "the server cannot see a contribution's norm; clients clip to "
                                        "clipping-norm and the modulus bounds what any reply can do")}
        for key, (allowed, why) in required.items():
            if self._get(key) != allowed:
                raise ConfigError(f"secure-aggregation={toml_value(self.secure_aggregation)} needs {key}="
                                  f"{toml_value(allowed)}, got {key}={toml_value(self._get(key))}: {why}")
        if self.mechanism not in CLIPPING_MECHANISMS:
            raise ConfigError(f"secure-aggregation={toml_value(self.secure_aggregation)} needs mechanism "
                              f"{_either(CLIPPING_MECHANISMS)}: clients must clip to clipping-norm before quantising "
                              f"(mechanism={self.mechanism!r} sends unbounded, example-weighted updates)")
        if self.sampling == "fixed" and self.expected_cohort < 2:
            raise ConfigError(f"secure-aggregation={toml_value(self.secure_aggregation)} needs a cohort of ≥ 2: "
                              f"sampling-rate × population = {self.expected_cohort} (SecAgg+ cannot hide one client)")
        largest = self.largest_cohort
        _check("secagg-modulus-bits", self.secagg_modulus_bits,
               (2 ** (self.secagg_modulus_bits - 1) - 1) // largest > 2,
               f"enough bits for a cohort of up to {largest} clients (≥ {math.ceil(math.log2(6 * largest))})")
        if self.noise == "distributed":
            self._validate_distributed_noise()

    def _validate_distributed_noise(self) -> None:
        """Clients' noise needs a noise level and fixed-size cohorts
        (see :mod:`fedhog.privacy.distributed_gaussian`)."""
        if self.noise_multiplier == 0 and not self.target_epsilon > 0:
            raise ConfigError("noise=\"distributed\" needs noise-multiplier > 0 or a target-epsilon "
                              "(noise-multiplier=0.0: the clients would add no noise)")
        if self.sampling != "fixed":
            raise ConfigError(f"noise=\"distributed\" is not allowed with sampling={toml_value(self.sampling)}; "
                              "expected sampling=\"fixed\": under Poisson sampling a client brings its own noise "
                              "share or not, so neighbouring outputs differ in their noise as well, which the "
                              "distributed discrete Gaussian's accounting does not bound")

    def _validate_adaptive_clipping(self) -> None:
        if self.mechanism not in CLIPPING_MECHANISMS:
            raise ConfigError(f"adaptive-clipping=true needs mechanism {_either(CLIPPING_MECHANISMS)} "
                              f"(mechanism={self.mechanism!r} does not clip)")
        _check("target-quantile", self.target_quantile, 0 < self.target_quantile < 1, "a number in (0, 1)")
        _check("clipping-learning-rate", self.clipping_learning_rate,
               math.isfinite(self.clipping_learning_rate) and self.clipping_learning_rate > 0, "a finite number > 0")
        _check("count-noise-std", self.count_noise_std,
               self.count_noise_std == -1 or (math.isfinite(self.count_noise_std) and self.count_noise_std >= 0),
               "-1 (expected cohort / 20) or a finite number ≥ 0")
        count_std = self._adaptive_clipping().count_noise_std
        if self.noise_multiplier > 0 and not count_std > self.noise_multiplier / 2:
            raise ConfigError(f"count-noise-std={self.count_noise_std!r} (σ_b = {count_std:g}) must exceed "
                              f"noise-multiplier/2 = {self.noise_multiplier / 2:g}; raise it or lower noise-multiplier")

    def _get(self, key: str) -> Any:
        return getattr(self, key.replace("-", "_"))


_DATA_FIELDS = tuple(f.name for f in fields(DataSpec) if f.name in {f.name for f in fields(RunConfig)})


def load_config(path: str | Path | Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None,
                notes: list[str] | None = None) -> RunConfig:
    """Read a TOML run config (flat keys, or under ``[tool.flwr.app.config]``, or a mapping) and apply overrides.

    A table dataset's relative path is made absolute against the working directory.

    σ (``noise-multiplier``) and ``target-epsilon`` (which calibrates σ) exclude
    each other: one source (the file, or the overrides) that sets both is refused.
    An override of one replaces the file's other; when that happens a sentence
    saying so is appended to ``notes`` (the CLI prints it).
    """
    values: dict[str, Any] = {}
    overrides = dict(overrides or {})
    if isinstance(path, Mapping):
        values = dict(path)
    elif path is not None:
        document = read_toml(path)
        values = document.get("tool", {}).get("flwr", {}).get("app", {}).get("config", document)
    for source in (values, overrides):
        if _sets_target(source) and "noise-multiplier" in source:
            raise ConfigError(f"noise-multiplier={source['noise-multiplier']!r} and target-epsilon="
                              f"{source['target-epsilon']!r} are both set: give σ, "
                              "or the ε to calibrate σ for, not both")
    replaced = {}  # the file's σ when an override asks to calibrate, the file's target when an override gives σ
    if _sets_target(overrides) and "noise-multiplier" in values:
        replaced["noise-multiplier"] = values["noise-multiplier"]
    if "noise-multiplier" in overrides and _sets_target(values):
        replaced["target-epsilon"] = values["target-epsilon"]
    if replaced:
        given = ", ".join(f"{k}={toml_value(overrides[k])}" for k in PRIVACY_LEVEL_KEYS if k in overrides)
        dropped = ", ".join(f"{k}={toml_value(v)}" for k, v in replaced.items())
        if notes is not None:
            notes.append(f"{given} (override) replaces {dropped} of {path}: an override of σ or of "
                         "target-epsilon takes the place of the file's other")
        values = {k: v for k, v in values.items() if k not in replaced}
    return with_absolute_dataset(RunConfig.from_mapping({**values, **overrides}))


def _sets_target(values: Mapping[str, Any]) -> bool:
    """Whether ``values`` ask to calibrate σ: a ``target-epsilon`` > 0 (-1 is off; 0 and others
    :meth:`RunConfig.validate` refuses, naming them)."""
    value = values.get("target-epsilon", NO_TARGET_EPSILON)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def with_absolute_dataset(config: RunConfig) -> RunConfig:
    """A table's relative path (``csv:data/x.csv``) made absolute against the working directory, so that
    every process of the run (Flower's start in other folders) reads the same file."""
    fmt, sep, path = config.dataset.partition(":")
    if not (sep and fmt in TABULAR_FORMATS) or Path(path).is_absolute():
        return config
    return dataclasses.replace(config, dataset=f"{fmt}:{Path(path).absolute()}")


def unknown_key_message(key: str, known: Iterable[str], what: str = "config key") -> str:
    """``unknown <what> 'key'``, with the near misses (``did you mean``) or else every known key."""
    known = sorted(known)
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
    if not close and key.replace("_", "-") in known:
        close = [key.replace("_", "-")]
    if close:
        return f"unknown {what} '{key}'; did you mean {' or '.join(repr(c) for c in close)}?"
    return f"unknown {what} '{key}'; known: {', '.join(known)}"


def _plans(plan: Any, modulus_bits: int) -> bool:
    """Whether ``plan(modulus_bits)`` finds a lattice."""
    try:
        plan(modulus_bits)
    except ValueError:
        return False
    return True


def check_device(device: str) -> None:
    """Refuse a ``device`` this machine does not have (``cuda`` without CUDA), naming what torch sees.

    Not part of :meth:`RunConfig.validate`: a config is validated wherever it is
    read (a server without a GPU may run clients that have one); this is the
    check for runs whose clients train on this machine.
    """
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(f"device='cuda' is not allowed on this machine: torch {torch.__version__} ({build}) "
                          "sees no CUDA device; expected auto (CUDA when present) or cpu")


def read_toml(path: str | Path, kind: str = "config file", error: type[ConfigError] = ConfigError) -> dict[str, Any]:
    """A TOML document; a missing or malformed file raises ``error`` naming it."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise error(f"{kind} not found: {path}") from None
    except OSError as problem:  # a folder, no permission, ...
        raise error(f"{kind} {path} cannot be read: {problem.strerror or problem}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as problem:
        raise error(f"{kind} {path} is not valid TOML: {problem}") from None


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``key=value`` with the value read as TOML (bare words are strings)."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip(), value


def _coerce(key: str, value: Any, expected: type) -> Any:
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected is float and isinstance(value, str) and value.strip().lower() in ("inf", "+inf"):
        return math.inf
    if not isinstance(value, expected) or isinstance(value, bool) != (expected is bool):
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {expected.__name__}")
    return value


def toml_value(value: Any) -> str:
    """``value`` as TOML writes it (config files, and the values error messages name)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, (int, float)):
        return repr(value)
    # JSON string escapes are TOML's, except that TOML has no surrogate pairs and no raw DEL
    return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; expected one of {', '.join(allowed)}")


def _either(names: tuple[str, ...]) -> str:
    """``'a' or 'b'``: the allowed values in an error message."""
    return " or ".join(repr(name) for name in names)


def _check(key: str, value: Any, ok: bool, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r} is not allowed; expected {allowed}")



