"""Exported models predict what the trained model predicts, also in a fresh process; bad folders are clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from fedhog.client_app import app as client_app
from fedhog.config import RunConfig
from fedhog.data import dataset_info, load_test_set
from fedhog.engines.inprocess import run_in_process
from fedhog.export import ExportError, export_model, load_trained_model
from fedhog.models import MODELS, build_model
from fedhog.results import config_to_toml
from fedhog.server_app import app as server_app

TINY = {"dataset": "digits", "model": "cnn2d", "population": 2, "sampling-rate": 1.0, "rounds": 1,
        "partitioner": "iid", "mechanism": "none", "privacy-seed": 3}

DATASET_OF = {"cnn1d": "synthetic"}  # inputs [B, 60]; the other models take the digits' [B, 1, 8, 8]

RELOAD = """
import sys, torch
extra = {"fedhog/model.json": ""}
module = torch.jit.load(sys.argv[1], _extra_files=extra)
inputs = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save({"logits": module(inputs), "unbatched_channel": module(inputs[:, 0]),
                "training": module.training, "metadata": extra["fedhog/model.json"]}, sys.argv[3])
"""


pytestmark = pytest.mark.usefixtures("shared_cache")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A results folder of a one-round in-process run."""
    directory = tmp_path_factory.mktemp("trained") / "run"
    config = RunConfig().with_overrides({**TINY, "results-dir": str(directory)})
    run_in_process(server_app, client_app, config.population, config.to_mapping())
    return directory


def _config(model: str) -> RunConfig:
    return RunConfig().with_overrides({**TINY, "model": model, "dataset": DATASET_OF.get(model, "digits")})


def _hand_made(tmp_path, model: str, state: dict | None = None):
    """A results folder written by hand: config.toml and final_model.pt of a fresh model."""
    config = _config(model)
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.toml").write_text(config_to_toml(config))
    torch.manual_seed(0)
    network = build_model(model, *dataset_info(config.data_spec))
    torch.save(state if state is not None else network.state_dict(), tmp_path / "final_model.pt")
    return tmp_path, network.eval()


@pytest.mark.subprocess
@pytest.mark.slow
def test_torchscript_reloads_in_a_fresh_process_and_predicts_the_same(trained, tmp_path):
    path = export_model(trained, "torchscript", tmp_path / "out" / "model.pt")
    assert path == tmp_path / "out" / "model.pt"
    model = load_trained_model(trained).model
    inputs = torch.as_tensor(load_test_set(RunConfig().with_overrides(TINY).data_spec).x[:64])
    torch.save(inputs, tmp_path / "inputs.pt")
    subprocess.run([sys.executable, "-c", RELOAD, str(path), str(tmp_path / "inputs.pt"), str(tmp_path / "out.pt")],
                   check=True, timeout=120)
    reloaded = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = model(inputs)
    torch.testing.assert_close(reloaded["logits"], expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(reloaded["unbatched_channel"], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(reloaded["logits"].argmax(1), expected.argmax(1))
    assert reloaded["training"] is False
    assert json.loads(reloaded["metadata"]) == {"model": "cnn2d", "dataset": "digits", "input_shape": [1, 8, 8],
                                                "num_classes": 10, "input_dtype": "float32"}


def test_default_output_is_in_the_results_folder(trained):
    assert export_model(trained) == trained / "model.torchscript.pt"
    assert export_model(trained, "state-dict") == trained / "model.state_dict.pt"


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("model", MODELS)
def test_every_model_exports_to_both_formats(tmp_path, model):
    directory, network = _hand_made(tmp_path, model)
    config = _config(model)
    inputs = torch.as_tensor(load_test_set(config.data_spec).x[:16])
    with torch.no_grad():
        expected = network(inputs)
        scripted = torch.jit.load(export_model(directory, "torchscript"))
        torch.testing.assert_close(scripted(inputs), expected, rtol=1e-6, atol=1e-6)
    fresh = build_model(model, *dataset_info(config.data_spec)).eval()
    fresh.load_state_dict(torch.load(export_model(directory, "state-dict"), weights_only=True))
    with torch.no_grad():
        assert torch.equal(fresh(inputs), expected)


def test_missing_results_folder(tmp_path):
    with pytest.raises(ExportError, match=r"has no config.toml"):
        export_model(tmp_path / "nowhere", "torchscript")


def test_unfinished_run(tmp_path):
    directory, _network = _hand_made(tmp_path, "logreg")
    (directory / "final_model.pt").rename(directory / "checkpoint.pt")
    with pytest.raises(ExportError, match=r"no final_model.pt .*did not finish"):
        export_model(directory, "torchscript")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "not-a-dict"])
def test_corrupt_weights(tmp_path, damage):
    directory, _ = _hand_made(tmp_path, "logreg")
    weights = directory / "final_model.pt"
    if damage == "garbage":
        weights.write_bytes(b"\x00not a torch file" * 10)
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[:200])
    else:
        torch.save([1, 2, 3], weights)
    with pytest.raises(ExportError, match=r"final_model.pt (is not a readable state dict|holds a list)"):
        export_model(directory, "state-dict")


def test_weights_of_another_model(tmp_path):
    _, logreg = _hand_made(tmp_path / "a", "logreg")
    directory, _ = _hand_made(tmp_path / "b", "mlp", state=logreg.state_dict())
    with pytest.raises(ExportError, match="does not fit model='mlp' for dataset='digits'"):
        export_model(directory, "torchscript")


def test_bad_config_and_format(tmp_path):
    directory, _ = _hand_made(tmp_path, "logreg")
    with pytest.raises(ExportError, match="fmt='onnx' is not allowed"):
        export_model(directory, "onnx")  # type: ignore[arg-type]
    (directory / "config.toml").write_text('model = "resnet"\n')
    with pytest.raises(ExportError, match="not a usable run config: model='resnet'"):
        export_model(directory, "torchscript")


def test_a_model_module_that_cannot_be_imported_here_is_one_line(tmp_path, monkeypatch, capsys):
    """A run with a user's model factory, exported from a folder where its module is not importable."""
    module = tmp_path / "src" / "my_export_model.py"
    module.parent.mkdir()
    module.write_text("from torch import nn\n\ndef make(input_shape, num_classes):\n"
                      "    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))\n")
    monkeypatch.chdir(module.parent)
    directory, _ = _hand_made(tmp_path / "run", "my_export_model:make")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_export_model", raising=False)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in (str(module.parent), "")])
    from fedhog import cli

    assert cli.main(["export", str(directory)]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    assert "model='my_export_model:make' cannot be imported" in lines[0] and "PYTHONPATH" in lines[0]


def test_a_folder_from_before_the_activation_key_rebuilds_its_tanh_model(tmp_path):
    """config.toml without `activation` was written when every built-in model used tanh: exporting it must not
    silently load tanh-trained weights into the new default activation."""
    folder, _network = _hand_made(tmp_path / "legacy", "mlp")
    text = (folder / "config.toml").read_text()
    (folder / "config.toml").write_text("\n".join(line for line in text.splitlines()
                                                  if not line.startswith("activation")) + "\n")
    rebuilt = load_trained_model(folder)
    assert rebuilt.config.activation == "tanh"
    assert any(isinstance(m, torch.nn.Tanh) for m in rebuilt.model.modules())
    current, _ = _hand_made(tmp_path / "current", "mlp")
    assert load_trained_model(current).config.activation == RunConfig().activation
