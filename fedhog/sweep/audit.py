"""The sweep's privacy audit: every audited (variant, condition) through ``fedhog audit``, stored and not rerun.

Each target's folder ``output/audit/<variant>__<condition>/`` holds the
audit's ``audit.json`` and ``scores.png`` (:func:`fedhog.auditing.runner.audit`)
and, written last and atomically, ``audited.json``: the config and ``[audit]``
options it ran with. A target whose ``audited.json`` matches what the sweep
asks for is not rerun; any other is audited again from scratch. The auditor
(torch, Flower) is imported only to run one, so the report can read results
without it.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spec import AuditOptions, AuditTarget, Sweep

AUDITED = "audited.json"


@dataclass(frozen=True)
class AuditRow:
    """What the report says of one target's audit (from its ``audit.json``)."""

    variant: str
    condition: tuple[tuple[str, Any], ...]
    mechanism: str
    epsilon_accounted: float
    bound_every_round: float
    bound_final_model: float
    gdp_mu: float  # the every-round test's μ̂ at its own threshold on the held-out trials
    epsilon_gdp: float
    confidence: float
    trials: int
    violated: bool
    plot: str  # scores.png, relative to the sweep's folder


def directory_of(sweep: Sweep, target: AuditTarget) -> Path:
    """The target's folder in the sweep's."""
    return sweep.output / "audit" / target.audit_id


def request_of(target: AuditTarget, options: AuditOptions) -> dict[str, Any]:
    """What an audit of ``target`` is: its config (σ left to calibration when ε is targeted) and the options."""
    mapping = {k: v for k, v in target.config.to_mapping().items()
               if not (k == "noise-multiplier" and target.config.target_epsilon > 0)}
    return json.loads(json.dumps({"config": mapping, "options": options.to_mapping()}))


def is_audited(sweep: Sweep, target: AuditTarget) -> bool:
    """Whether the target's folder holds a finished audit of what the sweep asks for now."""
    assert sweep.audit is not None
    folder = directory_of(sweep, target)
    try:
        stored = json.loads((folder / AUDITED).read_text())
    except (OSError, ValueError):
        return False
    return stored == request_of(target, sweep.audit) and (folder / "audit.json").is_file()


def run_audits(sweep: Sweep, failed: dict[str, str]) -> list[str]:
    """Audit every target not audited with its current config and options; the ids audited.

    An audit that raises is noted in ``failed`` (as ``audit/<id>``; a refused option with the auditor's
    message, which names the key, the value and what is allowed) and the others go on.
    """
    from rich.markup import escape

    from ..auditing.runner import audit  # torch and Flower, only to run one
    from ..config import ConfigError
    from ..progress import console
    from ..results import atomic_write

    if sweep.audit is None:
        return []
    done = []
    for target in sweep.audit_targets:
        if is_audited(sweep, target):
            continue
        folder, name = directory_of(sweep, target), f"audit/{target.audit_id}"
        shutil.rmtree(folder, ignore_errors=True)
        request, options = request_of(target, sweep.audit), sweep.audit
        try:
            result = audit(request["config"], runs=options.runs, canaries=options.canaries,
                           confidence=options.confidence, canary_norm=options.canary_norm, results_dir=folder)
        except Exception as error:  # pylint: disable=broad-except  # one audit's fault; the others go on
            failed[name] = f"[audit] {error}" if isinstance(error, ConfigError) else f"{type(error).__name__}: {error}"
            console.print(f"[red]{escape(name)} failed:[/] {escape(failed[name])}")
            continue
        atomic_write(folder / AUDITED, (json.dumps(request, indent=2) + "\n").encode())
        done.append(target.audit_id)
        verdict = "[bold red]over its ε: broken[/]" if result.violated else "within its ε"
        console.print(f"{escape(name)}: ε ≥ {result.epsilon_lower_bound:.3g} ({result.threat_model}) "
                      f"against ε = {result.epsilon_accounted:.3g} accounted: {verdict}")
    return done


def collect_audits(sweep: Sweep) -> list[AuditRow]:
    """The rows of the targets whose stored audit is of what the sweep asks for now."""
    rows = []
    for target in sweep.audit_targets:
        if not is_audited(sweep, target):
            continue
        folder = directory_of(sweep, target)
        document = json.loads((folder / "audit.json").read_text())
        models = document["threat_models"]
        rows.append(AuditRow(
            target.variant, target.condition, document["mechanism"], _float(document["epsilon_accounted"]),
            _float(models["every-round"]["epsilon_lower_bound"]), _float(models["final-model"]["epsilon_lower_bound"]),
            _float(models["every-round"]["gdp_mu_estimate"]), _float(models["every-round"]["epsilon_estimate_gdp"]),
            document["confidence"], document["runs"] * document["canaries_per_run"], bool(document["violated"]),
            str((folder / "scores.png").relative_to(sweep.output))))
    return rows


def _float(value: Any) -> float:
    """``audit.json`` writes ∞ as "inf"."""
    return math.inf if value == "inf" else float(value)
