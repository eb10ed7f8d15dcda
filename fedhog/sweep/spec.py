"""The sweep file: reading and validating it, and expanding its grid into cells (the run config, no runner)."""

from __future__ import annotations

import itertools
import json
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..choices import CLIPPING_MECHANISMS
from ..config import NO_TARGET_EPSILON, ConfigError, RunConfig, load_config, read_toml, unknown_key_message
from .stats import TrialScore, beyond_edge, choice_stability

SWEEP_KEYS = ("output", "engine", "paired", "base", "grid", "variants", "tune", "audit")
TUNE_KEYS = ("grid", "variants", "seeds", "last-rounds", "rounds", "widen")
MAX_WIDEN = 10  # values a tuned key may be extended by past its grid
AUDIT_KEYS = ("runs", "canaries", "confidence", "canary-norm", "variants")
MAX_AUDIT_CANARIES = 2_000_000  # the vectorized harness's limit; the other harnesses' are lower (the audit says)
SWEEP_ENGINES = ("vectorized", "inprocess")  # both give the same results (tests/test_vectorized.py)
RESERVED_KEYS = ("results-dir", "resume")  # set by the sweep for every cell
REPLICATE_KEYS = ("seed", "privacy-seed")  # grid keys that repeat a condition rather than define one
PRIVACY_KEYS = ("target-epsilon", "noise-multiplier")  # grid keys that set ε (the x axis of the ε plot)
PRIVACY_SEED_TAG = 0xF3D405  # separates the privacy seeds from the data seeds
CONFIG_KEYS = tuple(f.name.replace("_", "-") for f in fields(RunConfig))


class SweepError(ConfigError):
    """A sweep file, or a sweep folder, that fedhog cannot run."""


@dataclass(frozen=True)
class Cell:
    """One federated run of a sweep.

    Attributes
    ----------
    cell_id : str
        Stable id from the variant name and the grid values; the run's folder name.
    variant : str
        The variant's name, or the cell's mechanism when the sweep has no variants.
    overrides : dict
        The grid values and the variant's keys, as the sweep file gives them.
    config : RunConfig
        The resolved run config; ``results-dir`` is the cell's folder.
    """

    cell_id: str
    variant: str
    overrides: dict[str, Any]
    config: RunConfig

    @property
    def directory(self) -> Path:
        """The cell's results folder."""
        return Path(self.config.results_dir)


@dataclass(frozen=True)
class Tuning:
    """The ``[tune]`` table: hyperparameters chosen per variant and condition on the server's validation set.

    Attributes
    ----------
    grid : dict
        Run-config key → values tried for every variant (all combinations).
    per_variant : dict
        Variant name → more keys and values tried for that variant only (its own γ).
    seeds : tuple of int
        The tuning runs' data seeds (disjoint from the grid's seeds).
    last_rounds : int
        A trial's score is its mean ``validation_accuracy`` over its last rounds, averaged over the seeds.
    rounds : int
        0: a tuning run is as long as a cell. Otherwise it stops after this many rounds, with the noise
        multiplier calibrated for the cell's full horizon (the same noise per round as the cell it tunes).
    widen : int
        How many values a numeric key may be extended by past its grid, one step at a time, while the chosen
        value sits on the edge of those tried (:func:`widening_trials`); 0: never.
    """

    grid: dict[str, list[Any]]
    per_variant: dict[str, dict[str, list[Any]]]
    seeds: tuple[int, ...]
    last_rounds: int = 5
    rounds: int = 0
    widen: int = 2

    def grid_for(self, variant: dict[str, Any] | None) -> dict[str, list[Any]]:
        """The keys tuned for a variant: the shared grid and its own, less the keys it sets itself."""
        own = self.per_variant.get(variant["name"], {}) if variant else {}
        keys = {**self.grid, **own}
        return {k: v for k, v in keys.items() if variant is None or k not in variant}


@dataclass(frozen=True)
class Trial:
    """One tuning run: a cell of a (variant, condition) with one combination of tuned values and one seed."""

    cell: Cell
    condition: tuple[tuple[str, Any], ...]
    setting: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class AuditOptions:
    """The ``[audit]`` table: every variant's mechanism audited per condition after the cells (``fedhog audit``).

    Attributes
    ----------
    runs, canaries, confidence, canary_norm
        As :func:`fedhog.audit` takes them (``canaries`` 0: the harness's default).
    variants : tuple of str
        The variants audited; empty: every variant with a DP guarantee.
    """

    runs: int = 1
    canaries: int = 0
    confidence: float = 0.95
    canary_norm: float = 100.0
    variants: tuple[str, ...] = ()

    def to_mapping(self) -> dict[str, Any]:
        """The options as the ``[audit]`` table writes them (what a stored audit is compared with)."""
        return {"runs": self.runs, "canaries": self.canaries, "confidence": self.confidence,
                "canary-norm": self.canary_norm, "variants": list(self.variants)}


@dataclass(frozen=True)
class AuditTarget:
    """One audited (variant, condition): the mechanism of its cells, with fresh noise."""

    audit_id: str
    variant: str
    condition: tuple[tuple[str, Any], ...]
    config: RunConfig  # the condition's cell config with privacy-seed = -1 (never the pairing seed)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep file and its cells."""

    path: Path
    output: Path
    base: dict[str, Any]
    grid: dict[str, list[Any]]
    variants: tuple[dict[str, Any], ...]
    paired: tuple[tuple[str, str], ...]
    cells: tuple[Cell, ...]
    engine: str = "vectorized"
    tuning: Tuning | None = None
    trials: tuple[Trial, ...] = ()
    choices: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]] | None = None
    audit: AuditOptions | None = None

    def tuned(self, choices: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]]) -> Sweep:
        """This sweep with every cell using the values chosen for its (variant, condition)."""
        cells = expand_cells(self.base, self.grid, self.variants, self.output, choices)
        return replace(self, cells=tuple(cells), choices=choices)

    @property
    def metric(self) -> str:
        """The test metric the report compares: the first of the cells' ``metrics`` (``accuracy`` by default)."""
        return self.cells[0].config.metrics.split(",")[0].strip() if self.cells else "accuracy"

    def variant_named(self, name: str) -> dict[str, Any] | None:
        """The ``[[variants]]`` table of that name (None in a sweep without variants)."""
        return next((v for v in self.variants if v["name"] == name), None)

    @property
    def audit_targets(self) -> list[AuditTarget]:
        """One per (variant, condition) that ``[audit]`` audits, from its first cell (the tuned one after tuning).

        The audit draws fresh noise (privacy-seed = -1) and ignores the data: seed and results-dir are reset.
        """
        if self.audit is None:
            return []
        targets: dict[tuple[str, tuple[tuple[str, Any], ...]], AuditTarget] = {}
        for cell in self.cells:
            wanted = (not self.audit.variants or cell.variant in self.audit.variants) and has_guarantee(cell.config)
            condition = tuple((k, cell.overrides[k]) for k in self.condition_keys if k in cell.overrides)
            if wanted and (cell.variant, condition) not in targets:
                config = replace(cell.config, privacy_seed=-1, seed=RunConfig.seed, results_dir="")
                targets[(cell.variant, condition)] = AuditTarget(
                    cell_id_of(cell.variant, dict(condition)), cell.variant, condition, config)
        return list(targets.values())

    @property
    def replicate_keys(self) -> list[str]:
        """Grid keys that pair cells (``seed``, ``privacy-seed``)."""
        return [key for key in self.grid if key in REPLICATE_KEYS] or ["seed"]

    @property
    def condition_keys(self) -> list[str]:
        """Grid keys that define a condition: all but the replicate keys (and ``mechanism`` without variants)."""
        return [key for key in self.grid
                if key not in REPLICATE_KEYS and (self.variants or key != "mechanism")]

    @property
    def fixed_keys(self) -> dict[str, list[str]]:
        """Variant name → the grid's condition keys that the variant sets itself."""
        return {v["name"]: [k for k in v if k in self.grid] for v in self.variants if any(k in self.grid for k in v)}

    def broadcast(self, rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows, with those of a variant that sets grid keys repeated for every grid value of those keys.

        A no-DP ceiling run once then appears in every ε condition, for pairing and plotting.
        """
        out: list[dict[str, Any]] = []
        fixed = self.fixed_keys
        for row in rows:
            keys = fixed.get(row["variant"], [])
            for values in itertools.product(*(self.grid[k] for k in keys)):
                cell_id = "__".join([row["cell_id"], *key_values(keys, values)])
                out.append({**row, **dict(zip(keys, values, strict=True)), "cell_id": cell_id})
        return out

    @property
    def column_keys(self) -> list[str]:
        """Config keys that get a column in ``results.csv``: mechanism, grid, variant keys, seed."""
        keys = ["mechanism", *self.grid, *(k for v in self.variants for k in v if k != "name"), "seed"]
        return list(dict.fromkeys(keys))


def load_sweep(path: str | Path, output: str | Path | None = None) -> Sweep:
    """Read and validate a sweep file and resolve every cell's config.

    Parameters
    ----------
    path : str or Path
        The sweep TOML.
    output : str or Path, optional
        Replaces the file's ``output``.

    Raises
    ------
    SweepError
        Naming the key (and the cell) that is wrong.
    """
    path = Path(path)
    document = read_toml(path, "sweep file", SweepError)
    for key in document:
        if key not in SWEEP_KEYS:
            raise SweepError(f"sweep file {path}: {unknown_key_message(key, SWEEP_KEYS, 'key')} "
                             "(run-config keys go under [base], [grid] or [[variants]])")
    engine = document.get("engine", "vectorized")
    if engine not in SWEEP_ENGINES:
        raise SweepError(f"sweep file {path}: engine={engine!r} is not allowed; expected one of "
                         f"{', '.join(SWEEP_ENGINES)}")
    output = document.get("output") if output is None else str(output)
    if not isinstance(output, str) or not output:
        raise SweepError(f"sweep file {path}: output={output!r} must be a folder name (a non-empty string)")
    base = _table(document, "base")
    grid = _table(document, "grid")
    _check_config_keys("[base]", base)
    _check_config_keys("[grid]", grid)
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"grid key '{key}' must be a non-empty list of values, got {values!r}")
        if len({json.dumps(v) for v in values}) != len(values):
            raise SweepError(f"grid key '{key}' repeats a value: {values!r}")
        if key in base:
            raise SweepError(f"key '{key}' is in both [base] and [grid]; keep it in one")
    variants = _variants(document.get("variants", []), grid)
    directory = Path(output).resolve()
    cells = tuple(expand_cells(base, grid, variants, directory))
    labels = list(dict.fromkeys(cell.variant for cell in cells))
    paired = _paired(document.get("paired", []), labels)
    compared = {cell.config.metrics.split(",")[0].strip() for cell in cells}
    if len(compared) > 1:
        raise SweepError(f"the cells compare different first metrics ({', '.join(sorted(compared))}): set "
                         "'metrics' in [base], not per variant or grid value")
    tuning = _tuning(document["tune"], base, grid, variants) if "tune" in document else None
    trials = tuple(expand_trials(base, grid, variants, tuning, directory)) if tuning else ()
    audit = _audit(document["audit"], cells) if "audit" in document else None
    return Sweep(path, directory, base, grid, variants, paired, cells, engine, tuning, trials, audit=audit)


def expand_cells(base: dict[str, Any], grid: dict[str, list[Any]], variants: Sequence[dict[str, Any]],
                 output: Path, choices: dict[tuple[str, tuple[tuple[str, Any], ...]], dict[str, Any]] | None = None
                 ) -> list[Cell]:
    """Every variant × every combination of grid values, with validated configs.

    Cells with the same ``seed`` get the same fixed ``privacy-seed``
    (:func:`privacy_seed_for`) unless the sweep sets one. With ``choices``
    (from tuning), a cell also takes the values chosen for its variant and
    condition (:func:`condition_of`).
    """
    cells: list[Cell] = []
    seen: dict[str, Cell] = {}
    named: list[dict[str, Any] | None] = [*variants] or [None]  # no variants: one unnamed
    for variant in named:
        keys = {k: v for k, v in (variant or {}).items() if k != "name"}
        variant_grid = {k: v for k, v in grid.items() if k not in keys}
        for values in itertools.product(*variant_grid.values()):
            grid_values = dict(zip(variant_grid, values, strict=True))
            mapping = {**base, **keys, **grid_values}
            name = variant["name"] if variant else str(mapping.get("mechanism", RunConfig.mechanism))
            chosen = (choices or {}).get((name, condition_of(grid_values)), {})
            cell_id = cell_id_of(variant["name"] if variant else None, grid_values)
            if cell_id in seen:
                raise SweepError(f"cells {seen[cell_id].overrides} and {grid_values} (variant '{name}') "
                                 f"have the same id '{cell_id}'; rename a variant")
            config = _cell_config(cell_id, {**base, **keys, **chosen, **grid_values}, output / "runs")
            cell = Cell(cell_id, name, {**grid_values, **keys, **chosen}, config)
            seen[cell_id] = cell
            cells.append(cell)
    return cells


def condition_of(grid_values: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The grid values that define a condition: all but the replicate keys (``seed``)."""
    return tuple((k, v) for k, v in grid_values.items() if k not in REPLICATE_KEYS)


def expand_trials(base: dict[str, Any], grid: dict[str, list[Any]], variants: Sequence[dict[str, Any]],
                  tuning: Tuning, output: Path) -> list[Trial]:
    """Every variant × condition × combination of its tuned values × tuning seed, in ``output/tuning``."""
    conditions = {k: v for k, v in grid.items() if k not in REPLICATE_KEYS}
    trials: list[Trial] = []
    named: list[dict[str, Any] | None] = [*variants] or [None]  # no variants: one unnamed
    for variant in named:
        keys = {k: v for k, v in (variant or {}).items() if k != "name"}
        variant_conditions = {k: v for k, v in conditions.items() if k not in keys}
        tuned = tuning.grid_for(variant)
        for condition_values in itertools.product(*variant_conditions.values()):
            condition = dict(zip(variant_conditions, condition_values, strict=True))
            for setting_values in itertools.product(*tuned.values()):
                setting = dict(zip(tuned, setting_values, strict=True))
                trials += [trial_of(base, variant, condition, setting, seed, tuning, output) for seed in tuning.seeds]
    return trials


def trial_of(base: dict[str, Any], variant: dict[str, Any] | None, condition: dict[str, Any],
             setting: dict[str, Any], seed: int, tuning: Tuning, output: Path) -> Trial:
    """One tuning run of a variant in a condition with a setting of its tuned keys, on a tuning seed."""
    keys = {k: v for k, v in (variant or {}).items() if k != "name"}
    mapping = {**base, **keys, **setting, **condition, "seed": seed}
    name = variant["name"] if variant else str(mapping.get("mechanism", RunConfig.mechanism))
    cell_id = cell_id_of(variant["name"] if variant else None, {**condition, **setting, "seed": seed})
    config = _cell_config(cell_id, mapping, output / "tuning")
    if tuning.rounds:
        config = _cell_config(cell_id, _shortened(mapping, config, tuning.rounds), output / "tuning")
    if config.server_validation_fraction == 0:
        raise SweepError(f"tuning cell '{cell_id}': [tune] chooses on the server's validation set, "
                         "never the test set: set server-validation-fraction > 0 in [base]")
    return Trial(Cell(cell_id, name, {**condition, **setting, "seed": seed}, config),
                 tuple(condition.items()), tuple(setting.items()))


def widening_trials(sweep: Sweep, scores: Sequence[TrialScore], choices: dict[tuple[str, tuple], dict[str, Any]]
                    ) -> tuple[list[Trial], dict[tuple[str, tuple, str], str]]:
    """The tuning trials of a grid widened past each choice on its edge, and why an edge is not widened.

    For every (variant, condition): each numeric tuned key whose chosen value is the smallest or largest
    tried (:func:`.stats.choice_stability`) gets the value one step further (:func:`.stats.beyond_edge`), up
    to ``[tune] widen`` values past its grid; the trials are the widened grid's settings not yet tried (all
    combinations with the other keys' values, so the grid stays a grid), on every tuning seed. The reasons
    are keyed by (variant, condition, key).
    """
    tuning = sweep.tuning
    assert tuning is not None
    trials: list[Trial] = []
    stuck: dict[tuple[str, tuple, str], str] = {}
    known = {(t.cell.variant, t.condition, t.setting) for t in sweep.trials}
    for (name, condition), stability in choice_stability(scores, choices).items():
        chosen, variant = choices[(name, condition)], sweep.variant_named(name)
        grid = tuning.grid_for(variant)
        tried = {key: list(dict.fromkeys(dict(t.setting)[key] for t in sweep.trials
                                         if (t.cell.variant, t.condition) == (name, condition))) for key in grid}
        widened = {key: list(values) for key, values in tried.items()}
        for key in stability.on_edge:
            value = beyond_edge(tried[key], chosen[key])
            if len([v for v in tried[key] if v not in grid[key]]) >= tuning.widen:
                stuck[(name, condition, key)] = (f"still on the edge after {tuning.widen} widening"
                                                 f"{'s' if tuning.widen > 1 else ''} ([tune] widen, the limit)"
                                                 if tuning.widen else "not widened ([tune] widen = 0)")
                continue
            if value is None:
                stuck[(name, condition, key)] = "the runs past it did not finish"
                continue
            try:
                trial_of(sweep.base, variant, dict(condition), {**chosen, key: value}, tuning.seeds[0], tuning,
                         sweep.output)
            except SweepError as error:
                stuck[(name, condition, key)] = (f"the next value {key} = {format_grid_value(value)} "
                                                 f"is refused: {error}")
                continue
            widened[key].append(value)
        for values in itertools.product(*widened.values()):
            setting = dict(zip(widened, values, strict=True))
            if (name, condition, tuple(setting.items())) not in known:
                trials += [trial_of(sweep.base, variant, dict(condition), setting, seed, tuning, sweep.output)
                           for seed in tuning.seeds]
    return trials, stuck


def _shortened(mapping: dict[str, Any], full: RunConfig, rounds: int) -> dict[str, Any]:
    """A tuning run of ``rounds`` rounds whose noise per round is the full-horizon cell's (σ calibrated for it)."""
    if rounds >= full.rounds:
        return mapping
    if not full.target_epsilon > 0:
        return {**mapping, "rounds": rounds}
    if full.noise == "distributed":  # σ_l is calibrated with the model's lattice, not by RunConfig.calibrated
        raise SweepError(f"[tune] rounds={rounds} cannot keep the full horizon's noise with noise=\"distributed\" and "
                         "a target-epsilon; expected [tune] rounds = 0 (tuning runs as long as the cells)")
    return {**mapping, "rounds": rounds, "target-epsilon": NO_TARGET_EPSILON,
            "noise-multiplier": _full_horizon_sigma(full)}


def _full_horizon_sigma(config: RunConfig) -> float:
    if config.calibration_inputs not in _SIGMAS:
        _SIGMAS[config.calibration_inputs] = config.calibrated().noise_multiplier
    return _SIGMAS[config.calibration_inputs]


_SIGMAS: dict[tuple[Any, ...], float] = {}  # calibrations are seconds each; many trials share one


def _cell_config(cell_id: str, mapping: dict[str, Any], folder: Path) -> RunConfig:
    """A cell's validated config: its own fixed privacy seed from its data seed, its folder under ``folder``."""
    seed = mapping.get("seed", RunConfig.seed)
    if "privacy-seed" not in mapping and isinstance(seed, int) and not isinstance(seed, bool):
        if seed < 0:
            raise SweepError(f"cell '{cell_id}': seed={seed!r} is not allowed; expected an integer ≥ 0")
        mapping = {**mapping, "privacy-seed": privacy_seed_for(seed)}
    try:
        return load_config(None, {**mapping, "results-dir": str(folder / cell_id)})
    except ConfigError as error:
        raise SweepError(f"cell '{cell_id}': {error}") from None


def _tuning(raw: Any, base: dict[str, Any], grid: dict[str, list[Any]],
            variants: Sequence[dict[str, Any]]) -> Tuning:
    if not isinstance(raw, dict):
        raise SweepError(f"'tune' must be a table ([tune]), got {raw!r}")
    for key in raw:
        if key not in TUNE_KEYS:
            raise SweepError(f"[tune]: {unknown_key_message(key, TUNE_KEYS, 'key')}")
    names = [v["name"] for v in variants]
    per_variant = _table(raw, "variants")
    for name in per_variant:
        if name not in names:
            raise SweepError(f"[tune.variants.{name}]: no variant '{name}'; variants: {', '.join(names) or 'none'}")
    tuned_grid = _tune_grid("[tune.grid]", _table(raw, "grid"), base, grid)
    per_variant = {name: _tune_grid(f"[tune.variants.{name}]", table, base, grid)
                   for name, table in per_variant.items()}
    if not tuned_grid and not any(per_variant.values()):
        raise SweepError("[tune] tunes nothing: give [tune.grid] or [tune.variants.<name>] keys with lists of values")
    seeds = raw.get("seeds", [])
    grid_seeds = set(grid.get("seed", [base.get("seed", RunConfig.seed)]))
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                       for s in seeds)):
        raise SweepError(f"[tune] seeds={seeds!r} is not allowed; expected a non-empty list of integers ≥ 0")
    if grid_seeds & set(seeds):
        raise SweepError(f"[tune] seeds={seeds!r} share {sorted(grid_seeds & set(seeds))} with the sweep's seeds: "
                         "tune on other data seeds than those the results are reported on")
    last_rounds = raw.get("last-rounds", 5)
    if not (isinstance(last_rounds, int) and not isinstance(last_rounds, bool) and last_rounds >= 1):
        raise SweepError(f"[tune] last-rounds={last_rounds!r} is not allowed; expected an integer ≥ 1")
    rounds = raw.get("rounds", 0)
    if not (isinstance(rounds, int) and not isinstance(rounds, bool) and rounds >= last_rounds) and rounds != 0:
        raise SweepError(f"[tune] rounds={rounds!r} is not allowed; expected 0 (as long as the cells) or an "
                         f"integer ≥ last-rounds ({last_rounds})")
    widen = raw.get("widen", Tuning.widen)
    if not (isinstance(widen, int) and not isinstance(widen, bool) and 0 <= widen <= MAX_WIDEN):
        raise SweepError(f"[tune] widen={widen!r} is not allowed; expected an integer in 0..{MAX_WIDEN} (how many "
                         "values past its grid a key may be extended by while the choice sits on the edge)")
    return Tuning(tuned_grid, per_variant, tuple(seeds), last_rounds, rounds, widen)


def has_guarantee(config: RunConfig) -> bool:
    """Whether the config's release has a DP guarantee (an accounted ε < ∞) for an audit to test."""
    if config.client_dp == "dpsgd":
        return True
    return config.mechanism in CLIPPING_MECHANISMS and (config.target_epsilon > 0 or config.noise_multiplier > 0)


def _audit(raw: Any, cells: Sequence[Cell]) -> AuditOptions:
    if not isinstance(raw, dict):
        raise SweepError(f"'audit' must be a table ([audit]), got {raw!r}")
    for key in raw:
        if key not in AUDIT_KEYS:
            raise SweepError(f"[audit]: {unknown_key_message(key, AUDIT_KEYS, 'key')}")
    defaults = AuditOptions()

    def number(key: str, ok: Any, expected: str, integer: bool = False) -> Any:
        value = raw.get(key, getattr(defaults, key.replace("-", "_")))
        kind = isinstance(value, int) if integer else isinstance(value, (int, float))
        if isinstance(value, bool) or not kind or not ok(value):
            raise SweepError(f"[audit] {key}={value!r} is not allowed; expected {expected}")
        return value

    runs = number("runs", lambda v: v >= 1, "an integer ≥ 1", integer=True)
    canaries = number("canaries", lambda v: v == 0 or 2 <= v <= MAX_AUDIT_CANARIES,
                      f"0 (the harness's default) or an integer in 2..{MAX_AUDIT_CANARIES}", integer=True)
    confidence = number("confidence", lambda v: 0 < v < 1, "a number in (0, 1)")
    canary_norm = number("canary-norm", lambda v: math.isfinite(v) and v > 0,
                         "a finite number > 0 (a canary's update length in units of C)")
    names = list(dict.fromkeys(cell.variant for cell in cells))
    guaranteed = [n for n in names if any(has_guarantee(c.config) for c in cells if c.variant == n)]
    variants = raw.get("variants", [])
    if not (isinstance(variants, list) and all(isinstance(v, str) for v in variants)):
        raise SweepError(f"[audit] variants={variants!r} is not allowed; expected a list of variant names "
                         f"({', '.join(guaranteed) or 'none has a DP guarantee'})")
    for name in variants:
        if name not in names:
            raise SweepError(f"[audit] variants: no variant '{name}'; variants: {', '.join(names)}")
        if name not in guaranteed:
            raise SweepError(f"[audit] variants: variant '{name}' has no DP guarantee (ε = ∞): nothing to audit; "
                             f"expected variants with one: {', '.join(guaranteed) or 'none'}")
    if not variants and not guaranteed:
        raise SweepError("[audit]: no variant has a DP guarantee (ε = ∞ everywhere): nothing to audit")
    return AuditOptions(runs, canaries, float(confidence), float(canary_norm), tuple(variants))


def _tune_grid(where: str, table: dict[str, Any], base: dict[str, Any], grid: dict[str, list[Any]]
               ) -> dict[str, list[Any]]:
    _check_config_keys(where, table)
    for key, values in table.items():
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: '{key}' must be a non-empty list of values, got {values!r}")
        if key in grid or key in REPLICATE_KEYS:
            raise SweepError(f"{where}: '{key}' is a [grid] key or a seed; tune keys the grid does not set")
        if key in base:
            raise SweepError(f"{where}: '{key}' is also in [base]; keep it in one")
    return table


def privacy_seed_for(seed: int) -> int:
    """The fixed privacy seed of every sweep cell with data seed ``seed`` (experiments only)."""
    return int(np.random.SeedSequence([PRIVACY_SEED_TAG, seed]).generate_state(1)[0])


def cell_id_of(variant: str | None, grid_values: dict[str, Any]) -> str:
    """``<variant>__<key>=<value>__...`` in file-name-safe ASCII (``γ`` becomes ``gamma``)."""
    parts = ([_slug(variant)] if variant is not None else []) + [
        f"{key}={_slug(format_grid_value(value))}" for key, value in grid_values.items()]
    return "__".join(parts) or "base"


def _table(document: dict[str, Any], key: str) -> dict[str, Any]:
    table = document.get(key, {})
    if not isinstance(table, dict):
        raise SweepError(f"'{key}' must be a table ([{key}]), got {table!r}")
    return table


def _check_config_keys(where: str, table: dict[str, Any]) -> None:
    for key in table:
        if key not in CONFIG_KEYS:
            raise SweepError(f"{where}: {unknown_key_message(key, CONFIG_KEYS, 'run-config key')}")
        if key in RESERVED_KEYS:
            raise SweepError(f"{where}: '{key}' is set by the sweep for every cell (output/runs/<cell-id>)")


def _variants(raw: Any, grid: dict[str, list[Any]]) -> tuple[dict[str, Any], ...]:
    if not isinstance(raw, list) or not all(isinstance(v, dict) for v in raw):
        raise SweepError(f"'variants' must be an array of tables ([[variants]]), got {raw!r}")
    names: set[str] = set()
    for index, variant in enumerate(raw, 1):
        name = variant.get("name")
        if not isinstance(name, str) or not name:
            raise SweepError(f"variant #{index} ({variant}) needs a 'name' (a non-empty string)")
        if name in names:
            raise SweepError(f"variant name '{name}' is used twice")
        names.add(name)
        keys = {k: v for k, v in variant.items() if k != "name"}
        _check_config_keys(f"variant '{name}'", keys)
        for key in keys:
            if key in grid and key in REPLICATE_KEYS:
                raise SweepError(f"variant '{name}' sets '{key}', a [grid] key that pairs cells; "
                                 "a variant may set only the grid's condition keys")
    return tuple(raw)


def _paired(raw: Any, labels: list[str]) -> tuple[tuple[str, str], ...]:
    if not isinstance(raw, list):
        raise SweepError(f"paired={raw!r} must be a list of [A, B] pairs of variant names")
    pairs = []
    for pair in raw:
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
            raise SweepError(f"paired entry {pair!r} must be a pair [A, B] of variant names")
        for name in pair:
            if name not in labels:
                raise SweepError(f"paired entry {pair!r}: no variant '{name}'; variants: {', '.join(labels)}")
        if pair[0] == pair[1]:
            raise SweepError(f"paired entry {pair!r} compares a variant with itself")
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)


def format_grid_value(value: Any) -> str:
    """A grid value as cell ids and labels show it (``true``, ``3.0``, ``hog``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def key_values(keys: Sequence[str], values: Sequence[Any]) -> list[str]:
    """``key=value`` for each grid key and its value (``target-epsilon=3.0``)."""
    return [f"{key}={format_grid_value(value)}" for key, value in zip(keys, values, strict=True)]


def _slug(text: str) -> str:
    out = []
    for char in text:
        if char.isascii() and (char.isalnum() or char in "._-+="):
            out.append(char)
        elif not char.isascii() and char.isalpha():
            out.append(unicodedata.name(char, "-").split()[-1].lower())
        else:
            out.append("-")
    return "".join(out)
