"""The Flower app bundle fedhog writes at run time is the checkout's Flower app, and Flower accepts it."""

import tomllib
from pathlib import Path

from flwr.cli.config_utils import load_and_validate

from fedhog.app_bundle import write_app_bundle
from fedhog.config import RunConfig

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_the_bundle_is_the_checkouts_app_with_every_default(tmp_path):
    folder = write_app_bundle(tmp_path / "app")
    assert [p.name for p in folder.iterdir()] == ["pyproject.toml"]
    with open(folder / "pyproject.toml", "rb") as handle:
        bundle = tomllib.load(handle)
    with open(PYPROJECT, "rb") as handle:
        checkout = tomllib.load(handle)
    assert bundle["tool"]["flwr"]["app"] == checkout["tool"]["flwr"]["app"]
    assert bundle["tool"]["flwr"]["app"]["config"] == RunConfig().to_mapping()
    assert bundle["project"]["name"] == checkout["project"]["name"]


def test_flower_validates_the_bundle_without_warnings(tmp_path):
    folder = write_app_bundle(tmp_path / "app")
    config, warnings = load_and_validate(folder / "pyproject.toml")  # imports nothing from the folder
    assert warnings == []
    assert config["tool"]["flwr"]["app"]["components"]["serverapp"] == "fedhog.server_app:app"
