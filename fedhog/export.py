"""Export the final model of a results folder for serving: TorchScript or a plain state dict.

The model is rebuilt from the folder's ``config.toml`` (model, dataset shape)
and ``final_model.pt``. TorchScript is what LibTorch (``torch::jit::load``) and
DJL's PyTorch engine load; the file also carries ``fedhog/config.toml`` and
``fedhog/model.json`` (input shape, classes) as extra files.
"""

from __future__ import annotations

import io
import json
import pickle
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .choices import EXPORT_FORMATS as FORMATS
from .choices import ExportFormat
from .config import RunConfig, read_toml
from .data import dataset_info
from .files import atomic_write
from .models import build_model
from .results import load_run_config

SUFFIXES = {"torchscript": "model.torchscript.pt", "state-dict": "model.state_dict.pt"}


class ExportError(ValueError):
    """A results folder whose model cannot be exported."""


@dataclass(frozen=True)
class TrainedModel:
    """The final model of a run (eval mode, CPU) and what it takes."""

    model: nn.Module
    config: RunConfig
    input_shape: tuple[int, ...]
    num_classes: int


def load_trained_model(results_dir: Path) -> TrainedModel:
    """Rebuild the final model of ``results_dir`` from its ``config.toml`` and ``final_model.pt``.

    Raises
    ------
    ExportError
        If ``config.toml`` or ``final_model.pt`` is missing, unreadable or does not fit the other.
    """
    results_dir = Path(results_dir)
    config_path, weights_path = results_dir / "config.toml", results_dir / "final_model.pt"
    if not config_path.is_file():
        raise ExportError(f"results_dir={str(results_dir)!r} has no config.toml: not a fedhog results folder")
    try:
        # A folder written before the activation became a key trained tanh models (fedhog.models.ACTIVATIONS).
        legacy = {} if "activation" in read_toml(config_path) else {"activation": "tanh"}
        config = load_run_config(results_dir, legacy)
        input_shape, num_classes = dataset_info(config.data_spec)
    except ValueError as error:  # ConfigError, or a dataset the data module rejects
        raise ExportError(f"{config_path} is not a usable run config: {error}") from None
    if not weights_path.is_file():
        unfinished = (" (checkpoint.pt is there: the run did not finish; `fedhog run --resume` it)"
                      if (results_dir / "checkpoint.pt").is_file() else "")
        raise ExportError(f"results_dir={str(results_dir)!r} has no final_model.pt{unfinished}")
    try:
        state = torch.load(weights_path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as error:
        raise ExportError(f"{weights_path} is not a readable state dict: {error}") from None
    if not isinstance(state, dict):
        raise ExportError(f"{weights_path} holds a {type(state).__name__}, not a state dict")
    try:
        model = build_model(config.model, input_shape, num_classes, config.activation, config.normalization)
    except ValueError as error:  # a user's factory that cannot be imported from here, or that failed
        raise ExportError(f"{config_path}: {error}; run fedhog export where the run was started, or put the "
                          "model's module on PYTHONPATH") from None
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise ExportError(f"{weights_path} does not fit model={config.model!r} for dataset="
                          f"{config.dataset!r} (input shape {input_shape}): {error}") from None
    return TrainedModel(model.eval(), config, input_shape, num_classes)


def export_model(
    results_dir: Path,
    fmt: ExportFormat = "torchscript",
    out: Path | None = None,
) -> Path:
    """Write the final model of ``results_dir`` as TorchScript or as a state dict; return the file.

    Parameters
    ----------
    results_dir : Path
        A fedhog results folder (``config.toml``, ``final_model.pt``).
    fmt : {"torchscript", "state-dict"}
        ``torchscript``: a scripted eval-mode module mapping ``[B, *input_shape]``
        float32 to logits ``[B, num_classes]`` (checked against the eager model on
        an example input). ``state-dict``: ``torch.save`` of the CPU state dict.
    out : Path or None
        The file to write; default ``model.torchscript.pt`` / ``model.state_dict.pt`` in ``results_dir``.

    Raises
    ------
    ExportError
        For an unknown ``fmt`` or a missing or corrupt results folder.
    """
    if fmt not in FORMATS:
        raise ExportError(f"fmt={fmt!r} is not allowed; expected one of {', '.join(FORMATS)}")
    trained = load_trained_model(results_dir)
    model, config = trained.model, trained.config
    out = Path(out) if out is not None else Path(results_dir) / SUFFIXES[fmt]
    out.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    if fmt == "state-dict":
        torch.save({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}, buffer)
    else:
        example = torch.randn(2, *trained.input_shape, generator=torch.Generator().manual_seed(0))
        with warnings.catch_warnings():  # TorchScript is deprecated in PyTorch, but it is what LibTorch and DJL load
            warnings.simplefilter("ignore", DeprecationWarning)
            scripted = torch.jit.script(model)
            with torch.no_grad():
                if not torch.allclose(scripted(example), model(example), rtol=1e-5, atol=1e-6):
                    raise ExportError(f"the TorchScript of model={config.model!r} disagrees with the eager model")
            metadata = {"model": config.model, "dataset": config.dataset, "input_shape": list(trained.input_shape),
                        "num_classes": trained.num_classes, "input_dtype": "float32"}
            extra_files = {"fedhog/config.toml": (Path(results_dir) / "config.toml").read_text(),
                           "fedhog/model.json": json.dumps(metadata)}
            torch.jit.save(scripted, buffer, _extra_files=extra_files)
    atomic_write(out, buffer.getvalue())
    return out
