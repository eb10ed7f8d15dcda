"""The sweep's ``[audit]``: every variant's mechanism audited per condition, stored, reported, and able to fail.

Cells are replaced by a no-op where a test is about the audit alone (the audit runs the mechanism with
canaries, never the cells' training); one test runs real cells end to end.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

import fedhog.auditing.runner as auditor
from fedhog.privacy import mechanism
from fedhog.sweep import runner as sweep_runner
from fedhog.sweep.audit import is_audited
from fedhog.sweep.spec import AuditOptions, SweepError, load_sweep

SWEEP = """
output = "out"
[base]
dataset = "digits"
model = "logreg"
partitioner = "iid"
population = 1000
sampling-rate = 0.1
rounds = 3
[grid]
noise-multiplier = [1.0]  # a σ, not a target ε: no calibration, so the tests stay fast
seed = [0]
[[variants]]
name = "gaussian"
mechanism = "gaussian"
[[variants]]
name = "no-dp"
mechanism = "none"
noise-multiplier = 0.0
[audit]
canaries = 4000
"""


def _sweep(tmp_path: Path, text: str = SWEEP):
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return load_sweep(path, tmp_path / "out")


@pytest.fixture
def audits(monkeypatch):
    """No cell training (the audit needs none), and the calls to the auditor counted."""
    calls = []
    real = auditor.audit

    def counted(config, **options):
        calls.append(config)
        return real(config, **options)

    monkeypatch.setattr(sweep_runner, "_run_cell", lambda cell, engine: None)
    monkeypatch.setattr(auditor, "audit", counted)
    return calls


def test_a_broken_mechanism_is_reported_over_its_epsilon(tmp_path, monkeypatch, audits, capsys):
    """No clipping, put in by the test only: the summary flags the mechanism as broken, with its plot."""
    real = mechanism.GaussianMechanism.constrain_sensitivity

    def unclipped(self, updates, terms, xis):
        return real(dataclasses.replace(self, clipping_norm=math.inf), updates, terms, xis)

    monkeypatch.setattr(mechanism.GaussianMechanism, "constrain_sensitivity", unclipped)
    sweep = _sweep(tmp_path)
    assert sweep_runner.sweep_command(sweep.path, sweep.output, list_only=True) == 0
    assert "to run    audit/gaussian__noise-multiplier=1.0" in capsys.readouterr().err
    outcome = sweep_runner.run_sweep(sweep, show_progress=False)
    assert "audit/gaussian__noise-multiplier=1.0" in outcome.ran and len(audits) == 1  # no-dp has nothing to audit
    sweep_runner.sweep_command(sweep.path, sweep.output, list_only=True)
    assert "finished  audit/gaussian__noise-multiplier=1.0" in capsys.readouterr().err
    summary = (sweep.output / "summary.md").read_text()
    section = summary.split("## Privacy audit")[1]
    (row,) = [line for line in section.splitlines() if line.startswith("| gaussian |")]
    assert "**over its ε: broken**" in row
    accounted, every_round = (float(cell) for cell in row.split(" | ")[3:5])
    assert 1 < accounted < 10 and every_round > accounted
    assert "Not audited: no-dp (no DP guarantee)." in section
    plot = sweep.output / "audit" / "gaussian__noise-multiplier=1.0" / "scores.png"
    assert "](audit/gaussian__noise-multiplier=1.0/scores.png)" in section
    assert plot.read_bytes().startswith(b"\x89PNG") and plot.stat().st_size < 150_000


def test_the_real_mechanism_is_reported_within_its_epsilon(tmp_path, audits):
    """The same sweep without the fault (the audit alone; real cells: the slow test below)."""
    sweep = _sweep(tmp_path)
    sweep_runner.run_sweep(sweep, show_progress=False)
    section = (sweep.output / "summary.md").read_text().split("## Privacy audit")[1]
    (row,) = [line for line in section.splitlines() if line.startswith("| gaussian |")]
    accounted, every_round, final_model = (float(cell) for cell in row.split(" | ")[3:6])
    assert "within its ε" in row and max(every_round, final_model) <= accounted


@pytest.mark.slow  # two audits: ~7 s on a busy machine
def test_the_audit_uses_fresh_noise_and_reruns_only_when_config_or_options_change(tmp_path, audits):
    sweep = _sweep(tmp_path)
    sweep_runner.run_sweep(sweep, show_progress=False)
    folder = sweep.output / "audit" / "gaussian__noise-multiplier=1.0"
    stored = json.loads((folder / "audited.json").read_text())
    assert stored["config"]["privacy-seed"] == -1 and audits[0]["privacy-seed"] == -1  # never the pairing seed
    pairing_seed = str(sweep.cells[0].config.privacy_seed)
    assert all(pairing_seed not in path.read_text() for path in folder.glob("*.json"))
    assert stored["options"] == AuditOptions(canaries=4000).to_mapping()
    assert not list(folder.glob(".*"))  # no temporary file left by the atomic writes

    sweep_runner.run_sweep(_sweep(tmp_path), show_progress=False)
    assert len(audits) == 1  # unchanged: not rerun
    (target,) = sweep.audit_targets
    more_canaries = SWEEP.replace("canaries = 4000", "canaries = 5000")
    for text in (more_canaries, SWEEP.replace("rounds = 3", "rounds = 2"),
                 SWEEP.replace("[audit]", "[audit]\nruns = 2"),
                 SWEEP.replace('mechanism = "gaussian"', 'mechanism = "hog"')):
        changed = _sweep(tmp_path, text)
        assert not is_audited(changed, changed.audit_targets[0]), text
    assert is_audited(_sweep(tmp_path, SWEEP.replace("seed = [0]", "seed = [0, 1]")), target)  # data seeds: same
    sweep_runner.run_sweep(_sweep(tmp_path, more_canaries), show_progress=False)
    assert len(audits) == 2 and json.loads((folder / "audit.json").read_text())["canaries_per_run"] == 5000
    (folder / "audited.json").unlink()  # an audit that did not finish is not one
    assert not is_audited(_sweep(tmp_path, more_canaries), target)


def test_an_audit_the_auditor_refuses_is_a_failure_naming_the_key(tmp_path, audits):
    text = SWEEP.replace('mechanism = "gaussian"', 'mechanism = "gaussian"\nsampling = "fixed"').replace(
        "4000", "3001")
    sweep = _sweep(tmp_path, text)
    outcome = sweep_runner.run_sweep(sweep, show_progress=False)
    message = outcome.failed["audit/gaussian__noise-multiplier=1.0"]
    assert "canaries=3001 is not allowed" in message and "multiple of population=1000" in message
    assert "1 of 1 audits did not finish" in (sweep.output / "summary.md").read_text()


@pytest.mark.slow  # real cells and two audits: ~10 s
def test_real_mechanisms_are_within_their_epsilon_end_to_end(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDHOG_CACHE", str(tmp_path / "cache"))
    text = SWEEP.replace("population = 1000\nsampling-rate = 0.1\nrounds = 3", "population = 10\n"
                         "sampling-rate = 0.5\nrounds = 2\nlearning-rate = 0.1\nclipping-norm = 2.0").replace(
        "[[variants]]\nname = \"no-dp\"", "[[variants]]\nname = \"hog\"\nmechanism = \"hog\"\n[[variants]]\n"
                                          "name = \"no-dp\"").replace("canaries = 4000", "canaries = 20000")
    sweep = _sweep(tmp_path, text)
    outcome = sweep_runner.run_sweep(sweep, show_progress=False)
    assert not outcome.failed and len(outcome.ran) == 3 + 2  # 3 cells, 2 audits
    section = (sweep.output / "summary.md").read_text().split("## Privacy audit")[1]
    rows = [line for line in section.splitlines() if line.startswith(("| gaussian |", "| hog |"))]
    assert len(rows) == 2 and all("within its ε" in row for row in rows)
    assert "3 of 3 cells finished" in (sweep.output / "summary.md").read_text()


@pytest.mark.parametrize("audit, match", [
    ("trials = 5", "\\[audit\\]: unknown key 'trials'.*runs"),
    ("runs = 0", "\\[audit\\] runs=0 is not allowed; expected an integer ≥ 1"),
    ("runs = 1.5", "runs=1.5 is not allowed"),
    ("canaries = 1", "canaries=1 is not allowed; expected 0 \\(the harness's default\\) or an integer in 2..2000000"),
    ("confidence = 1.5", "confidence=1.5 is not allowed; expected a number in \\(0, 1\\)"),
    ("canary-norm = 0", "canary-norm=0 is not allowed; expected a finite number > 0"),
    ('variants = ["nope"]', "no variant 'nope'; variants: gaussian, no-dp"),
    ('variants = ["no-dp"]', "variant 'no-dp' has no DP guarantee.*expected variants with one: gaussian"),
    ('variants = "gaussian"', "variants='gaussian' is not allowed; expected a list of variant names"),
])
def test_bad_audit_tables_name_the_key_the_value_and_what_is_allowed(tmp_path, audit, match):
    with pytest.raises(SweepError, match=match):
        _sweep(tmp_path, SWEEP.replace("canaries = 4000", audit))


def test_the_sweeps_audit_defaults_are_the_auditors_and_a_sweep_without_guarantee_is_refused(tmp_path):
    options = AuditOptions()
    assert (options.confidence, options.canary_norm) == (auditor.DEFAULT_CONFIDENCE, auditor.DEFAULT_CANARY_NORM)
    with pytest.raises(SweepError, match="no variant has a DP guarantee"):
        _sweep(tmp_path, SWEEP.replace('name = "gaussian"\nmechanism = "gaussian"', 'name = "gaussian"\n'
                                       'mechanism = "none"'))
