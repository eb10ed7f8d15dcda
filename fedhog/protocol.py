"""What the server sends a client and what a client replies: the keys both sides use.

A train instruction carries the global model under ``"arrays"`` and a
ConfigRecord under ``"config"`` with :data:`SERVER_ROUND` and :data:`JOB_ID`.
A reply carries the update Δ under :data:`UPDATE`, with ``hog`` the
third-order term under :data:`TERM` (both keyed like the global model), and a
MetricRecord under :data:`METRICS`. Under DP-SGD the reply carries no record
counts (:data:`NUM_EXAMPLES`, local step counts): the record-level ε does not
cover them, so the server weighs such clients equally.

A standard Flower ClientApp replies the other way, as Flower's examples do:
its trained weights under :data:`WEIGHTS` and :data:`NUM_EXAMPLES` in a
MetricRecord. With a trusted server, SecureAggregator reads such a reply as the
update weights − global model of the round; under secure aggregation it is
refused (the server must never see a client's own model).

A reply the server will not use is a :class:`BadReply`: its
:class:`Rejection` kind is what ``metrics.json`` counts (``rejections``) and
what the Prometheus metrics label, its detail what the log says.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, TypeGuard

if TYPE_CHECKING:
    import torch

# records of a train reply
UPDATE = "update"
TERM = "third-order-term"
METRICS = "metrics"
WEIGHTS = "arrays"  # Flower's convention (its examples' ClientApps): the trained weights, not the update

# the train instruction's config
SERVER_ROUND = "server-round"
JOB_ID = "job-id"  # the training job's name, the same across resumes

# metrics of a reply
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"  # the mean local loss (informational)
LOCAL_STEPS = "local-steps"
CUBIC_STEPS = "hog-step-cubic-steps"  # optimizer = "hog-step": steps that took the cubic model's length
VALIDATION_ACCURACY = "validation-accuracy"  # on the client's own validation split
THIRD_ORDER_SECONDS = "third-order-seconds"
THIRD_ORDER_FINITE = "third-order-finite"
DPSGD_EPSILON = "dpsgd-epsilon"  # client-dp = "dpsgd": the client's record-level ε so far
FEDAVG_WEIGHT = "fedavg-weight"  # the flower-dp baseline's reply: every client weighs 1 (accounted FedAvg)
UNMEASURED = -1.0  # a loss or accuracy that is not finite travels as this
# the metrics of a reply the server reads as numbers (NUM_EXAMPLES, an integer, is checked on its own): a list there
# makes the reply malformed
NUMBER_METRICS = (TRAIN_LOSS, THIRD_ORDER_SECONDS, THIRD_ORDER_FINITE, DPSGD_EPSILON)

MetricValue = int | float | list[int] | list[float]  # what a MetricRecord holds (Flower's MetricRecordValues)

# secure aggregation (SecAgg+): a collect-stage reply carries only the masked vector, mod 2^bits
MASKED = "masked-contribution"


def is_number(value: object) -> TypeGuard[int | float]:
    """Whether ``value`` is an int or a float (not a bool, not a list): what a metric read as a number must be."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def measured(value: float) -> float:
    """``value`` if it is finite, else :data:`UNMEASURED`."""
    return value if math.isfinite(value) else UNMEASURED


def train_metrics(partition_id: int, num_examples: int, train_loss: float, local_steps: int, *,
                  cubic_steps: int | None = None, validation_accuracy: float | None = None) -> dict[str, int | float]:
    """The metrics of a fedhog train reply: whose, how many records, the mean local loss, the steps taken."""
    metrics: dict[str, int | float] = {PARTITION_ID: partition_id, NUM_EXAMPLES: num_examples,
                                       TRAIN_LOSS: measured(train_loss), LOCAL_STEPS: local_steps}
    if cubic_steps is not None:
        metrics[CUBIC_STEPS] = cubic_steps
    if validation_accuracy is not None:
        metrics[VALIDATION_ACCURACY] = measured(validation_accuracy)
    return metrics


def third_order_metrics(seconds: float, finite: bool, memory: Mapping[str, int]) -> dict[str, int | float]:
    """What a reply says of its third-order term: its seconds, whether it is finite, and the peak ``memory``."""
    return {THIRD_ORDER_SECONDS: seconds, THIRD_ORDER_FINITE: int(finite), **memory}


def dpsgd_metrics(partition_id: int, epsilon: float) -> dict[str, int | float]:
    """A DP-SGD client's reply metrics: no record counts, no raw-record statistics (see the module docstring)."""
    return {PARTITION_ID: partition_id, DPSGD_EPSILON: epsilon}


def fedavg_metrics(train_loss: float) -> dict[str, int | float]:
    """The metrics of a reply to Flower's accounted FedAvg (the flower-dp baseline): an equal weight, the loss."""
    return {FEDAVG_WEIGHT: 1, TRAIN_LOSS: measured(train_loss)}


@dataclass
class LocalWork:
    """A client's round: its update Δ, its third-order term t (None: not asked for, or not finite), metrics."""

    global_state: dict[str, torch.Tensor]
    update: dict[str, torch.Tensor]
    term: dict[str, torch.Tensor] | None
    metrics: dict[str, float | int]


@dataclass(frozen=True)
class ClientResult:
    """What one sampled client delivered, however it travelled (a reply, or the vectorized engine).

    ``update`` and ``term`` are flat tensors in the layout of the global
    model's ArrayRecord (its keys in order); ``term`` is None when the client
    sent none; ``metrics`` is the reply's MetricRecord as a mapping.
    """

    slot: int
    update: torch.Tensor
    term: torch.Tensor | None
    metrics: Mapping[str, MetricValue]


class Rejection(StrEnum):
    """Why a client's reply (or, under secure aggregation, the client) was not used; the value is the kind
    ``metrics.json`` counts in a round's ``rejections``."""

    CLIENT_ERROR = "client error"  # its ClientApp raised
    NOT_SAMPLED = "not sampled"  # the node was not in this round's cohort
    WRONG_ROUND = "wrong round"  # a reply to another message than the round's instruction to the node (a stale one)
    DUPLICATE = "duplicate"  # a second reply from the same node
    MALFORMED = "malformed"  # a record missing, or a count that is not one
    WRONG_KEYS = "wrong keys"
    WRONG_SHAPE = "wrong shape"
    WRONG_DTYPE = "wrong dtype"
    NON_FINITE_VALUES = "non-finite values"  # NaN or inf in the update or the term
    TOO_LARGE = "too large"  # an update longer than max-update-norm
    NON_FINITE_THIRD_ORDER_TERM = "non-finite third-order term"  # the client could not compute its term
    WEIGHTS_REFUSED = "weights refused"  # a client's own model under secure aggregation
    DROPPED_OUT = "dropped out"  # no reply to a stage of secure aggregation

    @property
    def label(self) -> str:
        """The Prometheus label: ``non_finite_third_order_term``."""
        return self.name.lower()


class BadReply(ValueError):
    """A client reply the aggregator will not use: its :class:`Rejection` kind and what exactly was wrong.

    ``str(error)`` is ``"<kind>: <detail>"``, as the log and ``metrics.json``'s first reasons show it.
    """

    def __init__(self, kind: Rejection, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail

    def __reduce__(self) -> tuple[type[BadReply], tuple[Rejection, str]]:
        """Pickled as its kind and detail (a sharded cohort's refusals travel back from Ray actors)."""
        return BadReply, (self.kind, self.detail)


def client_error_summary(reason: str, limit: int = 300) -> str:
    """A client's error reason on one line: Flower's wrappers unwrapped, tracebacks dropped,
    at most ``limit`` characters.

    Flower reports ``<class 'X'>:<'message'>``; its Simulation Engine wraps the
    ClientApp's error (with Ray's traceback) as ``... ClientAppException occurred.
    Message: <the error>``; the in-process engine sends ``Type: message`` and a traceback.
    """
    text = re.sub(r"\x1b\[[0-9;]*m", "", reason.removeprefix("client error: "))
    if inner := re.search(r"Exception ClientAppException occurred\. Message: (.*?)(?:'>)?\s*$", text, re.S):
        text = inner.group(1)
    elif wrapped := re.fullmatch(r"<class '([^']+)'>:<'(.*)'>\s*", text, re.S):
        text = f"{wrapped.group(1).rsplit('.', 1)[-1]}: {wrapped.group(2)}"
    text = " ".join(text.split("Traceback (most recent call last)")[0].split())
    return text if len(text) <= limit else text[:limit - 1] + "…"
