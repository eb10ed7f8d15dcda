"""Rejection kinds are an enum whose values are the strings results files have always counted."""

from __future__ import annotations

import json
import re

import pytest

from fedhog.protocol import BadReply, Rejection

# every kind metrics.json has counted in a round's "rejections": results files stay comparable
KINDS_IN_RESULTS_FILES = {"client error", "not sampled", "duplicate", "malformed", "wrong keys", "wrong shape",
                          "wrong dtype", "non-finite values", "too large", "non-finite third-order term",
                          "weights refused", "dropped out", "wrong round"}


def test_the_kinds_are_the_strings_results_files_count():
    assert {kind.value for kind in Rejection} == KINDS_IN_RESULTS_FILES
    assert json.dumps({Rejection.TOO_LARGE.value: 1}) == '{"too large": 1}'


@pytest.mark.parametrize("kind", list(Rejection))
def test_a_kinds_prometheus_label_is_the_one_its_text_gave(kind):
    """The labels that monitoring derived from the prose by regex, now read off the enum."""
    assert kind.label == re.sub(r"[^a-z0-9]+", "_", kind.value).strip("_")


def test_a_bad_reply_carries_its_kind_and_reads_as_kind_then_detail():
    error = BadReply(Rejection.WRONG_SHAPE, "'update/w' is (3,), expected (4,)")
    assert error.kind is Rejection.WRONG_SHAPE and error.detail == "'update/w' is (3,), expected (4,)"
    assert str(error) == "wrong shape: 'update/w' is (3,), expected (4,)"
    assert isinstance(error, ValueError)


@pytest.mark.parametrize("loss", [float("nan"), float("inf"), -float("inf")])
def test_a_loss_that_is_not_finite_travels_as_unmeasured_on_every_engine(loss):
    """The ClientApp and the vectorized engine build their replies' metrics with the same builder."""
    from fedhog.protocol import UNMEASURED, fedavg_metrics, train_metrics

    metrics = train_metrics(3, 40, loss, 5, validation_accuracy=loss)
    assert metrics == {"partition-id": 3, "num-examples": 40, "train-loss": UNMEASURED, "local-steps": 5,
                       "validation-accuracy": UNMEASURED}
    assert fedavg_metrics(loss) == {"fedavg-weight": 1, "train-loss": UNMEASURED}
    assert train_metrics(0, 1, 0.25, 2)["train-loss"] == 0.25
