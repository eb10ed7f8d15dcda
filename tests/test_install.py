"""A regular (non-editable) install in a fresh venv runs `fedhog run`, outside any checkout, from a shell that has
not activated the venv (as pipx does): the packaged quickstart, the Flower app bundle written at run time, Flower's
executables found beside the interpreter — and nothing left running, nothing written to ~/.flwr.

Torch is the one dependency the venv does not install itself: the README installs it first, from the CPU index, and
unpacking its ~900 MB again took over a minute, so the venv gets this interpreter's own torch through a folder of links
on its path (pip sees torch installed and installs its dependencies). Everything else, fedhog's wheel and its other
dependencies with their executables, is installed into the venv (1–2 minutes from this machine's local package files).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from helpers import read_metrics
from tagged import new_tag, tagged

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]
CHECKOUT = Path(__file__).resolve().parents[1]
TINY = ["dataset=digits", "population=4", "sampling-rate=0.5", "rounds=2", "partitioner=iid"]


def _share_torch(venv: Path, links: Path) -> None:
    """Put this interpreter's torch on ``venv``'s path: links to its packages and dist-info in ``links``, and a
    ``.pth`` line naming that folder (nothing else of this interpreter's site-packages comes with it)."""
    torch_dist = importlib.metadata.distribution("torch")
    site = Path(str(torch_dist.locate_file("")))
    tops = {Path(str(f)).parts[0] for f in torch_dist.files or []} - {".."}  # ".." is the scripts in bin/
    links.mkdir()
    for top in sorted(tops):
        (links / top).symlink_to(site / top)
    (site_packages,) = (venv / "lib").glob("python*/site-packages")
    (site_packages / "shared_torch.pth").write_text(f"{links}\n")


def _pip(venv: Path, *args: str) -> None:
    # --no-compile: the modules a run imports are compiled when first imported, not every module of every package
    done = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *args],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with fedhog installed from a wheel built out of a copy of the checkout."""
    base = tmp_path_factory.mktemp("install")
    source = base / "source"  # a copy, so that building leaves nothing (build/) in the checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(CHECKOUT / name, source / name)
    shutil.copytree(CHECKOUT / "fedhog", source / "fedhog", ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(base / "dist"),
                            str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    _share_torch(venv, base / "torch-links")  # the CPU build this machine has (README: CPU index), not unpacked again
    _pip(venv, str(next((base / "dist").glob("fedhog-*.whl"))))
    return venv


def test_the_installed_package_is_not_the_checkout(installed):
    where = subprocess.run([str(installed / "bin" / "python"), "-c", "import fedhog; print(fedhog.__file__)"],
                           capture_output=True, text=True, cwd="/", check=True).stdout.strip()
    assert Path(where).is_relative_to(installed) and "site-packages" in where


USER_MODEL = """
import math
from torch import nn

def tanh_mlp(input_shape, num_classes):
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), 6), nn.Tanh(), nn.Linear(6, num_classes))
"""


def test_the_venvs_fedhog_runs_the_simulation_engine_unactivated(installed, tmp_path):
    """...with a user's model factory from the working directory, which Flower's processes, started in other
    folders, import too (fedhog puts the working directory on their PYTHONPATH)."""
    home, elsewhere = tmp_path / "home", tmp_path / "elsewhere"
    home.mkdir()
    elsewhere.mkdir()
    (elsewhere / "fh_user_models.py").write_text(USER_MODEL)
    tag = new_tag()
    with tempfile.TemporaryDirectory(prefix="ray", dir="/tmp") as ray:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "RAY_TMPDIR": ray, **tag,  # no venv on PATH
               "FEDHOG_CACHE": os.environ.get("FEDHOG_CACHE", str(home / ".cache" / "fedhog")),
               "PYTHONDONTWRITEBYTECODE": "1"}  # the factory's __pycache__ would be the only other file there
        command = [str(installed / "bin" / "fedhog"), "run", "--engine", "simulation"]  # the packaged quickstart, tiny
        for setting in [*TINY, 'model="fh_user_models:tanh_mlp"']:
            command += ["--set", setting]
        done = subprocess.run(command, env=env, cwd=elsewhere, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (results,) = (elsewhere / "results").iterdir()
    metrics = read_metrics(results)
    assert metrics["status"] == "finished" and len(metrics["rounds"]) == 2
    assert metrics["config"]["server-optimizer"] == "momentum"  # the quickstart's, not the default "sgd"
    assert metrics["launch"] == {"command": "run", "engine": "simulation", "client_cpus": 1}
    assert tagged(tag) == {}  # SuperLink, SuperExec, flwr-simulation, Ray: all stopped
    assert not (home / ".flwr").exists()  # fedhog's FLWR_HOME was private
    assert metrics["config"]["model"] == "fh_user_models:tanh_mlp"
    assert sorted(p.name for p in elsewhere.iterdir()) == ["fh_user_models.py", "results"]


def test_the_installed_package_carries_its_subpackages(installed, tmp_path):
    """`fedhog sweep --list` from the wheel's venv imports every part of fedhog.sweep (a subpackage)."""
    sweep = tmp_path / "sweep.toml"
    sweep.write_text('output = "out"\n[base]\ndataset = "digits"\n[grid]\nseed = [0, 1]\n')
    done = subprocess.run([str(installed / "bin" / "fedhog"), "sweep", str(sweep), "--list"], cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (done.stdout + done.stderr).split() == ["to", "run", "seed=0", "to", "run", "seed=1"]
