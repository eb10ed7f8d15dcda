"""fedhog.run() from Python: quiet unless asked, and its result says σ."""

from __future__ import annotations

import logging

import pytest

import fedhog

TINY = {"dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 0.5, "rounds": 2,
        "partitioner": "iid", "delta": 1e-3}


@pytest.mark.parametrize("verbose", [False, True])
def test_run_is_quiet_by_default_and_its_result_carries_sigma(tmp_path, caplog, verbose):
    result = fedhog.run(TINY, engine="inprocess", verbose=verbose, results_dir=str(tmp_path / "run"),
                        mechanism="gaussian", target_epsilon=5.0)
    info = [r.getMessage() for r in caplog.records if r.name == "flwr" and r.levelno == logging.INFO]
    if verbose:
        assert any(message.startswith("round 2: accuracy") for message in info), info
    else:
        assert info == [], info
    sigma = result.noise_multiplier
    assert result.summary["noise_multiplier"] == sigma == result.document["privacy"]["noise_multiplier"]
    assert 0 < sigma < 100 and sigma != 1.0  # calibrated to ε = 5, not the default
    assert result.summary["epsilon"] == pytest.approx(5.0, abs=0.05)
