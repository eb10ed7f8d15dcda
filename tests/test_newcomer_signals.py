"""Signal handlers belong to the process's owner: fedhog's library calls leave them alone, the CLI restores them."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from fedhog import cli, deploy, interrupts
from fedhog.config import RunConfig
from fedhog.results import ResultsWriter


def _own(signum: int, frame: object) -> None:  # a caller's handler (pytest's, a notebook's, another program's)
    raise AssertionError("not sent")


@pytest.fixture
def owned_handlers():
    previous = {signum: signal.signal(signum, _own) for signum in interrupts.SIGNALS}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


def _handlers() -> dict[int, object]:
    return {signum: signal.getsignal(signum) for signum in interrupts.SIGNALS}


def test_deploy_local_called_as_a_library_leaves_the_callers_handlers_in_place(tmp_path, owned_handlers, monkeypatch):
    during: list[dict[int, object]] = []

    class Federation:  # stands in for the SuperLink and SuperNodes: where the run would start
        def __init__(self, *args, **kwargs) -> None:
            during.append(_handlers())

        def __enter__(self):
            raise deploy.DeployError("no federation in this test")

        def __exit__(self, *exc) -> None:
            return None

    monkeypatch.setattr(deploy, "LocalFederation", Federation)
    config = RunConfig.from_mapping({"population": 2, "sampling-rate": 0.5, "results-dir": str(tmp_path / "run")})
    with pytest.raises(deploy.DeployError):
        deploy.deploy_local(config, nodes=2, workdir=tmp_path / "work")
    assert during == [{signal.SIGINT: _own, signal.SIGTERM: _own}]  # SIGTERM was not turned into SystemExit
    assert _handlers() == {signal.SIGINT: _own, signal.SIGTERM: _own}


def test_rerouting_changes_handlers_only_where_the_cli_handles_them(owned_handlers):
    with interrupts.rerouted(signal.SIG_IGN):
        assert _handlers() == {signal.SIGINT: _own, signal.SIGTERM: _own}
    with interrupts.handled():
        with interrupts.rerouted(signal.SIG_IGN):
            assert set(_handlers().values()) == {signal.SIG_IGN}
        assert interrupts.in_force()
    assert _handlers() == {signal.SIGINT: _own, signal.SIGTERM: _own}


def test_after_a_cli_run_the_previous_handlers_are_back(tmp_path, owned_handlers, monkeypatch):
    def engine(config: RunConfig, client_cpus: int) -> None:
        assert interrupts.in_force()  # the run itself is handled by the CLI
        ResultsWriter(Path(config.results_dir), config)
        raise KeyboardInterrupt  # Ctrl-C in the run: the CLI ignores further signals while it saves

    for name, known in list(cli.ENGINES.items()):
        monkeypatch.setitem(cli.ENGINES, name, cli.Engine(known.help, engine, known.in_process))
    assert cli.main(["run", "--set", f'results-dir="{tmp_path / "run"}"', "--set", "rounds=2"]) == 130
    assert _handlers() == {signal.SIGINT: _own, signal.SIGTERM: _own}
