"""Sweeps: grid expansion, validation, resumable runs, tidy outputs and paired statistics."""

from __future__ import annotations

import csv
import itertools
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import read_metrics
from scipy import stats

from fedhog.sweep.report import summary_markdown, tuning_markdown
from fedhog.sweep.runner import run_sweep, sweep_command
from fedhog.sweep.spec import SweepError, cell_id_of, load_sweep, privacy_seed_for
from fedhog.sweep.stats import paired_comparisons

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "sweep_smoke.toml"
PNG_HEADER = b"\x89PNG\r\n\x1a\n"


def _calibrate_once(patch: pytest.MonkeyPatch) -> None:
    """σ calibrated once for each set of inputs: a sweep's cells of one ε share it. The calibration is a pure
    function of its arguments, and its PLD search takes a second or more (most of a tiny sweep's time)."""
    from functools import cache

    from fedhog.privacy import calibration  # what every run's calibration calls, where it calls it

    patch.setattr(calibration, "calibrate_noise_multiplier", cache(calibration.calibrate_noise_multiplier))


@pytest.fixture
def calibrated_once(monkeypatch):
    _calibrate_once(monkeypatch)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke sweep, run once for the module: (sweep, outcome)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FEDHOG_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        _calibrate_once(patch)
        sweep = load_sweep(SMOKE, tmp_path_factory.mktemp("smoke") / "out")
        yield sweep, run_sweep(sweep, show_progress=False)


def _read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def test_the_grid_is_every_variant_times_every_combination(tmp_path):
    path = _write(tmp_path, """
output = "out"
[base]
dataset = "digits"
model = "logreg"
population = 10
sampling-rate = 0.5
[grid]
target-epsilon = [1.0, 3.0, 8.0]
seed = [0, 1]
[[variants]]
name = "gaussian"
mechanism = "gaussian"
[[variants]]
name = "hog-γ1"
mechanism = "hog"
mixing-strength = 1.0
""")
    sweep = load_sweep(path)
    assert len(sweep.cells) == 2 * 3 * 2
    combos = {(c.variant, c.config.target_epsilon, c.config.seed) for c in sweep.cells}
    assert combos == set(itertools.product(["gaussian", "hog-γ1"], [1.0, 3.0, 8.0], [0, 1]))
    assert len({c.cell_id for c in sweep.cells}) == len(sweep.cells)
    assert {c.cell_id for c in sweep.cells} == {c.cell_id for c in load_sweep(path).cells}  # stable
    assert "hog-gamma1__target-epsilon=3.0__seed=1" in {c.cell_id for c in sweep.cells}
    for cell in sweep.cells:
        assert cell.config.privacy_seed == privacy_seed_for(cell.config.seed)
        assert cell.directory == (Path.cwd() / "out" / "runs" / cell.cell_id).resolve()
        assert (cell.config.mechanism, cell.config.mixing_strength) == (
            ("gaussian", 0.5) if cell.variant == "gaussian" else ("hog", 1.0))
    assert privacy_seed_for(0) != privacy_seed_for(1)
    assert sweep.condition_keys == ["target-epsilon"] and sweep.replicate_keys == ["seed"]


def test_a_variant_that_sets_a_condition_key_runs_once_per_replicate(tmp_path):
    sweep = load_sweep(_write(tmp_path, """
output = "out"
[grid]
target-epsilon = [1.0, 3.0]
seed = [0, 1]
[[variants]]
name = "gaussian"
mechanism = "gaussian"
[[variants]]
name = "no-dp"
mechanism = "none"
target-epsilon = -1.0
"""))
    ceiling = [c for c in sweep.cells if c.variant == "no-dp"]
    assert [c.cell_id for c in ceiling] == ["no-dp__seed=0", "no-dp__seed=1"]
    assert all(c.config.target_epsilon == -1.0 and c.config.mechanism == "none" for c in ceiling)
    assert sweep.fixed_keys == {"no-dp": ["target-epsilon"]}
    rows = [{"cell_id": "no-dp__seed=0", "variant": "no-dp", "target-epsilon": -1.0, "seed": 0},
            {"cell_id": "gaussian__target-epsilon=1.0__seed=0", "variant": "gaussian", "target-epsilon": 1.0,
             "seed": 0}]
    broadcast = sweep.broadcast(rows)
    assert [(r["variant"], r["target-epsilon"]) for r in broadcast] == [("no-dp", 1.0), ("no-dp", 3.0),
                                                                         ("gaussian", 1.0)]
    assert len({r["cell_id"] for r in broadcast}) == 3


def test_without_variants_the_mechanism_names_the_cells(tmp_path):
    sweep = load_sweep(_write(tmp_path, """
output = "out"
[base]
noise-multiplier = 1.0
[grid]
mechanism = ["gaussian", "hog"]
seed = [0, 1, 2]
"""))
    assert [c.variant for c in sweep.cells] == ["gaussian"] * 3 + ["hog"] * 3
    assert sweep.cells[0].cell_id == cell_id_of(None, {"mechanism": "gaussian", "seed": 0})
    assert sweep.condition_keys == []


def test_the_committed_privacy_utility_sweep_is_valid():
    sweep = load_sweep(ROOT / "configs" / "sweep_privacy_utility.toml")
    assert len(sweep.cells) == 6 * 3 * 5 + 5
    assert sweep.fixed_keys == {"no-dp": ["target-epsilon"]}
    assert {c.config.target_epsilon for c in sweep.cells} == {-1.0, 1.0, 3.0, 8.0}
    assert ("hog-random-term", "hog-γ0.5") in sweep.paired
    control = next(c for c in sweep.cells if c.variant == "hog-random-term")
    assert (control.config.mechanism, control.config.hog_term) == ("hog", "random")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("sweep_*.toml")), ids=lambda p: p.stem)
def test_every_committed_sweep_file_loads_and_its_tuning_holds_a_validation_set(path):
    sweep = load_sweep(path)
    assert sweep.cells
    assert all(t.cell.config.server_validation_fraction > 0 for t in sweep.trials)


def test_the_tuned_sweeps_tune_every_variant_per_condition():
    sweep = load_sweep(ROOT / "configs" / "sweep_convergence.toml")
    conditions = {(t.cell.variant, t.condition) for t in sweep.trials}
    assert {c for v, c in conditions if v == "hog"} == {(("model", m), ("target-epsilon", e))
                                                          for m in ("mlp", "cnn1d") for e in (1.0, 3.0, 8.0)}
    hog = {t.setting for t in sweep.trials if t.cell.variant == "hog"}
    assert len(hog) == 2 * 3 * 2 and {dict(s)["mixing-strength"] for s in hog} == {0.25, 0.5}
    control = {t.setting for t in sweep.trials if t.cell.variant == "hog-random-term"}
    assert control == hog  # the random-term control is tuned over the same settings as the term it controls
    assert {c.config.hog_term for c in sweep.cells if c.variant == "hog-random-term"} == {"random"}
    assert {t.cell.config.rounds for t in sweep.trials} == {30} and {c.config.rounds for c in sweep.cells} == {100}
    assert {c.config.seed for c in sweep.cells} == set(range(5))


@pytest.mark.parametrize("text, match", [
    ('output = "o"\nnoise = 1', "unknown key 'noise'"),
    ('[grid]\nseed = [0]', "output=None"),
    ('output = "o"\n[grid]\nseed = 3', "grid key 'seed' must be a non-empty list.*3"),
    ('output = "o"\n[grid]\nseed = []', "grid key 'seed' must be a non-empty list"),
    ('output = "o"\n[grid]\nseed = [1, 1]', "grid key 'seed' repeats a value"),
    ('output = "o"\n[grid]\nnoise-multipler = [1.0]', r"\[grid\]: unknown run-config key 'noise-multipler'"),
    ('output = "o"\n[base]\nresults-dir = "x"', r"\[base\]: 'results-dir' is set by the sweep"),
    ('output = "o"\n[base]\nseed = 1\n[grid]\nseed = [0]', "'seed' is in both"),
    ('output = "o"\n[[variants]]\nmechanism = "hog"', "variant #1 .* needs a 'name'"),
    ('output = "o"\n[[variants]]\nname = "a"\n[[variants]]\nname = "a"', "variant name 'a' is used twice"),
    ('output = "o"\n[grid]\nseed = [0]\n[[variants]]\nname = "a"\nseed = 1',
     r"variant 'a' sets 'seed', a \[grid\] key that pairs cells"),
    ('output = "o"\n[[variants]]\nname = "a"\nmixing = 1.0', "variant 'a': unknown run-config key 'mixing'"),
    ('output = "o"\npaired = [["a", "b"]]\n[[variants]]\nname = "a"', "no variant 'b'"),
    ('output = "o"\n[grid]\nmechanism = ["hog", "laplace"]', "cell 'mechanism=laplace': mechanism='laplace'"),
    ('output = "o"\n[base]\nnoise-multiplier = 1.0\n[grid]\ntarget-epsilon = [1.0]',
     "cell 'target-epsilon=1.0': noise-multiplier=1.0 and target-epsilon=1.0 are both set"),
    ('output = "o"\n[grid]\nseed = ["zero"]', "cell 'seed=zero': seed='zero' has the wrong type"),
])
def test_bad_sweep_files_name_the_key(tmp_path, text, match):
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, text))


def test_the_smoke_sweep_writes_the_csv_summary_and_plots(smoke):
    sweep, outcome = smoke
    assert not outcome.failed and len(outcome.ran) == 14 and not outcome.skipped
    rows = _read_csv(sweep.output / "results.csv")
    assert len(rows) == 14 * (2 + 1)  # 14 cells × (round 0 + 2 rounds)
    for key in ("cell_id", "variant", "mechanism", "target-epsilon", "seed", "mixing-strength", "round",
                "accuracy", "loss", "epsilon", "seconds", "sigma", "cell_seconds"):
        assert key in rows[0], key
    assert {(r["cell_id"], r["round"]) for r in rows} == {(c.cell_id, str(i)) for c in sweep.cells for i in range(3)}
    finals = [r for r in rows if r["round"] == "2"]
    for row in finals:
        if row["variant"] == "no-dp":
            assert row["epsilon"] == "inf" and row["target-epsilon"] == "-1.0"
        else:
            assert 0 < float(row["epsilon"]) <= float(row["target-epsilon"]) * 1.001
    # paired cells (same seed) share the initial model, and fedhog's Poisson cells the cohorts
    for seed in ("0", "1"):
        same_seed = [r for r in rows if r["seed"] == seed]
        assert len({r["accuracy"] for r in same_seed if r["round"] == "0"}) == 1
        assert len({r["clients_sampled"] for r in same_seed
                    if r["round"] == "1" and r["aggregator"] == "fedhog"}) == 1
    assert {r["clients_sampled"] for r in rows if r["variant"] == "flower-dp" and r["round"] != "0"} == {"5"}
    summary = (sweep.output / "summary.md").read_text()
    assert "14 of 14 cells finished" in summary
    # the diagnostics of the released model: every round's worst layer; the noise walk only where there is noise
    trained = [r for r in rows if r["round"] != "0"]
    assert all(float(r["weight_growth_max"]) > 0 for r in trained)
    assert all(r["noise_walk_max"] in ("", "nan") for r in trained if r["variant"] == "no-dp")
    assert all(float(r["noise_walk_max"]) > 0 for r in trained if r["variant"] == "gaussian")
    assert "| weight growth | noise walk | saturated |" in summary
    lines = summary.splitlines()
    assert [line.split(" | ")[:2] for line in lines if line.startswith(("| gaussian | 3", "| hog | 8"))] == [
        ["| gaussian", "3.0"], ["| hog", "8.0"]]
    assert sum(line.startswith("| gaussian | hog | ") for line in lines) == 2  # one paired row per ε
    # the ceiling, run once per seed, is paired with every ε
    assert sum(line.startswith(("| gaussian | no-dp | 3.0 | 2 |", "| gaussian | no-dp | 8.0 | 2 |"))
               for line in lines) == 2
    for name in ("accuracy_vs_round.png", "accuracy_vs_epsilon.png"):
        data = (sweep.output / name).read_bytes()
        assert data.startswith(PNG_HEADER) and len(data) > 5000


def test_paired_statistics_match_scipy_on_the_csv(smoke):
    sweep, outcome = smoke
    rows = [r for r in _read_csv(sweep.output / "results.csv") if r["round"] == "2"]
    summary = (sweep.output / "summary.md").read_text()
    hog = [c for c in outcome.comparisons if (c.baseline, c.variant) == ("gaussian", "hog")]
    assert [c.condition for c in hog] == [(("target-epsilon", 3.0),), (("target-epsilon", 8.0),)]
    for comparison in hog:
        epsilon = str(comparison.condition[0][1])
        final = {(r["variant"], r["seed"]): float(r["accuracy"]) for r in rows if r["target-epsilon"] == epsilon}
        a = np.array([final["gaussian", s] for s in ("0", "1")])
        b = np.array([final["hog", s] for s in ("0", "1")])
        t_test, wilcoxon = stats.ttest_rel(b, a), stats.wilcoxon(b - a)
        assert comparison.replicates == ((0,), (1,))
        assert comparison.differences == pytest.approx(b - a)
        if np.ptp(np.round(b - a, 12)) == 0:  # equal differences: the t-test is undefined (see below)
            t_test = stats.ttest_1samp([np.nan], 0.0)
        assert comparison.t_statistic == pytest.approx(t_test.statistic, nan_ok=True)
        assert comparison.t_pvalue == pytest.approx(t_test.pvalue, nan_ok=True)
        assert comparison.wilcoxon_statistic == pytest.approx(wilcoxon.statistic, nan_ok=True)
        assert comparison.wilcoxon_pvalue == pytest.approx(wilcoxon.pvalue, nan_ok=True)
        assert f"{comparison.mean:+.4f}" in summary
    ceiling = {r["seed"]: float(r["accuracy"]) for r in rows if r["variant"] == "no-dp"}
    for comparison in (c for c in outcome.comparisons if c.variant == "no-dp"):
        epsilon = str(comparison.condition[0][1])
        gaussian = {r["seed"]: float(r["accuracy"]) for r in rows
                    if r["variant"] == "gaussian" and r["target-epsilon"] == epsilon}
        assert comparison.differences == pytest.approx([ceiling[s] - gaussian[s] for s in ("0", "1")])


def test_rerunning_skips_finished_cells_and_reruns_crashed_or_deleted_ones(smoke, tmp_path):
    sweep, _ = smoke
    output = tmp_path / "copy"
    shutil.copytree(sweep.output, output)
    copy = load_sweep(SMOKE, output)
    mtimes = {c.cell_id: (c.directory / "metrics.json").stat().st_mtime_ns for c in copy.cells}

    again = run_sweep(copy, show_progress=False)
    assert not again.ran and len(again.skipped) == 14
    assert mtimes == {c.cell_id: (c.directory / "metrics.json").stat().st_mtime_ns for c in copy.cells}

    crashed, deleted = copy.cells[0], copy.cells[-1]
    assert deleted.config.aggregator == "flower-dp"
    document = read_metrics(crashed.directory)
    deleted_document = read_metrics(deleted.directory)
    (crashed.directory / "metrics.json").write_text(json.dumps({**document, "status": "failed"}))
    shutil.rmtree(deleted.directory)
    third = run_sweep(copy, show_progress=False)
    assert set(third.ran) == {crashed.cell_id, deleted.cell_id} and len(third.skipped) == 12
    for cell in copy.cells[1:-1]:
        assert (cell.directory / "metrics.json").stat().st_mtime_ns == mtimes[cell.cell_id]
    assert read_metrics(deleted.directory)["status"] == "finished"
    # the fixed privacy seed reproduces the crashed cell's run exactly, and Flower's baseline too
    assert read_metrics(crashed.directory)["rounds"][-1]["accuracy"] == \
        document["rounds"][-1]["accuracy"]
    assert [r["accuracy"] for r in read_metrics(deleted.directory)["rounds"]] == \
        [r["accuracy"] for r in deleted_document["rounds"]]
    assert len(_read_csv(output / "results.csv")) == 14 * 3


def test_threads_must_be_positive(smoke):
    with pytest.raises(SweepError, match="threads=0"):
        run_sweep(smoke[0], show_progress=False, threads=0)


def test_a_finished_cell_run_with_another_config_is_an_error(smoke, tmp_path):
    sweep, _ = smoke
    output = tmp_path / "copy"
    shutil.copytree(sweep.output, output)
    text = SMOKE.read_text().replace("learning-rate = 0.1", "learning-rate = 0.2")
    changed = tmp_path / "changed.toml"
    changed.write_text(text)
    with pytest.raises(SweepError, match=r"was run with a different config \(learning-rate: 0.1 → 0.2\)"):
        run_sweep(load_sweep(changed, output), show_progress=False)


@pytest.mark.filterwarnings("ignore:Precision loss occurred:RuntimeWarning")  # scipy on the bug's input, on purpose
def test_zero_variance_pairs_are_reported_alike_however_the_floats_fell(tmp_path):
    """B − A the same in every pair: but for float rounding (+0.1), exactly (+0.125), or zero."""
    names = ("a", "b", "e", "f")
    sweep = load_sweep(_write(tmp_path, 'output = "o"\n[grid]\nseed = [0, 1, 2]\n'
                                        + "".join(f'[[variants]]\nname = "{n}"\n' for n in names)))
    a, e = np.array([0.1, 0.7, 0.3]), np.array([0.25, 0.5, 0.75])
    accuracies = {"a": a, "b": a + 0.1, "e": e, "f": e + 0.125}
    assert np.ptp(accuracies["b"] - a) > 0 and abs(stats.ttest_rel(accuracies["b"], a).statistic) > 1e12  # the bug
    assert np.ptp(accuracies["f"] - e) == 0  # scipy: t = inf
    rows = [{"cell_id": f"{v}-{s}", "variant": v, "seed": s, "round": 2, "accuracy": float(accuracies[v][s]),
             "epsilon": 1.0, "sigma": 1.0} for v in accuracies for s in range(3)]
    pairs = [("a", "b"), ("e", "f"), ("a", "a")]
    comparisons = paired_comparisons(rows, pairs, [], ["seed"])
    for comparison in comparisons:
        assert np.isnan(comparison.t_statistic) and np.isnan(comparison.t_pvalue), comparison
    ab, ef, aa = comparisons
    assert ab.differences == (0.1, 0.1, 0.1) and ef.differences == (0.125,) * 3
    for comparison in (ab, ef):  # all positive: defined, p = 2/2³
        assert (comparison.wilcoxon_statistic, comparison.wilcoxon_pvalue) == (0.0, 0.25)
    assert np.isnan(aa.wilcoxon_statistic) and np.isnan(aa.wilcoxon_pvalue)  # all zero: undefined
    summary = summary_markdown(sweep, rows, comparisons)
    table = [line for line in summary.splitlines() if line.startswith(("| a | b |", "| e | f |", "| a | a |"))]
    assert [line.split(" | ")[4:6] for line in table] == [["–", "–"]] * 3  # t, p
    assert "1e+16" not in summary and "e-17" not in summary
    assert "– marks a statistic that is undefined" in summary


def test_sweep_errors_print_their_brackets_and_near_misses(tmp_path, capsys):
    assert sweep_command(_write(tmp_path, 'output = "o"\n[grids]\nseed = [0]\n')) == 2
    error = capsys.readouterr().err
    assert "(run-config keys go under [base], [grid] or [[variants]])" in error
    assert "unknown key 'grids'; did you mean 'grid'?" in error
    assert len([line for line in error.splitlines() if line.strip()]) == 1



def _loaded_after(statement: str, modules: tuple[str, ...]) -> list[str]:
    """Which of the modules a fresh interpreter has loaded after the import statement."""
    probe = f"import sys; {statement}; print(','.join(m for m in {modules!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return [name for name in done.stdout.strip().split(",") if name]


@pytest.mark.subprocess
@pytest.mark.slow
def test_the_parts_import_downwards_and_the_package_keeps_its_names():
    """spec and stats load no runner, report or plots; stats not even torch, Flower or the run config."""
    upper = ("fedhog.sweep.runner", "fedhog.sweep.report", "fedhog.sweep.plots")
    assert _loaded_after("import fedhog.sweep.spec, fedhog.sweep.stats", upper) == []
    assert _loaded_after("import fedhog.sweep.stats", ("torch", "flwr", "matplotlib", "fedhog.config")) == []
    import fedhog.sweep

    for name in fedhog.sweep.__all__:
        assert getattr(fedhog.sweep, name).__module__.startswith("fedhog.sweep."), name
    assert fedhog.sweep.run_sweep is run_sweep and fedhog.sweep.SweepError is SweepError
    with pytest.raises(AttributeError, match="has no attribute 'nothing'"):
        fedhog.sweep.nothing  # noqa: B018


TUNED = """
output = "out"
paired = [["gaussian", "hog"]]
[base]
dataset = "digits"
model = "logreg"
partitioner = "iid"
population = 10
sampling-rate = 0.5
rounds = 2
clipping-norm = 2.0
server-validation-fraction = 0.2
[grid]
target-epsilon = [3.0, 8.0]
seed = [0]
[[variants]]
name = "gaussian"
mechanism = "gaussian"
[[variants]]
name = "hog"
mechanism = "hog"
[[variants]]
name = "no-dp"
mechanism = "none"
target-epsilon = -1.0
learning-rate = 0.1
[tune]
seeds = [7]
last-rounds = 2
widen = 0  # the grid as given (widening: test_sweep_widening.py)
[tune.grid]
learning-rate = [0.001, 0.3]
[tune.variants.hog]
mixing-strength = [0.25, 1.0]
"""


def test_tuning_expands_every_setting_per_variant_condition_and_tuning_seed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = load_sweep(_write(tmp_path, TUNED))
    counts = {}
    for trial in sweep.trials:
        counts[trial.cell.variant] = counts.get(trial.cell.variant, 0) + 1
        assert trial.cell.config.seed == 7 and trial.cell.directory.parent == sweep.output / "tuning"
    # gaussian: 2 ε × 2 learning rates; hog: 2 ε × 2 × 2 γ; no-dp sets its learning rate: 1 setting, no ε condition
    assert counts == {"gaussian": 4, "hog": 8, "no-dp": 1}
    assert {t.setting for t in sweep.trials if t.cell.variant == "hog"} == {
        (("learning-rate", lr), ("mixing-strength", g)) for lr in (0.001, 0.3) for g in (0.25, 1.0)}


@pytest.mark.slow
def test_tuning_chooses_on_the_validation_set_and_the_cells_use_the_choice(tmp_path, monkeypatch, fresh_cache,
                                                                          calibrated_once):
    monkeypatch.chdir(tmp_path)  # output = "out" is relative to the working directory
    sweep = load_sweep(_write(tmp_path, TUNED))
    outcome = run_sweep(sweep, show_progress=False)
    assert not outcome.failed
    tuned = load_sweep(sweep.path)
    from fedhog.sweep.runner import apply_tuning

    tuned = apply_tuning(tuned)
    for (variant, condition), chosen in tuned.choices.items():
        scores = {}
        for trial in tuned.trials:
            if (trial.cell.variant, trial.condition) == (variant, condition):
                rounds = read_metrics(trial.cell.directory)["rounds"]
                scores[trial.setting] = np.mean([r["validation_accuracy"] for r in rounds[-2:]])
        assert scores[tuple(chosen.items())] == max(scores.values())  # the best validation score, not test
        for cell in tuned.cells:
            if cell.variant == variant and all(cell.overrides.get(k) == v for k, v in condition):
                assert all(cell.config.to_mapping()[k] == v for k, v in chosen.items())
    assert {c.variant for c in tuned.cells} == {"gaussian", "hog", "no-dp"}
    assert "## Tuned values" in (sweep.output / "summary.md").read_text()
    assert "✔" in (sweep.output / "tuning.md").read_text()
    assert "## How stable each choice is" in (sweep.output / "tuning.md").read_text()
    (sweep.output / "tuning.md").unlink()
    assert sweep_command(sweep.path, list_only=True) == 0
    assert not (sweep.output / "tuning.md").exists()  # listing a tuned sweep writes nothing


@pytest.mark.slow
def test_shortened_tuning_runs_keep_the_full_horizons_noise(tmp_path, monkeypatch, calibrated_once):
    """[tune] rounds = R: a trial stops after R rounds, with the σ calibrated for the cell's own rounds."""
    from fedhog.privacy.calibration import calibrate_noise_multiplier  # once per condition (calibrated_once)

    monkeypatch.chdir(tmp_path)
    text = TUNED.replace("rounds = 2\nclipping", "rounds = 6\nclipping")
    sweep = load_sweep(_write(tmp_path, text.replace("last-rounds = 2", "last-rounds = 2\nrounds = 2")))
    full_rounds = sweep.cells[0].config.rounds
    assert full_rounds == 6
    for trial in sweep.trials:
        config = trial.cell.config
        assert config.rounds == 2
        epsilon = dict(trial.condition).get("target-epsilon", 0.0)
        if trial.cell.variant == "no-dp":
            assert config.target_epsilon == -1 and config.mechanism == "none"
            continue
        expected = calibrate_noise_multiplier(epsilon, config.delta, full_rounds, config.sampling,
                                              config.sampling_rate, config.population, config.accountant)
        assert config.target_epsilon == -1 and config.noise_multiplier == pytest.approx(expected, rel=1e-12)
        short = calibrate_noise_multiplier(epsilon, config.delta, 2, config.sampling, config.sampling_rate,
                                           config.population, config.accountant)
        assert config.noise_multiplier > 1.1 * short  # not recalibrated for the shorter run
    assert "stop after 2 rounds" in tuning_markdown(sweep, [], {})
    with pytest.raises(SweepError, match="rounds=1 is not allowed"):
        load_sweep(_write(tmp_path, text.replace("last-rounds = 2", "last-rounds = 2\nrounds = 1")))
    distributed = text.replace('name = "gaussian"\n', 'name = "gaussian"\nsampling = "fixed"\n'
                               'secure-aggregation = "secagg+"\nnoise = "distributed"\n'
                               ).replace("last-rounds = 2", "last-rounds = 2\nrounds = 2")
    with pytest.raises(SweepError, match='cannot keep the full horizon\'s noise with noise="distributed"'):
        load_sweep(_write(tmp_path, distributed))


@pytest.mark.parametrize("change, match", [
    ("server-validation-fraction = 0.2\n", "server-validation-fraction > 0"),
    ("seeds = [7]", "share \\[0\\] with the sweep's seeds"),
    ("[tune.variants.hog]", "no variant 'hogg'"),
    ("[tune.grid]\nlearning-rate = [0.001, 0.3]", "tunes nothing"),
])
def test_bad_tuning_tables_name_the_key(tmp_path, change, match):
    replacement = {"seeds = [7]": "seeds = [0]", "[tune.variants.hog]": "[tune.variants.hogg]",
                   "[tune.grid]\nlearning-rate = [0.001, 0.3]": "[tune.grid]"}.get(change, "")
    text = TUNED.replace(change, replacement)
    if match == "tunes nothing":
        text = text.replace("[tune.variants.hog]\nmixing-strength = [0.25, 1.0]\n", "")
    with pytest.raises(SweepError, match=match):
        load_sweep(_write(tmp_path, text))


@pytest.mark.slow
def test_the_report_compares_the_first_of_metrics(tmp_path, monkeypatch, fresh_cache):
    """A sweep with metrics = "auprc,...": summary.md and the paired tests use each cell's final AUPRC."""
    import pandas as pd

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(0)
    rows = 400
    x = rng.normal(size=(rows, 3))
    table = pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "branch": rng.integers(0, 4, rows),
                          "y": (x[:, 0] + 0.5 * rng.normal(size=rows) > 1.2).astype(int)})
    table.to_csv(tmp_path / "t.csv", index=False)
    sweep = load_sweep(_write(tmp_path, f"""
output = "out"
paired = [["gaussian", "none"]]
[base]
dataset = "csv:{tmp_path / 't.csv'}"
label-column = "y"
client-column = "branch"
population = 4
sampling-rate = 0.5
model = "logreg"
rounds = 2
learning-rate = 0.5
metrics = "auprc,accuracy"
clipping-norm = 5.0
noise-multiplier = 0.5
[grid]
seed = [0, 1]
[[variants]]
name = "gaussian"
mechanism = "gaussian"
[[variants]]
name = "none"
mechanism = "none"
"""))
    assert sweep.metric == "auprc"
    outcome = run_sweep(sweep, show_progress=False)
    finals = {}
    for cell in sweep.cells:
        document = read_metrics(cell.directory)
        finals[(cell.variant, cell.config.seed)] = document["rounds"][-1]["auprc"]
    (comparison,) = outcome.comparisons
    assert comparison.differences == pytest.approx([finals[("none", s)] - finals[("gaussian", s)] for s in (0, 1)])
    summary = (sweep.output / "summary.md").read_text()
    assert "final auprc" in summary
    gaussian = np.mean([finals[("gaussian", s)] for s in (0, 1)])
    assert f"{gaussian:.4f}" in summary
    rows = _read_csv(sweep.output / "results.csv")
    assert {"auprc", "auroc"} <= set(rows[0]) and rows[0]["round"] == "0" and rows[0]["auprc"] != ""


def test_choice_stability_counts_agreeing_seeds_margin_and_grid_edges():
    from fedhog.sweep.stats import TrialScore, best_settings, choice_stability

    condition = (("target-epsilon", 3.0),)
    by_seed = {  # (C, η) → validation score, per tuning seed
        100: {(0.3, 0.5): 0.40, (0.3, 1.0): 0.52, (0.3, 2.0): 0.50, (1.0, 1.0): 0.30},
        101: {(0.3, 0.5): 0.41, (0.3, 1.0): 0.49, (0.3, 2.0): 0.50, (1.0, 1.0): 0.31},
    }
    scores = [TrialScore("dp", condition, (("clipping-norm", c), ("server-learning-rate", eta)), score, seed)
              for seed, table in by_seed.items() for (c, eta), score in table.items()]
    choices = best_settings(scores)
    assert choices[("dp", condition)] == {"clipping-norm": 0.3, "server-learning-rate": 1.0}  # mean 0.505 vs 0.500
    stability = choice_stability(scores, choices)[("dp", condition)]
    assert (stability.seeds_agreeing, stability.seeds) == (1, 2)  # seed 101 alone would take η = 2.0
    assert stability.margin == pytest.approx(0.505 - 0.500)
    assert stability.on_edge == ("clipping-norm",)  # C = 0.3 is the smallest tried; η = 1.0 is inside
