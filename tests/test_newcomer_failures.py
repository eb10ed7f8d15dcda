"""An absurd value fails before anything trains, in one named line; a failed run says so on disk, whatever failed."""

from __future__ import annotations

import json
import time
from importlib.resources import files
from pathlib import Path

import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft

from fedhog import cli, feasibility, server_app
from fedhog.compat import dense_pmfs
from fedhog.config import ConfigError, RunConfig, load_config
from fedhog.engines import check_run
from fedhog.privacy.pld import composition_bytes
from fedhog.results import ResultsWriter, read_run_document


@pytest.mark.parametrize("sigma, count", [(1.0, 300), (3.0, 2000)])
def test_the_accounting_memory_is_that_of_dp_accountings_own_composition(sigma, count):
    """The FFT length is found from the bounds alone; dp_accounting's composed PMF says how long it really was."""
    pld = pld_lib.from_gaussian_mechanism(standard_deviation=sigma, value_discretization_interval=1e-3,
                                          sampling_prob=0.1)
    one = dense_pmfs(pld, densify=True)
    composed = dense_pmfs(pld.self_compose(count), densify=True)
    assert one is not None and composed is not None
    expected = sum(3 * 16 * fft.next_fast_len(max(len(c.probs), len(o.probs)))
                   for o, c in zip(one, composed, strict=True) if o is not None)
    assert composition_bytes(sigma, 0.1, count) == expected


def test_a_billion_rounds_are_refused_before_training_naming_rounds(monkeypatch):
    monkeypatch.setattr(feasibility, "available_memory", lambda: 8 * 2**30)
    config = RunConfig.from_mapping({"rounds": 1_000_000_000, "mechanism": "gaussian"})
    started = time.perf_counter()
    with pytest.raises(ConfigError) as error:
        check_run(config)
    assert time.perf_counter() - started < 2
    message = str(error.value)
    assert message.startswith("rounds=1000000000 is not allowed on this machine") and "\n" not in message
    assert "GiB" in message and 'accountant="rdp"' in message
    check_run(config.with_overrides({"rounds": 30}))  # an ordinary run is not refused
    check_run(config.with_overrides({"accountant": "rdp"}))  # RDP composes in constant memory


def test_a_calibrated_run_is_checked_where_its_calibration_starts(monkeypatch):
    monkeypatch.setattr(feasibility, "available_memory", lambda: 8 * 2**30)
    quickstart = load_config(Path(cli.__file__).with_name("quickstart.toml"), {"rounds": 1_000_000_000})
    with pytest.raises(ConfigError, match=r"rounds=1000000000 .* at σ = 1 "):
        check_run(quickstart)


def test_a_run_that_fails_while_calibrating_says_failed_with_the_reason(tmp_path, monkeypatch):
    def out_of_memory(self):
        raise MemoryError("Unable to allocate 250. GiB for an array with shape (1,) and data type complex128")

    monkeypatch.setattr(RunConfig, "calibrated", out_of_memory)
    config = RunConfig.from_mapping({"mechanism": "gaussian", "target-epsilon": 3.0, "results-dir": str(tmp_path)})
    with pytest.raises(MemoryError):
        server_app.run_server(None, config)  # type: ignore[arg-type]  # calibration comes before the grid
    document = json.loads((tmp_path / "metrics.json").read_text())
    assert document["status"] == "failed" and document["error"].startswith("MemoryError: Unable to allocate 250.")


def test_a_run_whose_engine_dies_before_its_serverapp_writes_says_failed(tmp_path, monkeypatch, capsys):
    def dies(config: RunConfig, client_cpus: int) -> None:
        ResultsWriter(Path(config.results_dir), config)  # "running", as a ServerApp killed by the OS leaves it
        raise MemoryError("Unable to allocate 250. GiB")

    for name, engine in list(cli.ENGINES.items()):
        monkeypatch.setitem(cli.ENGINES, name, cli.Engine(engine.help, dies, engine.in_process))
    assert cli.main(["run", "--set", f'results-dir="{tmp_path / "run"}"', "--set", "rounds=2"]) == 1
    document = read_run_document(tmp_path / "run")
    assert document is not None and document["status"] == "failed"
    assert document["error"] == "MemoryError: Unable to allocate 250. GiB"
    assert "run failed" in capsys.readouterr().err


# --- values the config alone shows to be wrong, refused whatever else the run does ----------------------------------
QUICKSTART = str(files("fedhog") / "quickstart.toml")


@pytest.mark.parametrize("keys", [
    {"dataset": "digits", "population": 5},
    {"dataset": "digits", "population": 3, "server-validation-fraction": 0.1, "proxy-fraction": 0.05},
    {"dataset": "mnist1d", "num-samples": 57, "population": 2},
    {"dataset": "mnist1d", "num-samples": 101, "population": 2, "proxy-fraction": 0.13},
])
def test_the_clients_examples_known_from_the_config_are_those_partitioned(keys):
    from fedhog.data import _client_examples, _federation

    spec = RunConfig().with_overrides({"target-epsilon": -1, "sampling-rate": 1.0, **keys}).data_spec
    assert _client_examples(spec) == len(_federation(spec).y)


def test_more_clients_than_examples_is_refused_before_the_data_is_made(monkeypatch):
    """num-samples = 10 on the quickstart (10 000 clients) generated the data, then failed (a newcomer's case)."""
    import fedhog.data

    def never(*args, **kwargs):
        raise AssertionError("the data was generated")

    monkeypatch.setattr(fedhog.data, "load_mnist1d", never)
    with pytest.raises(ConfigError, match=r"population=10000 is not allowed; expected at most the 8 training examples "
                                          r"of dataset='mnist1d' with num_samples=10"):
        load_config(QUICKSTART, {"num-samples": 10})


@pytest.mark.parametrize("key, value", [("secagg-threshold", 1.5), ("secagg-threshold", 0.0),
                                        ("secagg-num-shares", 2), ("secagg-modulus-bits", 3)])
def test_a_secure_aggregation_setting_out_of_range_is_refused_with_secure_aggregation_off(key, value):
    """secagg-threshold = 1.5 on the quickstart (secure aggregation off) trained for minutes without a word."""
    with pytest.raises(ConfigError, match=rf"^{key}={value} is not allowed; expected "):
        load_config(QUICKSTART, {key: value})
