"""Statistics of a sweep's rows: final rounds, groups, mean ± std and paired comparisons (numpy, scipy)."""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import stats

DIFFERENCE_DECIMALS = 12  # paired differences of accuracies are rounded to this many decimals before testing


@dataclass(frozen=True)
class PairedComparison:
    """The final test metric of variant B minus variant A, paired on the replicate keys, in one condition."""

    baseline: str
    variant: str
    condition: tuple[tuple[str, Any], ...]
    replicates: tuple[tuple[Any, ...], ...]
    differences: tuple[float, ...]
    t_statistic: float
    t_pvalue: float
    wilcoxon_statistic: float
    wilcoxon_pvalue: float

    @property
    def mean(self) -> float:
        """Mean difference B − A."""
        return float(np.mean(self.differences)) if self.differences else math.nan

    @property
    def std(self) -> float:
        """Sample standard deviation of the differences (NaN below two pairs)."""
        return float(np.std(self.differences, ddof=1)) if len(self.differences) > 1 else math.nan


def final_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last round's row of every cell."""
    last: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["cell_id"] not in last or row["round"] > last[row["cell_id"]]["round"]:
            last[row["cell_id"]] = row
    return list(last.values())


def group_rows(rows: Sequence[dict[str, Any]], keys: Sequence[str]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    """The rows by their values of ``keys``, in first-seen order."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in keys), []).append(row)
    return groups


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std of the values but NaNs; NaN where undefined (std below two values)."""
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return math.nan, math.nan
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else math.nan


def paired_comparisons(rows: Sequence[dict[str, Any]], pairs: Sequence[tuple[str, str]],
                       condition_keys: Sequence[str], replicate_keys: Sequence[str],
                       metric: str = "accuracy") -> list[PairedComparison]:
    """The final test ``metric`` of B − A per condition, paired on the replicate keys; paired t-test and Wilcoxon.

    Both tests are two-sided (``scipy.stats.ttest_rel``, ``scipy.stats.wilcoxon``) on the
    differences rounded to :data:`DIFFERENCE_DECIMALS` decimals, so that differences equal
    but for float rounding are equal. A statistic that is undefined is NaN: both with
    fewer than two pairs, the t-test when every difference is the same (zero variance),
    the Wilcoxon test when every difference is zero.
    """
    finals = final_rows(rows)
    conditions = list(dict.fromkeys(tuple((k, row[k]) for k in condition_keys) for row in finals))
    comparisons = []
    for baseline, variant in pairs:
        for condition in conditions:
            a, b = (_metric_by_replicate(finals, name, condition, replicate_keys, metric)
                    for name in (baseline, variant))
            replicates = tuple(sorted(set(a) & set(b)))
            first, second = np.array([a[r] for r in replicates]), np.array([b[r] for r in replicates])
            differences = np.round(second - first, DIFFERENCE_DECIMALS) + 0.0  # + 0.0: no -0.0
            comparisons.append(PairedComparison(baseline, variant, condition, replicates,
                                                tuple(differences.tolist()), *_paired_tests(differences)))
    return comparisons


def _metric_by_replicate(finals: Sequence[dict[str, Any]], variant: str, condition: tuple[tuple[str, Any], ...],
                         replicate_keys: Sequence[str], metric: str) -> dict[tuple[Any, ...], float]:
    return {tuple(row[k] for k in replicate_keys): row[metric] for row in finals
            if row["variant"] == variant and all(row[k] == v for k, v in condition)}


def _paired_tests(differences: np.ndarray) -> tuple[float, float, float, float]:
    """t, p (paired t-test), W, p (Wilcoxon) of B − A; NaN where undefined (see :func:`paired_comparisons`)."""
    nan = (math.nan, math.nan)
    if len(differences) < 2:
        return nan + nan
    t_result = w_result = nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy warns about ties and small samples; the values are as computed
        if np.ptp(differences) > 0:  # zero variance: t = ±∞ or 0/0, whatever the float noise said
            t_test = stats.ttest_1samp(differences, 0.0)  # = ttest_rel(B, A)
            t_result = (float(t_test.statistic), float(t_test.pvalue))
        if np.any(differences != 0):
            wilcoxon = stats.wilcoxon(differences)
            w_result = (float(wilcoxon.statistic), float(wilcoxon.pvalue))
    return *t_result, *w_result


@dataclass(frozen=True)
class TrialScore:
    """One finished tuning run's validation score."""

    variant: str
    condition: tuple[tuple[str, Any], ...]
    setting: tuple[tuple[str, Any], ...]
    score: float
    seed: int = 0  # the tuning run's data seed


@dataclass(frozen=True)
class ChoiceStability:
    """How much to trust one tuned choice: do the seeds agree, by how much did it win, is it on the grid's edge."""

    seeds_agreeing: int  # tuning seeds whose own best setting is the chosen one
    seeds: int
    margin: float  # the chosen setting's mean score minus the runner-up's (NaN with a single setting)
    on_edge: tuple[str, ...]  # numeric keys whose chosen value is the smallest or largest value tried


def choice_stability(scores: Sequence[TrialScore],
                     choices: dict[tuple[str, tuple], dict[str, Any]]) -> dict[tuple[str, tuple], ChoiceStability]:
    """(variant, condition) → :class:`ChoiceStability` of its chosen setting, from every tuning run's score."""
    out = {}
    for (variant, condition), chosen in choices.items():
        mine = [s for s in scores if (s.variant, s.condition) == (variant, condition)]
        by_seed: dict[int, list[TrialScore]] = {}
        for s in mine:
            by_seed.setdefault(s.seed, []).append(s)
        agreeing = sum(dict(best_settings(runs).get((variant, condition), {})) == chosen
                       for runs in by_seed.values())
        means = sorted((score for (v, c, _), (score, _) in setting_scores(mine).items()
                        if (v, c) == (variant, condition) and not math.isnan(score)), reverse=True)
        margin = means[0] - means[1] if len(means) > 1 else math.nan
        edge = []
        for key, value in chosen.items():
            tried = {dict(s.setting)[key] for s in mine}
            numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in tried)
            if numeric and len(tried) > 1 and value in (min(tried), max(tried)):
                edge.append(key)
        out[(variant, condition)] = ChoiceStability(agreeing, len(by_seed), margin, tuple(edge))
    return out


def beyond_edge(tried: Sequence[Any], value: Any) -> Any:
    """The value one step past ``value`` when it is the smallest or largest of ``tried``, else None.

    Geometric when every value tried is > 0 (the edge times its ratio to its neighbour: 0.1, 0.3 → 0.9 or
    0.033), arithmetic otherwise (the edge plus its gap to its neighbour); integers stay integers, at least one
    apart. None with fewer than two distinct values. Floats are rounded to 12 significant digits.
    """
    values = sorted(set(tried))
    if len(values) < 2 or value not in (values[0], values[-1]):
        return None
    edge, neighbour = (values[-1], values[-2]) if value == values[-1] else (values[0], values[1])
    step = edge * edge / neighbour if values[0] > 0 else 2 * edge - neighbour
    if all(isinstance(v, int) for v in values):
        rounded = round(step)
        return rounded if rounded != edge else edge + (1 if edge > neighbour else -1)
    return float(f"{step:.12g}")


def validation_score(rounds: Sequence[dict[str, Any]], last_rounds: int) -> float:
    """Mean ``validation_accuracy`` over the last ``last_rounds`` rounds (NaN when there is none)."""
    values = [r["validation_accuracy"] for r in rounds[-last_rounds:] if r.get("validation_accuracy") is not None]
    return float(np.mean(values)) if values else math.nan


def setting_scores(scores: Sequence[TrialScore]) -> dict[tuple[str, tuple, tuple], tuple[float, int]]:
    """(variant, condition, setting) → (mean score over its seeds, number of seeds), in first-seen order."""
    grouped: dict[tuple[str, tuple, tuple], list[float]] = {}
    for s in scores:
        grouped.setdefault((s.variant, s.condition, s.setting), []).append(s.score)
    return {key: (float(np.mean(values)), len(values)) for key, values in grouped.items()}


def best_settings(scores: Sequence[TrialScore]) -> dict[tuple[str, tuple], dict[str, Any]]:
    """(variant, condition) → the setting with the highest mean score (the first one on ties; NaN never wins)."""
    best: dict[tuple[str, tuple], tuple[float, tuple]] = {}
    for (variant, condition, setting), (score, _) in setting_scores(scores).items():
        if math.isnan(score):
            continue
        if (variant, condition) not in best or score > best[(variant, condition)][0]:
            best[(variant, condition)] = (score, setting)
    return {key: dict(setting) for key, (_, setting) in best.items()}

