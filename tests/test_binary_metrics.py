"""Metrics that fit imbalanced binary labels: AUROC and AUPRC, computed, recorded per round, displayed, exported."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fedhog.data import ArrayData
from fedhog.monitoring import ServerMetrics
from fedhog.progress import round_status
from fedhog.strategy import RoundRecord
from fedhog.training import evaluate_metrics


def _score_model() -> nn.Module:
    """Logits (0, x): the softmax probability of class 1 is sigmoid(x), monotone in the input x."""
    model = nn.Linear(1, 2)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.0], [1.0]]))
        model.bias.zero_()
    return model


def test_auroc_and_auprc_equal_their_hand_computation():
    # scores 0.1 0.4 0.35 0.8 for labels 0 0 1 1: positives beat negatives in 3 of 4 pairs (AUROC 3/4);
    # ranked by score the positives come at ranks 1 and 3: precision 1 and 2/3 at recall 1/2 and 1 (AP 5/6)
    data = ArrayData(np.array([[0.1], [0.4], [0.35], [0.8]], np.float32), np.array([0, 0, 1, 1]))
    metrics = evaluate_metrics(_score_model(), data, ("accuracy", "auroc", "auprc"))
    assert metrics["auroc"] == pytest.approx(0.75)
    assert metrics["auprc"] == pytest.approx(5 / 6)
    assert metrics["accuracy"] == pytest.approx(1 / 2)  # sigmoid(x) > 1/2 for every x > 0: all predicted 1
    probabilities = torch.sigmoid(torch.tensor([0.1, 0.4, 0.35, 0.8]))
    expected_loss = -(torch.log(1 - probabilities[:2]).sum() + torch.log(probabilities[2:]).sum()) / 4
    assert metrics["loss"] == pytest.approx(float(expected_loss), rel=1e-6)


def test_ties_count_half_and_batches_do_not_change_the_result():
    rng = np.random.default_rng(0)
    x = np.round(rng.normal(size=(301, 1)), 1).astype(np.float32)  # many ties
    y = (rng.random(301) < 0.05).astype(np.int64)
    positives, negatives = x[y == 1, 0], x[y == 0, 0]
    pairs = (positives[:, None] > negatives[None, :]).sum() + 0.5 * (positives[:, None] == negatives[None, :]).sum()
    whole = evaluate_metrics(_score_model(), ArrayData(x, y), ("auroc", "auprc"))
    batched = evaluate_metrics(_score_model(), ArrayData(x, y), ("auroc", "auprc"), batch_size=7)
    assert whole["auroc"] == pytest.approx(pairs / (len(positives) * len(negatives)))
    assert batched == pytest.approx(whole)


def test_one_class_gives_nan_and_more_classes_are_refused():
    data = ArrayData(np.zeros((3, 1), np.float32), np.zeros(3, np.int64))
    assert math.isnan(evaluate_metrics(_score_model(), data, ("auprc",))["auprc"])
    with pytest.raises(ValueError, match="auroc need a binary label; the model has 3 classes"):
        evaluate_metrics(nn.Linear(1, 3), data, ("accuracy", "auroc"))


def test_the_progress_line_and_prometheus_show_them_when_measured():
    assert round_status({"accuracy": 0.97, "auroc": 0.81234, "auprc": 0.2, "epsilon": 1.5}) == \
        "accuracy 0.970  AUROC 0.812  AUPRC 0.200  ε 1.500"
    assert round_status({"accuracy": 0.97, "auroc": None, "auprc": None, "epsilon": 1.5}) == "accuracy 0.970  ε 1.500"
    metrics = ServerMetrics()
    metrics.observe_round(RoundRecord(round=1, clients_sampled=2, auroc=0.8, auprc=0.25))
    text = metrics.exposition().decode()
    assert "fedhog_test_auprc 0.25" in text and "fedhog_test_auroc 0.8" in text
