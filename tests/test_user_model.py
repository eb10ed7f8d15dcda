"""Your model: ``model = "package.module:factory"`` through training, the third-order term, the engines and export."""

from __future__ import annotations

import textwrap

import numpy as np
import pandas as pd
import pytest
import torch

import fedhog
from fedhog.config import ConfigError, load_config
from fedhog.derivatives import third_order_vector
from fedhog.engines import check_inputs
from fedhog.engines.vectorized import unbatchable_reason
from fedhog.export import export_model
from fedhog.models import build_model

MODULE = "fh_user_models"  # written into a temporary folder on sys.path by the fixture
SOURCE = textwrap.dedent('''
    import math
    import torch
    from torch import nn

    def tanh_mlp(input_shape, num_classes):
        return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 6), nn.Tanh(), nn.Linear(6, num_classes))

    class Erf(nn.Module):  # an operation the Taylor engine has no rule for
        def __init__(self, features, num_classes):
            super().__init__()
            self.linear, self.head = nn.Linear(features, 5), nn.Linear(5, num_classes)

        def forward(self, x):
            return self.head(torch.special.erf(self.linear(x)))

    def erf_model(input_shape, num_classes):
        return Erf(math.prod(input_shape), num_classes)

    def batchnorm_model(input_shape, num_classes):
        return nn.Sequential(nn.Linear(math.prod(input_shape), 4), nn.BatchNorm1d(4), nn.Tanh(),
                             nn.Linear(4, num_classes))

    def one_output(input_shape, num_classes):
        return nn.Linear(math.prod(input_shape), 1)

    def raises(input_shape, num_classes):
        raise RuntimeError("no GPU here")

    def not_a_module(input_shape, num_classes):
        return "a string"

    NOT_CALLABLE = 3
''')


@pytest.fixture
def table(tmp_path, monkeypatch):
    (tmp_path / f"{MODULE}.py").write_text(SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 3))
    pd.DataFrame({"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "bank": rng.integers(0, 4, 240),
                  "y": (x[:, 0] + 0.3 * rng.normal(size=240) > 0.8).astype(int)}).to_csv(tmp_path / "t.csv",
                                                                                        index=False)
    monkeypatch.chdir(tmp_path)
    return tmp_path / "t.csv"


def _config(path, model="tanh_mlp", **keys):
    return load_config({"dataset": f"csv:{path}", "label-column": "y", "client-column": "bank", "population": 4,
                        "sampling-rate": 0.5, "delta": 1e-3, "model": f"{MODULE}:{model}", "rounds": 2,
                        "batch-size": 16, "metrics": "accuracy,auroc,auprc", "privacy-seed": 7, "hog-batch-size": 8,
                        **keys})


def test_the_factory_receives_the_example_shape_and_the_number_of_classes(table):
    model = build_model(f"{MODULE}:tanh_mlp", (3,), 2)
    assert model[1].in_features == 3 and model[3].out_features == 2


@pytest.mark.parametrize("model, expected", [
    ("no_such_module:factory", ["model='no_such_module:factory' cannot be imported", "No module named",
                                "PYTHONPATH"]),
    (f"{MODULE}:missing", [f"model='{MODULE}:missing'", "has no attribute 'missing'"]),
    (f"{MODULE}:NOT_CALLABLE", ["is a int, not a callable factory"]),
    (f"{MODULE}:raises", ["raised RuntimeError: no GPU here when called as raises(input_shape=(3,), num_classes=2)"]),
    (f"{MODULE}:not_a_module", ["returned a str", "expected a torch.nn.Module"]),
    (f"{MODULE}:one_output", ["maps a batch of shape (2, 3) to (2, 1); expected (2, 2)", "num_classes=2"]),
])
def test_a_bad_factory_is_refused_before_the_run_naming_model(table, model, expected):
    config = load_config({"dataset": f"csv:{table}", "label-column": "y", "client-column": "bank",
                          "population": 4, "sampling-rate": 0.5, "delta": 1e-3, "model": model})
    with pytest.raises(ConfigError) as error:
        check_inputs(config)
    assert str(error.value).startswith("model: model=") and all(part in str(error.value) for part in expected), \
        str(error.value)


def test_a_model_name_that_is_no_factory_is_refused_naming_what_is_allowed():
    with pytest.raises(ConfigError, match=r"model='my model' is not allowed; expected one of logreg, mlp, cnn1d, "
                                          "cnn2d or 'package.module:factory'"):
        load_config({"model": "my model"})


def test_the_third_order_term_of_a_model_without_taylor_rules_falls_back_to_torch_func(table):
    model = build_model(f"{MODULE}:erf_model", (3,), 2)
    params = {k: p.detach() for k, p in model.named_parameters()}
    direction = {k: torch.randn_like(p) for k, p in params.items()}
    result = third_order_vector(model, torch.randn(8, 3), torch.randint(0, 2, (8,)), direction, loss="cross_entropy")
    assert result.method == "torch.func" and result.finite
    reference = third_order_vector(model, torch.randn(8, 3), torch.randint(0, 2, (8,)), direction,
                                   loss="cross_entropy", method="autograd")
    assert reference.finite and set(reference.vector) == set(params)


def test_the_vectorized_engine_trains_a_users_model_as_the_inprocess_engine_does(table):
    runs = {engine: fedhog.run(_config(table), engine=engine, results_dir=str(table.parent / engine))
            for engine in ("inprocess", "vectorized")}
    weights = {engine: torch.load(run.directory / "final_model.pt") for engine, run in runs.items()}
    for key, value in weights["inprocess"].items():
        torch.testing.assert_close(weights["vectorized"][key], value, rtol=1e-4, atol=1e-5)
    rounds = runs["vectorized"].rounds
    assert len(rounds) == 2 and all(0 <= r["auprc"] <= 1 and 0 <= r["auroc"] <= 1 for r in rounds)


def test_a_model_with_buffers_runs_client_by_client_on_the_vectorized_engine(table):
    config = _config(table, "batchnorm_model", mechanism="gaussian", rounds=1)
    assert "buffers (1.running_mean" in unbatchable_reason(config)
    result = fedhog.run(config, engine="vectorized")
    assert result.summary["rounds_completed"] == 1


def test_a_trained_users_model_exports_to_torchscript(table):
    result = fedhog.run(_config(table, "erf_model", mechanism="none", rounds=1, **{"noise-multiplier": 0.0}),
                        engine="vectorized")
    scripted = torch.jit.load(str(export_model(result.directory)))
    eager = build_model(f"{MODULE}:erf_model", (3,), 2)
    eager.load_state_dict(torch.load(result.directory / "final_model.pt"))
    x = torch.randn(5, 3)
    torch.testing.assert_close(scripted(x), eager.eval()(x))



# The Simulation Engine importing a factory from the working directory (Flower's processes start in other folders,
# and fedhog puts the working directory on their PYTHONPATH) is shown by the installed package's Simulation Engine
# run in tests/test_install.py, which runs a factory module of its working directory: one Ray start instead of two.
