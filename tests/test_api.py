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


@pytest.mark.slow  # a fresh interpreter imports torch and Flower: 8-20 s each
@pytest.mark.subprocess
@pytest.mark.parametrize("entry", ["api", "cli"])
def test_a_fresh_interpreter_is_quiet_too(tmp_path, entry):
    """Importing Flower sets its logger to DEBUG; fedhog imports Flower late, so the level it sets must outlive that
    import (in a test session Flower is already imported, which hid it: `fedhog run` printed Flower's INFO lines)."""
    import os
    import re
    import subprocess
    import sys

    results = str(tmp_path / "run")
    settings = {**TINY, "results-dir": results}
    if entry == "api":
        code = f"import fedhog; fedhog.run({settings!r}, engine='inprocess')"
        command = [sys.executable, "-c", code]
    else:
        command = [sys.executable, "-m", "fedhog.cli", "run", "--engine", "inprocess"]
        for key, value in settings.items():
            command += ["--set", f"{key}={value!r}".replace("'", '"')]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    plain = re.sub(r"\x1b\[[0-9;]*m", "", done.stdout + done.stderr)  # Flower colours its level names
    flower_info = [line for line in plain.splitlines() if re.match(r"INFO\s*:", line)]
    assert flower_info == [], flower_info
