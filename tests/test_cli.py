"""`fedhog run` does what a user expects: results folders are never overwritten silently, a resume keeps how the run
was started, what cannot run is refused up front in one line, and a run whose every client fails is an error."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, set_args

from fedhog import cli
from fedhog import engines as engine_registry
from fedhog.config import ConfigError, RunConfig
from fedhog.results import RUN_FILES, ResultsWriter, claim_results_dir, config_to_toml

TINY = ["dataset=digits", "model=logreg", "population=4", "sampling-rate=0.5", "rounds=2", "partitioner=iid"]


@pytest.fixture
def engines(monkeypatch):
    """Replace every engine by one that records the call and writes a finished run (no training)."""
    calls: list[tuple[str, RunConfig, int]] = []

    def fake(name: str):
        def run(config: RunConfig, client_cpus: int) -> None:
            calls.append((name, config, client_cpus))
            writer = ResultsWriter(Path(config.results_dir), config)
            writer.update(status="finished", seconds=0.1, rounds=[{"round": r, "accuracy": 0.5, "epsilon": 0.5 * r}
                                                                 for r in range(1, config.rounds + 1)],
                          summary={
                "rounds_completed": config.rounds, "rounds_planned": config.rounds, "stopped_by_budget": False,
                "final_accuracy": 0.5, "initial_accuracy": 0.1, "epsilon": 1.0, "delta": config.delta})
        return run

    for name, engine in list(cli.ENGINES.items()):
        monkeypatch.setitem(cli.ENGINES, name, cli.Engine(engine.help, fake(name), engine.in_process))
    return calls


def _snapshot(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir()) if p.is_file()}


def _finished_run(directory: Path, engine: str = "inprocess") -> Path:
    """A results folder as a finished `fedhog run --engine <engine>` leaves it."""
    assert cli.main(["run", "--engine", engine, *set_args(*TINY, f'results-dir="{directory}"')]) == 0
    (directory / "final_model.pt").write_bytes(b"model")
    (directory / "checkpoint.pt").write_bytes(b"checkpoint")
    return directory


def _one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


# --- results folders -------------------------------------------------------------
def test_rerunning_a_saved_config_refuses_and_changes_nothing(tmp_path, engines, capsys):
    run = _finished_run(tmp_path / "run")
    before = _snapshot(run)
    capsys.readouterr()
    assert cli.main(["run", str(run / "config.toml")]) == 2
    line = _one_error_line(capsys)
    assert "already holds a run (finished, 2 of 2 rounds)" in line
    assert "--set results-dir='\"\"'" in line and "--overwrite" in line
    assert _snapshot(run) == before and len(engines) == 1


def test_overwrite_replaces_the_runs_files_and_nothing_else(tmp_path, engines):
    run = _finished_run(tmp_path / "run")
    (run / "notes.txt").write_text("mine")
    (run / "logs").mkdir()
    (run / "logs" / "superlink.log").write_text("old")
    assert cli.main(["run", str(run / "config.toml"), "--overwrite"]) == 0
    assert len(engines) == 2
    assert (run / "notes.txt").read_text() == "mine"
    assert not (run / "final_model.pt").exists() and not (run / "checkpoint.pt").exists()
    assert not (run / "logs").exists()


def test_resuming_a_finished_run_says_so_and_changes_nothing(tmp_path, engines, capsys):
    run = _finished_run(tmp_path / "run")
    before = _snapshot(run)
    capsys.readouterr()
    assert cli.main(["run", "--resume", str(run)]) == 0
    assert "nothing to resume" in capsys.readouterr().err
    assert _snapshot(run) == before and len(engines) == 1


def test_a_new_run_in_a_folder_of_other_files_is_refused(tmp_path, engines, capsys):
    (tmp_path / "project").mkdir()
    (tmp_path / "project" / "config.toml").write_text("# the user's own\n")
    assert cli.main(["run", *set_args(*TINY, f'results-dir="{tmp_path / "project"}"')]) == 2
    assert "a folder with other files (config.toml) and no fedhog run" in _one_error_line(capsys)
    assert cli.main(["run", "--overwrite", *set_args(*TINY, f'results-dir="{tmp_path / "project"}"')]) == 2
    assert (tmp_path / "project" / "config.toml").read_text() == "# the user's own\n" and engines == []


def test_results_dir_below_a_file_is_one_line(tmp_path, engines, capsys):
    (tmp_path / "file").write_text("")
    assert cli.main(["run", *set_args(*TINY, f'results-dir="{tmp_path / "file" / "run"}"')]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("config error: results-dir=") and f"{tmp_path / 'file'} is a file" in line


def test_claim_results_dir(tmp_path):
    assert claim_results_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"
    assert claim_results_dir(tmp_path / "a" / "b") == tmp_path / "a" / "b"  # still empty: fine
    (tmp_path / "a" / "b" / "metrics.json").write_text(json.dumps({"status": "running", "rounds": [{}]}))
    with pytest.raises(ConfigError, match=r"holds a run \(running, 1 rounds\).*--resume .*b continues it"):
        claim_results_dir(tmp_path / "a" / "b")
    for name in RUN_FILES:
        (tmp_path / "a" / "b" / name).write_text("x")
    claim_results_dir(tmp_path / "a" / "b", overwrite=True)
    assert list((tmp_path / "a" / "b").iterdir()) == []


# --- resume keeps how the run was started ----------------------------------------------
def _stopped_run(directory: Path, launch: dict | None, checkpoint: bool = True) -> Path:
    config = RunConfig.from_mapping({"dataset": "digits", "model": "logreg", "population": 4, "sampling-rate": 0.5,
                                     "rounds": 3, "results-dir": str(directory)})
    directory.mkdir()
    (directory / "config.toml").write_text(config_to_toml(config))
    if checkpoint:
        (directory / "checkpoint.pt").write_bytes(b"round 1")
    document = {"status": "running", "config": config.to_mapping(), "rounds": [{"round": 1}]}
    (directory / "metrics.json").write_text(json.dumps({**document, **({"launch": launch} if launch else {})}))
    return directory


@pytest.mark.parametrize("engine", list(cli.ENGINES))
def test_resume_keeps_the_engine_the_run_started_with(tmp_path, engines, engine):
    run = _stopped_run(tmp_path / "run", {"command": "run", "engine": engine, "client_cpus": 2})
    assert cli.main(["run", "--resume", str(run)]) == 0
    ((name, config, cpus),) = engines
    assert (name, cpus, config.resume, config.results_dir, config.rounds) == (engine, 2, True, str(run), 3)
    assert read_metrics(run)["launch"]["engine"] == engine  # kept by the writer


def test_a_new_run_records_its_engine(tmp_path, engines):
    assert cli.main(["run", "--engine", "inprocess", "--client-cpus", "3",
                     *set_args(*TINY, f'results-dir="{tmp_path / "run"}"')]) == 0
    document = read_metrics(tmp_path / "run")
    assert document["launch"] == {"command": "run", "engine": "inprocess", "client_cpus": 3}
    assert document["status"] == "finished"


def test_resume_refuses_another_engine_or_command(tmp_path, engines, capsys):
    run = _stopped_run(tmp_path / "run", {"command": "run", "engine": "inprocess", "client_cpus": 1})
    assert cli.main(["run", "--resume", str(run), "--engine", "simulation"]) == 2
    assert "started with --engine inprocess" in _one_error_line(capsys)
    assert cli.main(["deploy-local", "--resume", str(run)]) == 2
    assert "resume it with `fedhog run --resume" in _one_error_line(capsys)
    gone = _stopped_run(tmp_path / "gone", {"command": "run", "engine": "teleport", "client_cpus": 1})
    assert cli.main(["run", "--resume", str(gone)]) == 2
    assert "engine 'teleport' is not available" in _one_error_line(capsys)
    assert engines == []


def test_a_run_stopped_before_its_first_checkpoint_starts_again_in_its_folder(tmp_path, engines, capsys):
    run = _stopped_run(tmp_path / "run", {"command": "run", "engine": "inprocess", "client_cpus": 1},
                       checkpoint=False)
    assert cli.main(["run", "--resume", str(run)]) == 0
    ((name, config, _),) = engines
    assert (name, config.resume, config.results_dir) == ("inprocess", False, str(run))
    assert "no checkpoint" in capsys.readouterr().err


def test_a_run_that_failed_before_its_serverapp_started_can_be_resumed(tmp_path, engines, monkeypatch):
    def broken(config: RunConfig, client_cpus: int) -> None:
        raise cli.DeployError("the SuperLink did not start")

    monkeypatch.setitem(cli.ENGINES, "simulation", cli.Engine("broken", broken, in_process=False))
    run = tmp_path / "run"
    assert cli.main(["run", "--engine", "simulation", *set_args(*TINY, f'results-dir="{run}"')]) == 1
    assert cli.main(["run", "--resume", str(run)]) == 1  # the stored engine: still the broken one
    assert cli.main(["run", "--resume", str(run), "--engine", "inprocess"]) == 2  # and no other
    finishes = cli.ENGINES["inprocess"].run  # the fake that writes a finished run
    monkeypatch.setitem(cli.ENGINES, "simulation", cli.Engine("fixed", finishes, in_process=False))
    assert cli.main(["run", "--resume", str(run)]) == 0
    assert read_metrics(run)["status"] == "finished"


def test_resume_of_a_run_that_recorded_nothing_uses_the_given_engine(tmp_path, engines, capsys):
    run = _stopped_run(tmp_path / "run", None)
    assert cli.main(["run", "--resume", str(run), "--engine", "inprocess"]) == 0
    assert [name for name, _, _ in engines] == ["inprocess"]
    assert "does not say how it was started" in capsys.readouterr().err


# --- refused up front ---------------------------------------------------------------
def test_cuda_without_cuda_is_a_config_error_before_anything_runs(tmp_path, engines, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["run", *set_args(*TINY, "device=cuda", f'results-dir="{tmp_path / "run"}"')]) == 2
    line = _one_error_line(capsys)
    assert "device='cuda' is not allowed on this machine" in line and "expected auto" in line
    assert engines == [] and not (tmp_path / "run").exists()


def test_a_busy_metrics_port_is_a_config_error(tmp_path, engines, capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert cli.main(["run", *set_args(*TINY, f"metrics-port={port}", f'results-dir="{tmp_path / "run"}"')]) == 2
    assert f"metrics-port={port} is not allowed" in _one_error_line(capsys) and engines == []


def test_sigma_from_the_file_and_target_epsilon_from_set_is_said(tmp_path, engines, capsys):
    path = tmp_path / "run.toml"
    path.write_text("\n".join(s.replace("=", " = ") for s in ["dataset=\"digits\"", "model=\"logreg\"",
                                                                "population=4", "sampling-rate=0.5",
                                                                "noise-multiplier=1.3"]) + "\n")
    assert cli.main(["run", str(path), *set_args("target-epsilon=3.0", f'results-dir="{tmp_path / "a"}"')]) == 0
    assert "target-epsilon=3.0 (override) replaces noise-multiplier=1.3 of" in capsys.readouterr().err
    assert engines[-1][1].target_epsilon == 3.0
    assert cli.main(["run", str(path), *set_args("target-epsilon=3.0", "noise-multiplier=1.0",
                                              f'results-dir="{tmp_path / "b"}"')]) == 2
    assert "are both set" in _one_error_line(capsys)


def test_the_packaged_quickstart_is_the_default_config(tmp_path, engines, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert cli.main(["run", "--set", "rounds=1"]) == 0
    ((_, config, _),) = engines
    assert (config.population, config.target_epsilon, config.sampling_rate) == (10000, 3.0, 0.05)
    assert Path(config.results_dir).parent == tmp_path / "results"


def test_the_checkouts_quickstart_is_the_packaged_one():
    root = Path(__file__).resolve().parents[1]
    assert (root / "configs" / "quickstart.toml").read_bytes() == (root / "fedhog" / "quickstart.toml").read_bytes()


# --- a run whose every client fails ---------------------------------------------------
def test_a_run_whose_every_client_fails_stops_with_their_reason_and_the_epsilon_spent(tmp_path, capsys, monkeypatch):
    """device='cuda' slipping past the up-front check (as on a server that has CUDA but clients that do not)."""
    monkeypatch.setattr(engine_registry, "check_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the clients run in this process
    results = tmp_path / "run"
    code = cli.main(["run", "--engine", "inprocess", *set_args(*TINY, "rounds=3", "sampling-rate=1.0", "device=cuda",
                                                             f'results-dir="{results}"')])
    assert code == 1
    document = read_metrics(results)
    assert document["status"] == "failed" and len(document["rounds"]) == 1  # stopped after the first round
    epsilon = document["rounds"][0]["epsilon"]
    assert math.isfinite(epsilon) and epsilon > 0
    error = document["error"]
    assert "every sampled client failed (4 of 4)" in error
    assert "device='cuda' was asked for but torch sees no CUDA device" in error
    assert f"ε = {epsilon:.4g}" in error
    assert "run failed:" in capsys.readouterr().err


@pytest.mark.parametrize("reason, summary", [
    ("client error: <class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()"
     "\x1b[39m (pid=1, ip=192.0.2.2)\n  File \"/x/fedhog/training.py\", line 22, in select_device\n    raise "
     "RuntimeError(\"device='cuda' ...\")\nRuntimeError: device='cuda' ...\n\nThe above exception was the direct "
     "cause of the following exception:\n\nflwr.clientapp.client_app.ClientAppException: \nException "
     "ClientAppException occurred. Message: device='cuda' was asked for but torch sees no CUDA device'>",
     "device='cuda' was asked for but torch sees no CUDA device"),  # the Simulation Engine (Ray)
    ("client error: <class 'ZeroDivisionError'>:<'division by zero'>", "ZeroDivisionError: division by zero"),
    ("client error: RuntimeError: no data\nTraceback (most recent call last):\n  File \"x\", line 1",
     "RuntimeError: no data"),  # the in-process engine
    ("client error: " + "x" * 500, "x" * 299 + "…"),
])
def test_client_errors_are_quoted_in_one_line(reason, summary):
    from fedhog.protocol import client_error_summary

    assert client_error_summary(reason) == summary


# --- what the command says about itself ---------------------------------------------------
def test_version_comes_from_the_package_metadata(capsys):
    from importlib.metadata import version

    import fedhog

    assert fedhog.__version__ == version("fedhog") != "unknown"
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"fedhog {fedhog.__version__}"


@pytest.mark.parametrize("command", [[], ["run"], ["deploy-local"], ["export"], ["sweep"], ["keys"]])
def test_help_text_has_no_markup(capsys, command):
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    text = capsys.readouterr().out
    assert "usage: fedhog" in text and "``" not in text and ":func:" not in text


def test_keys_lists_every_config_key_with_its_default_and_meaning(capsys):
    from fedhog.config_keys import MEANINGS

    defaults = RunConfig().to_mapping()
    assert set(MEANINGS) == set(defaults)
    assert all(MEANINGS[key].strip() for key in defaults)
    assert cli.main(["keys"]) == 0
    out = capsys.readouterr().out
    for key in defaults:
        assert key in out
    assert cli.main(["keys", "clipping"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0] for line in lines[1:] if line and not line.startswith(" ")}
    assert "clipping-norm" in rows and "adaptive-clipping" in rows and "rounds" not in rows
    assert cli.main(["keys", "no-such-word"]) == 1


def test_the_display_shows_what_the_run_does_before_its_first_round():
    """Data generation and partitioning say so (the first ~30 s of a quickstart used to show only 'starting…')."""
    import logging

    from fedhog import data, progress

    spec = RunConfig().with_overrides({"dataset": "digits", "partitioner": "iid", "population": 3, "sampling-rate": 1.0,
                                       "seed": 12345}).data_spec
    seen: list[str] = []

    class Record(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    with progress._stages() as stage:  # pylint: disable=protected-access  # what watch_metrics listens to
        logging.getLogger(progress.STAGE_LOGGER).addHandler(recorder := Record())
        try:
            data.population_training_data(spec)
        finally:
            logging.getLogger(progress.STAGE_LOGGER).removeHandler(recorder)
    assert seen[0].startswith("preparing the data: digits for 3 clients")
    assert seen[-1] == stage.text and stage.text.startswith("partitioning") and "among 3 clients (iid)" in stage.text


def test_a_serverapp_in_another_process_reports_its_start_up_through_metrics_json(tmp_path):
    """The Simulation Engine's display reads metrics.json: the ServerApp writes its stage there until round 1."""
    import logging

    from fedhog.server_app import _stages_into  # pylint: disable=protected-access
    from fedhog.strategy import RoundRecord

    writer = ResultsWriter(tmp_path, RunConfig())
    with _stages_into(writer):
        logging.getLogger("fedhog.stage").info("partitioning %d examples among %d clients (iid)…", 100, 4)
        assert read_metrics(tmp_path)["stage"].startswith("partitioning 100 examples")
        writer.add_round(RoundRecord(round=1, clients_sampled=2))
        logging.getLogger("fedhog.stage").info("late")
    assert "stage" not in read_metrics(tmp_path)
