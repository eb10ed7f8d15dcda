"""Every configuration choice fedhog offers, as plain tuples: the bottom floor, importing nothing heavy.

:mod:`fedhog.config` validates against these, and the modules that implement
them (models, training, privacy, server optimizer, ...) import them from here,
so that reading or checking a config loads neither torch nor Flower.
``tests/test_house.py`` checks that each tuple is exactly what its
implementation offers.
"""

from __future__ import annotations

import re

# data (fedhog.data)
DATASETS = ("mnist1d", "digits", "synthetic", "synthetic-large")
PARTITIONERS = ("iid", "dirichlet", "pathological")
TABULAR_FORMATS = ("csv", "parquet", "npz")
# model and local training (fedhog.models, fedhog.training)
MODELS = ("logreg", "mlp", "cnn1d", "cnn2d")
ACTIVATIONS = ("tanh", "relu", "silu", "gelu", "softplus")
DEFAULT_ACTIVATION = "gelu"
NORMALIZATIONS = ("none", "group", "ws", "group-ws")  # of the built-in models' hidden layers (fedhog.models)
DEFAULT_NORMALIZATION = "none"
OPTIMIZERS = ("sgd", "hog-step")
DEVICES = ("auto", "cpu", "cuda")
# federation (fedhog.privacy.sampling, fedhog.server_optimizer, fedhog.server_step)
SAMPLING_METHODS: tuple[str, ...] = ("poisson", "fixed")
SERVER_OPTIMIZERS = ("sgd", "momentum", "adam", "yogi")
SERVER_STEPS = ("none", "newton", "cubic")
# privacy (fedhog.privacy.mechanism, fedhog.privacy.accounting, fedhog.dpsgd)
AGGREGATORS = ("fedhog", "flower-dp")  # SecureAggregator, or Flower's accounted DP wrapper (a baseline)
MECHANISMS: tuple[str, ...] = ("none", "gaussian", "hog")
CLIPPING_MECHANISMS = ("gaussian", "hog")  # those that bound each contribution: DP, secure aggregation, adaptive C
TERM_MECHANISMS = ("hog",)  # those whose clients also send a third-order term (derivatives of the raw records)
ACCOUNTANTS: tuple[str, ...] = ("pld", "rdp")
HOG_DIRECTIONS = ("random", "update")
HOG_TERMS = ("third-order", "random")
CLIENT_DP = ("none", "dpsgd")
DPSGD_ACCOUNTANTS = ("prv", "rdp")
DPSGD_NOISE = ("fedhog", "opacus-secure")
PRIVACY_LEVEL_KEYS = ("noise-multiplier", "target-epsilon")  # σ, or the ε to calibrate σ for: one of them
# secure aggregation (fedhog.secure_aggregation.quantization)
SECURE_AGGREGATION = ("off", "secagg+")
NOISE = ("central", "distributed")  # who adds the noise: the server, or each client a share (secagg+ only)
MIN_MODULUS_BITS = 16
MAX_MODULUS_BITS = 62  # residues and the centred sum stay exact in int64
# evaluation and output (fedhog.training's metrics, fedhog.export)
TEST_METRICS = ("accuracy", "auroc", "auprc")  # the `metrics` key: loss and accuracy always; AUROC, AUPRC binary only
BINARY_METRICS = ("auroc", "auprc")
EXPORT_FORMATS = ("torchscript", "state-dict")

_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_factory(name: str) -> bool:
    """Whether ``name`` has the form ``package.module:factory`` (a user's model factory, not one of :data:`MODELS`)."""
    return isinstance(name, str) and _FACTORY.fullmatch(name) is not None
