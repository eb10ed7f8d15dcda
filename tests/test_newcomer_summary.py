"""The run summary times the whole command and says what the machine was doing meanwhile."""

from __future__ import annotations

import re
import time
from pathlib import Path

from fedhog import cli
from fedhog.config import RunConfig
from fedhog.results import ResultsWriter


def test_the_summary_times_the_whole_command_and_says_the_load(tmp_path, monkeypatch, capsys):
    def engine(config: RunConfig, client_cpus: int) -> None:
        time.sleep(0.3)  # start-up and data, before the ServerApp's clock starts
        ResultsWriter(Path(config.results_dir), config).update(
            status="finished", seconds=0.1, rounds=[{"round": 1, "accuracy": 0.5, "epsilon": 0.5}],
            summary={"rounds_completed": 1, "rounds_planned": 1, "stopped_by_budget": False, "final_accuracy": 0.5,
                     "initial_accuracy": 0.1, "epsilon": 0.5, "delta": config.delta})

    for name, known in list(cli.ENGINES.items()):
        monkeypatch.setitem(cli.ENGINES, name, cli.Engine(known.help, engine, known.in_process))
    assert cli.main(["run", "--set", f'results-dir="{tmp_path / "run"}"', "--set", "rounds=1"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    whole = re.search(r"wall time\s+│?\s*([0-9.]+) s for the whole command \(0\.1 s in the ServerApp\)", printed)
    assert whole and float(whole.group(1)) >= 0.3, printed
    assert re.search(r"load average [0-9.]+ / [0-9.]+ / [0-9.]+ \(1 / 5 / 15 min\) on \d+ CPUs", printed)


def test_after_a_resume_the_summary_says_which_rounds_it_timed():
    document = {"seconds": 42.0, "resumed_after_round": 30, "summary": {"rounds_completed": 80}}
    assert cli.wall_time(50.0, document) == ("50.0 s for the whole command (42.0 s in the ServerApp; resumed after "
                                             "round 30: rounds 31–80 only)")
