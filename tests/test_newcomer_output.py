"""Output for logs and machines: standard JSON in both result files, the accountant's ε in every round, one
warning said once, plain round lines when the console is not a terminal."""

from __future__ import annotations

import io
import json
import logging
import math
from dataclasses import dataclass

from flwr.app import ArrayRecord
from rich.console import Console

from fedhog import cli, progress
from fedhog.alarms import PRIVACY_SEED_WARNING
from fedhog.config import RunConfig
from fedhog.flower_log import flower_logger
from fedhog.results import ROUND_LOG, ResultsWriter, read_round_log
from fedhog.server_app import build_strategy


@dataclass
class _Round:
    round: int
    epsilon: float
    accuracy: float
    layers: dict


def _strict(text: str):
    """Standard JSON only: Python's NaN / Infinity tokens are refused."""
    def refuse(token: str):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_both_result_files_are_standard_json_with_one_convention(tmp_path):
    writer = ResultsWriter(tmp_path / "run", RunConfig())
    writer.add_round(_Round(1, math.inf, math.nan, {"walk/x": -math.inf}))
    writer.update(status="finished")
    line = _strict((writer.directory / ROUND_LOG).read_text().splitlines()[0])
    document = _strict(writer.metrics_path.read_text())
    assert line == document["rounds"][0] == {"round": 1, "epsilon": "inf", "accuracy": None,
                                              "layers": {"walk/x": "-inf"}}
    back = read_round_log(writer.directory, 1)[0]  # what --resume reads: the floats they were
    assert back["epsilon"] == math.inf and math.isnan(back["accuracy"]) and back["layers"]["walk/x"] == -math.inf


def test_a_round_that_releases_nothing_keeps_the_ledgers_epsilon():
    config = RunConfig.from_mapping({"mechanism": "none", "population": 10, "sampling-rate": 0.1,
                                     "delta": 1e-5})
    strategy = build_strategy(config)
    strategy.slot_of_node = {node: node for node in range(10)}
    strategy.accountant.compose_round()  # an earlier round released an unprotected model
    strategy.begin_round(2, ArrayRecord())
    assert strategy.round_record.epsilon == strategy.accountant.epsilon() == math.inf


def test_the_fixed_seed_warning_is_one_wording_said_once(tmp_path, monkeypatch, capsys):
    import fedhog.strategy as strategy_module

    def engine(config: RunConfig, client_cpus: int) -> None:
        strategy_module.log(logging.WARNING, "%s", PRIVACY_SEED_WARNING)  # what the strategy's summary logs
        raise RuntimeError("stop here")

    class Logged(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    for name, known in list(cli.ENGINES.items()):
        monkeypatch.setitem(cli.ENGINES, name, cli.Engine(known.help, engine, known.in_process))
    logged = Logged()
    flower_logger().addHandler(logged)
    try:
        cli.main(["run", "--set", f'results-dir="{tmp_path / "run"}"', "--set", "privacy-seed=7", "--set", "rounds=2"])
    finally:
        flower_logger().removeHandler(logged)
    printed = "".join(capsys.readouterr()).replace("\n", "")
    assert printed.count(PRIVACY_SEED_WARNING) == 1  # the banner, in the one wording
    assert not [m for m in logged.messages if "privacy-seed is fixed" in m]  # and not again in the log


def test_a_console_that_is_not_a_terminal_gets_one_plain_line_a_round(tmp_path, monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(progress, "console", Console(file=buffer, force_terminal=False, width=200))
    (tmp_path / "metrics.json").write_text(json.dumps({"status": "running", "resumed_after_round": 1, "rounds": [
        {"round": 1, "accuracy": 0.2, "epsilon": 0.5}, {"round": 2, "accuracy": 0.25, "epsilon": 0.7},
        {"round": 3, "accuracy": 0.3, "epsilon": "inf"}]}))
    progress.watch_metrics(tmp_path, 3, lambda: False)
    assert buffer.getvalue().splitlines() == ["round 2/3  accuracy 0.250  ε 0.700", "round 3/3  accuracy 0.300  ε ∞"]
