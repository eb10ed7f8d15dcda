"""Helpers the test files share (fixtures live in ``conftest.py``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from fedhog.checkpoint import CheckpointError, load_checkpoint


def read_metrics(directory: Path) -> dict[str, Any]:
    """The ``metrics.json`` of the results folder ``directory``."""
    return json.loads((Path(directory) / "metrics.json").read_text())


def read_run(directory: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The ``metrics.json`` and the final model (a state dict) of the results folder ``directory``."""
    return read_metrics(directory), torch.load(Path(directory) / "final_model.pt")


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same keys and bitwise-equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def set_args(*settings: str) -> list[str]:
    """``--set KEY=VALUE`` arguments of the CLI, one pair per setting."""
    return [part for setting in settings for part in ("--set", setting)]


def wait_for_checkpoint(process: subprocess.Popen, results: Path, round_: int, *, timeout: float = 300,
                        poll: float = 0.05) -> None:
    """Wait until the run ``process`` writes into ``results`` has checkpointed round ``round_``; it must not exit."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if load_checkpoint(results).round >= round_:
                return
        except CheckpointError:
            pass
        assert process.poll() is None, process.communicate()[0]
        time.sleep(poll)


def call_at(model: torch.nn.Module, params: dict[str, torch.Tensor], f: Callable[..., Any], *args: Any,
            **kwargs: Any) -> Any:
    """``f(model, ...)`` with the model's parameters set to ``params`` (restored afterwards): finite differences."""
    saved = {k: p.detach().clone() for k, p in model.named_parameters()}
    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(params[k])
    try:
        return f(model, *args, **kwargs)
    finally:
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(saved[k])


def load_simulation(name: str) -> ModuleType:
    """The script ``simulations/<name>.py`` as a module (the folder is not a package)."""
    path = Path(__file__).resolve().parents[1] / "simulations" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
