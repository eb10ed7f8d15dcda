"""target-epsilon says what it does: -1 is no calibration, 0 is refused, and a target that stands in the way says so."""

from __future__ import annotations

import tomllib
from importlib.resources import files
from pathlib import Path

import pytest

from fedhog.config import NO_TARGET_EPSILON, ConfigError, RunConfig, load_config
from fedhog.results import config_to_toml, load_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_is_no_calibration_in_the_schema_and_in_flowers_run_config():
    flower = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    assert RunConfig().target_epsilon == flower["target-epsilon"] == NO_TARGET_EPSILON == -1.0
    config = RunConfig.from_mapping({"mechanism": "gaussian", "noise-multiplier": 1.3})
    assert config.calibrated() is config  # σ stays the one given


@pytest.mark.parametrize("value", [0, 0.0])
def test_zero_is_refused_naming_key_value_and_what_is_allowed(value):
    with pytest.raises(ConfigError) as error:
        RunConfig.from_mapping({"mechanism": "gaussian", "target-epsilon": value})
    message = str(error.value)
    assert "target-epsilon=0.0 is not allowed" in message and "-1 for no calibration" in message
    assert "\n" not in message


def test_a_zero_next_to_noise_multiplier_is_refused_for_the_zero():
    with pytest.raises(ConfigError, match=r"target-epsilon=0\.0 is not allowed"):
        load_config(None, {"noise-multiplier": 1.2, "target-epsilon": 0.0})


def test_mechanism_none_on_the_quickstart_says_the_target_stands_in_the_way_and_how_to_unset_it():
    quickstart = files("fedhog") / "quickstart.toml"
    with pytest.raises(ConfigError) as error:
        load_config(quickstart, {"mechanism": "none"})
    message = str(error.value)
    assert message.startswith("target-epsilon=3 stands in the way of mechanism='none'")
    assert "--set target-epsilon=-1" in message
    unset = load_config(quickstart, {"mechanism": "none", "target-epsilon": -1})
    assert unset.mechanism == "none" and not unset.privacy_mechanism.has_guarantee


def test_the_quickstart_still_calibrates_to_three():
    config = load_config(files("fedhog") / "quickstart.toml")
    assert config.target_epsilon == 3.0
    assert config.calibration_inputs[1] == 3.0


def test_a_results_folder_written_when_zero_meant_off_is_read_as_it_was_meant(tmp_path):
    config = RunConfig.from_mapping({"mechanism": "gaussian", "noise-multiplier": 1.3})
    (tmp_path / "config.toml").write_text(config_to_toml(config).replace("target-epsilon = -1.0",
                                                                        "target-epsilon = 0.0"))
    stored = load_run_config(tmp_path)
    assert stored.target_epsilon == NO_TARGET_EPSILON and stored.noise_multiplier == 1.3
    with pytest.raises(ConfigError, match=r"target-epsilon=0\.0 is not allowed"):  # a config given now is not
        load_config(tmp_path / "config.toml")
