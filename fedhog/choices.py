"""Every configuration choice fedhog offers, as plain tuples and Literal types: the bottom floor, importing nothing
heavy.

:mod:`fedhog.config` validates against these, and the modules that implement
them (models, training, privacy, server optimizer, ...) import them from here,
so that reading or checking a config loads neither torch nor Flower.
``tests/test_house.py`` checks that each tuple is exactly what its
implementation offers. Each closed choice is a ``Literal`` type (what
:class:`~fedhog.config.RunConfig`'s field holds once validated) and the tuple
of its values (what validation checks against).
"""

from __future__ import annotations

import re
from typing import Literal, get_args

# data (fedhog.data)
DATASETS = ("mnist1d", "digits", "synthetic", "synthetic-large")
PartitionerName = Literal["iid", "dirichlet", "pathological"]
PARTITIONERS: tuple[PartitionerName, ...] = get_args(PartitionerName)
TABULAR_FORMATS = ("csv", "parquet", "npz")
# model and local training (fedhog.models, fedhog.training)
MODELS = ("logreg", "mlp", "cnn1d", "cnn2d")
ActivationName = Literal["tanh", "relu", "silu", "gelu", "softplus"]
ACTIVATIONS: tuple[ActivationName, ...] = get_args(ActivationName)
DEFAULT_ACTIVATION: ActivationName = "gelu"
NormalizationName = Literal["none", "group", "ws", "group-ws"]  # of the built-in models' hidden layers (fedhog.models)
NORMALIZATIONS: tuple[NormalizationName, ...] = get_args(NormalizationName)
DEFAULT_NORMALIZATION: NormalizationName = "none"
LocalOptimizer = Literal["sgd", "hog-step"]
OPTIMIZERS: tuple[LocalOptimizer, ...] = get_args(LocalOptimizer)
Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[Device, ...] = get_args(Device)
# federation (fedhog.privacy.sampling, fedhog.server_optimizer, fedhog.server_step)
SamplingKind = Literal["poisson", "fixed"]
SAMPLING_METHODS: tuple[SamplingKind, ...] = get_args(SamplingKind)
ServerOptimizerKind = Literal["sgd", "momentum", "adam", "yogi"]
SERVER_OPTIMIZERS: tuple[ServerOptimizerKind, ...] = get_args(ServerOptimizerKind)
ServerStepKind = Literal["none", "newton", "cubic"]
SERVER_STEPS: tuple[ServerStepKind, ...] = get_args(ServerStepKind)
# privacy (fedhog.privacy.mechanism, fedhog.privacy.accounting, fedhog.dpsgd)
AggregatorName = Literal["fedhog", "flower-dp"]  # SecureAggregator, or Flower's accounted DP wrapper (a baseline)
AGGREGATORS: tuple[AggregatorName, ...] = get_args(AggregatorName)
MechanismName = Literal["none", "gaussian", "hog"]
MECHANISMS: tuple[MechanismName, ...] = get_args(MechanismName)
# those that bound each contribution: DP, secure aggregation, adaptive C
CLIPPING_MECHANISMS: tuple[MechanismName, ...] = ("gaussian", "hog")
# those whose clients also send a third-order term (derivatives of the raw records)
TERM_MECHANISMS: tuple[MechanismName, ...] = ("hog",)
AccountantName = Literal["pld", "rdp"]
ACCOUNTANTS: tuple[AccountantName, ...] = get_args(AccountantName)
HogDirection = Literal["random", "update"]
HOG_DIRECTIONS: tuple[HogDirection, ...] = get_args(HogDirection)
HogTerm = Literal["third-order", "random"]
HOG_TERMS: tuple[HogTerm, ...] = get_args(HogTerm)
HogMixing = Literal["random-sign", "noise-aware"]  # how hog mixes the term (fedhog.privacy.mechanism.HogMechanism)
HOG_MIXINGS: tuple[HogMixing, ...] = get_args(HogMixing)
ClientDp = Literal["none", "dpsgd"]
CLIENT_DP: tuple[ClientDp, ...] = get_args(ClientDp)
DpSgdAccountant = Literal["prv", "rdp"]
DPSGD_ACCOUNTANTS: tuple[DpSgdAccountant, ...] = get_args(DpSgdAccountant)
DpSgdNoise = Literal["fedhog", "opacus-secure"]
DPSGD_NOISE: tuple[DpSgdNoise, ...] = get_args(DpSgdNoise)
PRIVACY_LEVEL_KEYS = ("noise-multiplier", "target-epsilon")  # σ, or the ε to calibrate σ for: one of them
# secure aggregation (fedhog.secure_aggregation.quantization)
SecureAggregationMode = Literal["off", "secagg+"]
SECURE_AGGREGATION: tuple[SecureAggregationMode, ...] = get_args(SecureAggregationMode)
NoiseSource = Literal["central", "distributed"]  # who adds the noise: the server, or each client a share (secagg+ only)
NOISE: tuple[NoiseSource, ...] = get_args(NoiseSource)
MIN_MODULUS_BITS = 16
MAX_MODULUS_BITS = 62  # residues and the centred sum stay exact in int64
# evaluation and output (fedhog.training's metrics, fedhog.export)
TEST_METRICS = ("accuracy", "auroc", "auprc")  # the `metrics` key: loss and accuracy always; AUROC, AUPRC binary only
BINARY_METRICS = ("auroc", "auprc")
ExportFormat = Literal["torchscript", "state-dict"]
EXPORT_FORMATS: tuple[ExportFormat, ...] = get_args(ExportFormat)

_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_factory(name: str) -> bool:
    """Whether ``name`` has the form ``package.module:factory`` (a user's model factory, not one of :data:`MODELS`)."""
    return isinstance(name, str) and _FACTORY.fullmatch(name) is not None
