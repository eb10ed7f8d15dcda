"""The Markdown summary of a sweep: final accuracy per variant and condition, and the paired comparisons."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..progress import format_value
from .audit import AuditRow
from .spec import Sweep, format_grid_value, widening_trials
from .stats import PairedComparison, TrialScore, choice_stability, final_rows, group_rows, mean_std, setting_scores


def summary_markdown(sweep: Sweep, rows: Sequence[dict[str, Any]], comparisons: Sequence[PairedComparison],
                     audits: Sequence[AuditRow] = ()) -> str:
    """The Markdown summary: final accuracy per (variant, condition), the paired comparisons, the tuned values
    and the privacy audit."""
    finals = final_rows(rows)
    keys, metric = sweep.condition_keys, sweep.metric
    lines = [f"# Sweep `{sweep.path.name}`", "",
             f"{len(finals)} of {len(sweep.cells)} cells finished. Final {metric} is the test {metric} after "
             f"the last round, mean ± sample std over {', '.join(sweep.replicate_keys)} (n finished cells); "
             "ε is the accountant's ε after the last round and σ the noise multiplier it ran with (means). "
             "What the noise did to the model, after the last round (fedhog.diagnostics, the mean over the cells "
             "of their worst layer): weight growth ‖W_T‖/‖W_0‖; noise walk, the noise's expected random walk "
             "over the layer's movement ‖W_T − W_0‖ (near 1 or above: moved mostly by noise; – without noise or "
             "with an adaptive server optimizer); saturated, the fraction of a tanh or sigmoid layer's units "
             "past its flat point (– for non-saturating activations).", "",
             *_header(["variant", *keys, "n", f"final {metric}", "ε", "σ", "weight growth", "noise walk",
                       "saturated"])]
    for (variant, *values), group in group_rows(finals, ["variant", *keys]).items():
        mean, std = mean_std([r[metric] for r in group])
        epsilon = float(np.mean([r["epsilon"] for r in group]))
        sigma = float(np.mean([r["sigma"] for r in group]))
        cells = [variant, *(format_grid_value(v) for v in values), str(len(group)), f"{_num(mean)} ± {_num(std)}",
                 format_value(epsilon), _num(sigma if math.isfinite(epsilon) else math.nan)]
        diagnostics = [mean_std([r.get(k, math.nan) for r in group])[0]
                       for k in ("weight_growth_max", "noise_walk_max", "saturated_max")]
        cells += [_num(diagnostics[0], ".1f") + ("×" if math.isfinite(diagnostics[0]) else ""),
                  _num(diagnostics[1], ".2f"), _num(diagnostics[2] * 100, ".0f") + ("%" if math.isfinite(
                      diagnostics[2]) else "")]
        lines.append(_row(cells))
    if comparisons:
        lines += ["", "## Paired comparisons", "",
                  f"Difference = final {metric} of B − A, paired on {', '.join(sweep.replicate_keys)}: paired "
                  "cells share the data, partition, initial model and client shuffling, and with a fixed "
                  "privacy-seed the cohorts and noise draws. Two-sided "
                  "paired t-test and Wilcoxon signed-rank test (`scipy.stats.ttest_rel`, `scipy.stats.wilcoxon`), "
                  "as measured, not corrected for multiple comparisons; with n pairs the exact two-sided "
                  "Wilcoxon p is at least 2/2ⁿ (0.25 for n = 3). – marks a statistic that is undefined: "
                  "fewer than 2 pairs, for the t-test every difference equal (zero variance), for Wilcoxon "
                  "every difference zero.", "",
                  *_header(["A", "B", *keys, "n", "B − A (mean ± std)", "t", "p (t-test)", "W", "p (Wilcoxon)"])]
        for c in comparisons:
            cells = [c.baseline, c.variant, *(format_grid_value(v) for _, v in c.condition), str(len(c.differences)),
                     f"{_num(c.mean, '+.4f')} ± {_num(c.std)}", _num(c.t_statistic, ".3f"), _num(c.t_pvalue, ".3g"),
                     _num(c.wilcoxon_statistic, "g"), _num(c.wilcoxon_pvalue, ".3g")]
            lines.append(_row(cells))
    if sweep.choices is not None:
        lines += ["", "## Tuned values", "", _tuning_sentence(sweep) + " Every setting's score, and how stable each "
                  "choice is (seeds agreeing, margin, grid edges): `tuning.md`.", "",
                  *_header(["variant", *keys, "chosen"])]
        for (variant, condition), chosen in sweep.choices.items():
            condition_values = dict(condition)
            lines.append(_row([variant, *(format_grid_value(condition_values[k]) if k in condition_values else "–"
                                          for k in keys),
                               ", ".join(f"{k} = {format_grid_value(v)}" for k, v in chosen.items())]))
    if sweep.audit is not None:
        lines += _audit_section(sweep, audits)
    lines += ["", "![accuracy vs round](accuracy_vs_round.png)", "", "![final accuracy vs ε](accuracy_vs_epsilon.png)"]
    return "\n".join(lines) + "\n"


def _audit_section(sweep: Sweep, audits: Sequence[AuditRow]) -> list[str]:
    """``## Privacy audit``: each audited mechanism's ε lower bounds next to its accounted ε, a verdict, its plot."""
    assert sweep.audit is not None
    keys, options = sweep.condition_keys, sweep.audit
    targets = sweep.audit_targets
    lines = ["", "## Privacy audit", "",
             f"Each variant's mechanism per condition, audited with canary clients (`fedhog audit`, "
             f"{options.runs} run{'s' if options.runs > 1 else ''}, worst-case canaries of length "
             f"{options.canary_norm:g}·C) with fresh noise, not the cells' fixed privacy seed. ε ≥ is a rigorous "
             f"lower bound at {options.confidence:.0%} confidence, for an attacker who sees every round's release "
             "and for one who sees only the final model: above the accounted ε, the mechanism does not have the ε "
             "it prints (broken); below it, it proves nothing about the guarantee (a lower bound is not a "
             "guarantee). μ̂ and its ε are a Gaussian-DP point estimate at the every-round test's own threshold, "
             "not a bound. The verdict is the every-round bound's.", "",
             *_header(["variant", *keys, "mechanism", "ε accounted", "ε ≥ every round", "ε ≥ final model",
                       "μ̂ (GDP)", "ε ≈ μ̂-GDP", "trials", "verdict"])]
    for row in audits:
        values = dict(row.condition)
        lines.append(_row([row.variant, *(format_grid_value(values[k]) if k in values else "–" for k in keys),
                           row.mechanism, _num(row.epsilon_accounted, ".3g"), _num(row.bound_every_round, ".3g"),
                           _num(row.bound_final_model, ".3g"), _num(row.gdp_mu, ".3f"), _num(row.epsilon_gdp, ".3g"),
                           f"{row.trials:,}", "**over its ε: broken**" if row.violated else "within its ε"]))
    missing = len(targets) - len(audits)
    if missing:
        lines += ["", f"{missing} of {len(targets)} audits did not finish (see the sweep's output); run the sweep "
                  "again to retry them."]
    audited = {t.variant for t in targets}
    skipped = [v for v in dict.fromkeys(c.variant for c in sweep.cells) if v not in audited]
    if skipped:
        lines += ["", f"Not audited: {', '.join(skipped)} "
                  + ("(not in [audit] variants, or no DP guarantee)." if options.variants else "(no DP guarantee).")]
    for row in audits:
        label = ", ".join([row.variant, *(f"{k}={format_grid_value(v)}" for k, v in row.condition)])
        lines += ["", f"![score distributions of included vs excluded canaries: {label}]({row.plot})"]
    return lines


def _tuning_sentence(sweep: Sweep) -> str:
    tuning = sweep.tuning
    assert tuning is not None
    grids = [_choices_of(tuning.grid)] if tuning.grid else []
    own = [f"{name}: {_choices_of(table)}" for name, table in tuning.per_variant.items()]
    return (f"Chosen per variant and condition on the server's validation set (never the test set): the highest mean "
            f"validation accuracy over the last {tuning.last_rounds} rounds, averaged over the tuning seeds "
            f"{', '.join(map(str, tuning.seeds))} (other data seeds than the cells')"
            + (f"; tuning runs stop after {tuning.rounds} rounds, at the noise multiplier calibrated for the cells' "
               "full horizon" if tuning.rounds else "")
            + f". Grid: {'; '.join(grids) or '–'}"
            + (f"; per variant: {'; '.join(own)}" if own else "")
            + (f"; a numeric key whose choice sits on the edge of the values tried is widened one step past it, up "
               f"to {tuning.widen} values ([tune] widen)" if tuning.widen else "; not widened ([tune] widen = 0)")
            + ".")


def _choices_of(grid: dict[str, list[Any]]) -> str:
    """``key ∈ {a, b}, key2 ∈ {c}``."""
    return ", ".join(f"{key} ∈ {{{', '.join(format_grid_value(v) for v in values)}}}" for key, values in grid.items())


def tuning_markdown(sweep: Sweep, scores: Sequence[TrialScore],
                    choices: dict[tuple[str, tuple], dict[str, Any]]) -> str:
    """``tuning.md``: every tuned setting's validation score per (variant, condition), the chosen one marked."""
    lines = [f"# Tuning of sweep `{sweep.path.name}`", "", _tuning_sentence(sweep), "",
             *_header(["variant", "condition", "setting", "seeds", "validation accuracy", "chosen"])]
    for (variant, condition, setting), (score, n) in setting_scores(scores).items():
        chosen = choices.get((variant, condition)) == dict(setting)
        lines.append(_row([variant, ", ".join(f"{k} = {format_grid_value(v)}" for k, v in condition) or "–",
                           ", ".join(f"{k} = {format_grid_value(v)}" for k, v in setting), str(n), _num(score),
                           "✔" if chosen else ""]))
    _, stuck = widening_trials(sweep, scores, choices)
    assert sweep.tuning is not None
    lines += ["", "## How stable each choice is", "",
              "Seeds agreeing: of the tuning seeds, how many would have chosen the same setting alone. Margin: the "
              "chosen setting's mean validation accuracy minus the runner-up's (a margin within the seeds' spread "
              "is a coin toss). Widened: the values tried past the grid, one step at a time (geometric for "
              f"positive values), while the choice sat on the edge, up to {sweep.tuning.widen} a key "
              "([tune] widen). On the edge: a numeric key whose chosen value is still the smallest or largest "
              "tried, and why it was not widened further — a wider grid may do better; widen it and run the "
              "sweep again (finished runs are kept).", "",
              *_header(["variant", "condition", "chosen", "seeds agreeing", "margin", "widened", "on the edge"])]
    for (variant, condition), stability in choice_stability(scores, choices).items():
        chosen_text = ", ".join(f"{k} = {format_grid_value(v)}" for k, v in choices[(variant, condition)].items())
        edges = [f"{key} ({stuck[(variant, condition, key)]})" if (variant, condition, key) in stuck else key
                 for key in stability.on_edge]
        lines.append(_row([variant, ", ".join(f"{k} = {format_grid_value(v)}" for k, v in condition) or "–",
                           chosen_text, f"{stability.seeds_agreeing} of {stability.seeds}",
                           _num(stability.margin), _widened(sweep, variant, condition) or "–",
                           "; ".join(edges) or "–"]))
    return "\n".join(lines) + "\n"


def _widened(sweep: Sweep, variant: str, condition: tuple) -> str:
    """``key: v1, v2`` for the values of each key tried past the grid for this (variant, condition)."""
    assert sweep.tuning is not None
    grid = sweep.tuning.grid_for(sweep.variant_named(variant))
    added: dict[str, list[Any]] = {}
    for trial in sweep.trials:
        if (trial.cell.variant, trial.condition) == (variant, condition):
            for key, value in trial.setting:
                if value not in grid[key] and value not in added.setdefault(key, []):
                    added[key].append(value)
    return "; ".join(f"{key}: {', '.join(format_grid_value(v) for v in values)}" for key, values in added.items()
                     if values)


def _row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(names: Sequence[str]) -> list[str]:
    return [_row(names), "|" + "---|" * len(names)]


def _num(value: float, spec: str = ".4f") -> str:
    return "–" if math.isnan(value) else format(value, spec)
