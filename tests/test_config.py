"""RunConfig: defaults equal pyproject.toml, every bad value is refused by name, TOML round trips."""

import math
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from fedhog.config import ConfigError, RunConfig, load_config, parse_override
from fedhog.results import config_to_toml

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def pyproject_config():
    with open(PYPROJECT, "rb") as handle:
        return tomllib.load(handle)["tool"]["flwr"]["app"]["config"]


def test_pyproject_defaults_equal_runconfig_defaults():
    declared = pyproject_config()
    defaults = RunConfig().to_mapping()
    assert set(declared) == set(defaults)
    assert set(defaults) == {f.name.replace("_", "-") for f in fields(RunConfig)}
    for key, value in declared.items():
        assert value == defaults[key], key
        assert type(value) is type(defaults[key]), f"{key}: {type(value).__name__} vs {type(defaults[key]).__name__}"


def test_the_data_spec_is_the_configs_data_fields_under_the_same_names_and_defaults():
    """RunConfig is the one source of a run's DataSpec: every spec field but test_fraction is a config field."""
    from fedhog.data import DataSpec

    spec_defaults = {f.name: f.default for f in fields(DataSpec)}
    config_defaults = {f.name: f.default for f in fields(RunConfig)}
    assert set(spec_defaults) - set(config_defaults) == {"test_fraction"}
    assert {name: config_defaults[name] for name in spec_defaults if name != "test_fraction"} == {
        name: value for name, value in spec_defaults.items() if name != "test_fraction"}
    config = RunConfig().with_overrides({"population": 40, "dirichlet-alpha": 0.25, "classes-per-client": 3,
                                         "validation-fraction": 0.2, "seed": 4})
    assert config.data_spec == DataSpec(population=40, dirichlet_alpha=0.25, classes_per_client=3,
                                        validation_fraction=0.2, seed=4)


def test_pyproject_loads_to_the_default_config():
    assert load_config(PYPROJECT) == RunConfig()
    assert RunConfig.from_mapping(pyproject_config()) == RunConfig()
    RunConfig().validate()


def error_for(overrides):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(overrides)
    return str(info.value)


@pytest.mark.parametrize("key, value", [
    ("dataset", "cifar99"),
    ("dataset", "hf:"),
    ("model", "resnet50"),
    ("mechanism", "laplace"),
    ("partitioner", "shards"),
    ("sampling", "stratified"),
    ("accountant", "prv"),
    ("clipping-norm", 0.0),
    ("clipping-norm", -1.0),
    ("clipping-norm", math.inf),
    ("noise-multiplier", -0.5),
    ("noise-multiplier", math.nan),
    ("sampling-rate", 0.0),
    ("sampling-rate", -0.1),
    ("sampling-rate", 1.5),
    ("sampling-rate", 0.0015),  # × population 1000 = 1.5 clients
    ("sampling-rate", 0.0001),  # × population 1000 = 0.1 clients
    ("mixing-strength", -0.1),
    ("rounds", 0),
    ("rounds", -3),
    ("delta", 0.0),
    ("delta", 1.0),
    ("delta", 2.0),
    ("delta", 0.01),  # ≥ 1/population
    ("max-epsilon", 0.0),
    ("max-epsilon", -1.0),
])
def test_bad_value_names_key_and_value(key, value):
    message = error_for({key: value})
    assert f"{key}={value!r}" in message


@pytest.mark.parametrize("key, value", [
    ("rounds", "ten"),
    ("rounds", 10.0),
    ("rounds", True),
    ("noise-multiplier", "1.0"),
    ("dataset", 3),
    ("clipping-norm", [1.0]),
])
def test_wrong_type_names_key_value_and_type(key, value):
    message = error_for({key: value})
    assert f"{key}={value!r}" in message and "wrong type" in message


def test_unknown_key_is_named():
    message = error_for({"noise-multplier": 1.0})
    assert "noise-multplier" in message and "noise-multiplier" in message  # the typo and the known keys
    error_for({"noise_multiplier": 1.0})  # snake case is not a config key


@pytest.mark.parametrize("overrides", [
    {"mechanism": "none", "max-epsilon": 5.0},
    {"mechanism": "gaussian", "noise-multiplier": 0.0, "max-epsilon": 5.0},
    {"mechanism": "hog", "noise-multiplier": 0.0, "max-epsilon": 5},
])
def test_finite_budget_without_guarantee_is_refused(overrides):
    message = error_for(overrides)
    assert "max-epsilon=5" in message and repr(overrides["mechanism"]) in message


def test_errors_come_from_loading_before_any_training(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('mechanism = "none"\nmax-epsilon = 3.0\n')
    with pytest.raises(ConfigError, match="max-epsilon=3"):
        load_config(path)
    with pytest.raises(ConfigError, match="rounds='ten'"):
        load_config(None, {"rounds": "ten"})
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml")
    (tmp_path / "broken.toml").write_text("rounds = = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(tmp_path / "broken.toml")


@pytest.mark.parametrize("overrides", [
    {"sampling-rate": 1.0},
    {"sampling-rate": 1},  # int → float
    {"sampling-rate": 0.001},  # one client
    {"noise-multiplier": 0.0, "mechanism": "gaussian"},
    {"mixing-strength": 0.0},
    {"rounds": 1},
    {"mechanism": "none"},
    {"mechanism": "gaussian", "max-epsilon": 8.0},
    {"max-epsilon": "inf"},
    {"dataset": "hf:ylecun/mnist", "model": "cnn2d"},
    {"population": 10, "sampling-rate": 0.3, "delta": 0.05},
])
def test_good_values_are_accepted(overrides):
    config = RunConfig.from_mapping(overrides)
    for key, value in overrides.items():
        expected = math.inf if value == "inf" else value
        assert config.to_mapping()[key] == expected


def test_with_overrides_revalidates():
    base = RunConfig()
    assert base.with_overrides({"rounds": 5}).rounds == 5
    with pytest.raises(ConfigError, match="rounds=0"):
        base.with_overrides({"rounds": 0})


@pytest.mark.parametrize("text, expected", [
    ("noise-multiplier=2.5", ("noise-multiplier", 2.5)),
    ("rounds=10", ("rounds", 10)),
    (" dataset = digits ", ("dataset", "digits")),
    ('results-dir="out dir/x"', ("results-dir", "out dir/x")),
    ("results-dir=out/x", ("results-dir", "out/x")),
    ("max-epsilon=inf", ("max-epsilon", math.inf)),
    ("delta=1e-6", ("delta", 1e-6)),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["rounds", "=3", "  =x"])
def test_parse_override_rejects_non_assignments(text):
    with pytest.raises(ConfigError, match="key=value"):
        parse_override(text)


def test_overrides_from_the_command_line_reach_the_config():
    overrides = dict(parse_override(t) for t in ["rounds=7", "mechanism=gaussian", "noise-multiplier=0.8",
                                                   "max-epsilon=inf", "sampling=fixed"])
    config = load_config(PYPROJECT, overrides)
    assert (config.rounds, config.mechanism, config.noise_multiplier, config.sampling) == (7, "gaussian", 0.8, "fixed")
    assert config.max_epsilon == math.inf


TINY_CSV = Path(__file__).resolve().parent / "data" / "tiny.csv"
NON_DEFAULT = {
    "dataset": f"csv:{TINY_CSV}", "label-column": "label", "feature-columns": "x1,x2", "client-column": "branch",
    "metrics": "auprc,accuracy", "num-samples": 1797, "partitioner": "pathological", "dirichlet-alpha": 0.3,
    "classes-per-client": 3, "validation-fraction": 0.0, "server-validation-fraction": 0.1, "proxy-fraction": 0.05,
    "server-step": "cubic", "server-step-max": 2.0, "population": 50, "model": "mlp", "activation": "silu",
    "normalization": "group-ws",
    "local-epochs": 2, "batch-size": 8, "learning-rate": 1e-3, "momentum": 0.9, "optimizer": "hog-step",
    "device": "cpu", "rounds": 12, "sampling": "fixed", "sampling-rate": 0.2, "server-learning-rate": 0.75,
    "round-timeout": 45.0, "max-update-norm": 1e3, "shards": 3,
    "mechanism": "gaussian", "clipping-norm": 0.125, "noise-multiplier": 1.1, "mixing-strength": 0.0,
    "hog-direction": "update", "hog-term": "random", "hog-batch-size": 4, "accountant": "rdp", "delta": 1e-7,
    "hog-mixing": "random-sign",  # noise-aware excludes hog-direction update and server-optimizer yogi
    "noise-aware-strength": 0.25, "noise-aware-samples": 3,
    "max-epsilon": 3.5, "seed": 123, "privacy-seed": 42, "resume": True,
    "target-epsilon": -1.0,  # with noise-multiplier set, target-epsilon stays off
    "client-dp": "none",  # dpsgd excludes optimizer hog-step
    "aggregator": "fedhog",  # flower-dp excludes adaptive clipping, resume, max-update-norm
    "dpsgd-noise-multiplier": 0.8, "dpsgd-max-grad-norm": 0.5,
    "dpsgd-delta": 1e-6, "dpsgd-accountant": "rdp", "dpsgd-noise": "opacus-secure", "server-optimizer": "yogi",
    "server-momentum": 0.5, "server-beta2": 0.9, "server-tau": 0.01, "adaptive-clipping": True, "target-quantile": 0.7,
    "clipping-learning-rate": 0.1,
    "count-noise-std": 2.5, "metrics-port": 9464,
    "secure-aggregation": "off",  # secagg+ excludes adaptive clipping; its own keys still round-trip
    "secagg-num-shares": 5, "secagg-threshold": 0.5, "secagg-modulus-bits": 40,
    "noise": "central",  # distributed needs secagg+
    "results-dir": 'runs/with "quotes", back\\slash, tab\tand é',
}


@pytest.mark.parametrize("config", [RunConfig(), RunConfig.from_mapping(NON_DEFAULT)],
                         ids=["defaults", "non-defaults"])
def test_config_to_toml_round_trip(config, tmp_path):
    assert set(NON_DEFAULT) == set(RunConfig().to_mapping())  # the example covers every key
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config), encoding="utf-8")
    assert load_config(path) == config
    # written values keep their types (an int stays an int, a float a float)
    flat = tomllib.loads(path.read_text(encoding="utf-8"))
    assert flat == config.to_mapping()
    assert all(type(flat[k]) is type(v) for k, v in config.to_mapping().items())


def test_config_to_toml_round_trip_astral_characters(tmp_path):
    config = RunConfig(results_dir="runs/\U0001F600\x7f")
    path = tmp_path / "config.toml"
    path.write_text(config_to_toml(config), encoding="utf-8")
    assert load_config(path) == config


@pytest.mark.parametrize("overrides, key", [
    ({"client-dp": "ldp"}, "client-dp"),
    ({"client-dp": "dpsgd", "mechanism": "hog"}, "client-dp"),
    ({"client-dp": "dpsgd", "mechanism": "gaussian", "optimizer": "hog-step"}, "client-dp"),
    ({"dpsgd-max-grad-norm": 0.0}, "dpsgd-max-grad-norm"),
    ({"dpsgd-accountant": "moments"}, "dpsgd-accountant"),
    ({"dpsgd-noise": "torch"}, "dpsgd-noise"),
    ({"server-optimizer": "lamb"}, "server-optimizer"),
    ({"server-momentum": 1.0}, "server-momentum"),
    ({"server-beta2": -0.5}, "server-beta2"),
    ({"server-tau": 0.0}, "server-tau"),
    ({"adaptive-clipping": True, "mechanism": "none"}, "adaptive-clipping"),
    ({"adaptive-clipping": True, "target-quantile": 1.0}, "target-quantile"),
    ({"adaptive-clipping": True, "count-noise-std": 0.4, "noise-multiplier": 1.0}, "count-noise-std"),
])
def test_client_dp_and_adaptive_clipping_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key):
        RunConfig().with_overrides(overrides)


def test_noise_multiplier_and_target_epsilon_together_are_refused(tmp_path):
    path = tmp_path / "both.toml"
    path.write_text("noise-multiplier = 1.2\ntarget-epsilon = 3.0\n")
    with pytest.raises(ConfigError, match=r"noise-multiplier=1.2 and target-epsilon=3.0 are both set"):
        load_config(path)
    with pytest.raises(ConfigError, match="both set"):
        load_config(None, {"noise-multiplier": 1.2, "target-epsilon": 3.0})
    # an override of one replaces the file's other
    path.write_text("noise-multiplier = 1.2\n")
    assert load_config(path, {"target-epsilon": 3.0}).target_epsilon == 3.0
    with pytest.raises(ConfigError, match="target-epsilon"):
        RunConfig().with_overrides({"target-epsilon": -2.0})


def test_an_unknown_activation_names_the_key_and_the_choices():
    with pytest.raises(ConfigError, match="activation='sine'") as info:
        RunConfig.from_mapping({"activation": "sine"})
    assert all(name in str(info.value) for name in ("tanh", "relu", "silu", "gelu", "softplus"))


def test_an_unknown_normalization_names_the_key_the_value_and_the_choices():
    with pytest.raises(ConfigError, match="normalization='batch'") as info:
        RunConfig.from_mapping({"normalization": "batch"})
    assert all(name in str(info.value) for name in ("none", "group", "ws", "group-ws"))
